"""The old home of the averaging engines (gradserver.train.engines), from when "backend" also
named them; "backend" is now only the torch.distributed backend. Importing it warns; it goes in
the next release.
"""

from __future__ import annotations

import warnings

from .engines import AveragingEngine, CoordinatorEngine, LocalEngine, LocalHub, TorchDistributedEngine

warnings.warn(
    "gradserver.train.backends is deprecated and goes in the next release: use gradserver.train.engines "
    "(GradientBackend -> AveragingEngine, RemoteBackend -> CoordinatorEngine, LocalBackend -> "
    "LocalEngine, TorchDistributedBackend -> TorchDistributedEngine)",
    DeprecationWarning,
    stacklevel=2,
)

GradientBackend = AveragingEngine
RemoteBackend = CoordinatorEngine
LocalBackend = LocalEngine
TorchDistributedBackend = TorchDistributedEngine

__all__ = ["GradientBackend", "LocalBackend", "LocalHub", "RemoteBackend", "TorchDistributedBackend"]
