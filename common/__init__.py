"""gradserver.common: what both sides share: component ids, errors, timeouts, configuration.

The wire codec (`gradserver.common.codec`) and the generated protobuf modules stay behind this
package; the coordinator and the workers exchange the plain types of
`gradserver.common.messages`.
"""

from .components import (
    BLOCK_GRAD_COMPONENTS,
    BlockComponent,
    NonBlockComponent,
    compute_block_sizes,
)
from .errors import (
    AbortedError,
    CoordinatorShutdownError,
    DeadlineExceededError,
    FailedPreconditionError,
    GradServerError,
    InternalError,
    InvalidArgumentError,
    PermissionDeniedError,
    ResourceExhaustedError,
    UnauthenticatedError,
    UnavailableError,
)
from .sample_ranges import batches_of_rank, shard_batches
from .timeouts import Timeouts

__all__ = [
    "BLOCK_GRAD_COMPONENTS",
    "AbortedError",
    "BlockComponent",
    "CoordinatorShutdownError",
    "DeadlineExceededError",
    "FailedPreconditionError",
    "GradServerError",
    "InternalError",
    "InvalidArgumentError",
    "NonBlockComponent",
    "PermissionDeniedError",
    "ResourceExhaustedError",
    "Timeouts",
    "UnauthenticatedError",
    "UnavailableError",
    "batches_of_rank",
    "compute_block_sizes",
    "shard_batches",
]
