"""Global-norm gradient clipping with no device-to-host synchronisation.

The per-tensor norms, the global norm and the scale all stay device tensors (`_foreach_norm`,
`_foreach_mul_`), so clipping can run inside a step without stalling the host, as the reference's
fused clip does on CUDA. The scale is min(1, max_norm / (norm + eps)); tensors are always
multiplied (by exactly 1 when under the limit) so no branch needs the norm on the host.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from gradserver.common.errors import InvalidArgumentError

EPS = 1e-6


def global_norm(grads: Sequence[torch.Tensor]) -> torch.Tensor:
    """The L2 norm of all tensors together, as a float32 device tensor (no sync)."""
    if not grads:
        raise InvalidArgumentError("global_norm needs at least one tensor")
    norms = torch._foreach_norm(list(grads), 2)
    total: torch.Tensor = torch.linalg.vector_norm(torch.stack(norms).float(), 2)
    return total


def clip_by_global_norm_(grads: Sequence[torch.Tensor], max_norm: float) -> torch.Tensor:
    """Scales `grads` in place so their global norm is at most `max_norm`; returns the norm
    before clipping (a device tensor)."""
    if not max_norm > 0:
        raise InvalidArgumentError(f"max_norm must be positive, got {max_norm}")
    total = global_norm(grads)
    scale = torch.clamp(max_norm / (total + EPS), max=1.0)
    torch._foreach_mul_(list(grads), scale.to(grads[0].dtype))
    return total
