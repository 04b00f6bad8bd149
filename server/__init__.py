"""gradserver.server: the coordinator (GradientServer) that averages every worker's gradients."""

from .config import CoordinatorConfig
from .coordinator import GradientServer

__all__ = ["CoordinatorConfig", "GradientServer"]
