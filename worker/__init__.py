"""gradserver.worker: the client a training process uses to average gradients.

from gradserver.worker import WorkerClient
with WorkerClient.connect("127.0.0.1:50051", node_id="n0", device_type="cpu") as client:
    client.send_block_gradient(step, block_idx, num_blocks, grads, component_sizes)
    avg = client.receive_averaged_block()
"""

from gradserver.common.timeouts import Timeouts

from .client import WorkerClient
from .recovery import RecoveredState, StateSnapshot, decode_extra, encode_extra, state_digest
from .results import (
    AveragedBlock,
    AveragedGradients,
    AveragedNonBlock,
    AveragedTensor,
    SampleRangeAssignment,
)
from .transports import PeerReceive, PeerSend

# The old name of SampleRangeAssignment ("shard" now names nothing); goes in the next release.
ShardAssignment = SampleRangeAssignment

__all__ = [
    "AveragedBlock",
    "AveragedGradients",
    "AveragedNonBlock",
    "AveragedTensor",
    "PeerReceive",
    "PeerSend",
    "RecoveredState",
    "SampleRangeAssignment",
    "ShardAssignment",
    "StateSnapshot",
    "Timeouts",
    "WorkerClient",
    "decode_extra",
    "encode_extra",
    "state_digest",
]
