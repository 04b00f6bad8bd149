"""gradserver.server: the coordinator (GradientServer) that averages every worker's gradients."""

from gradserver.common.config import CoordinatorConfig

from .coordinator import GradientServer

__all__ = ["CoordinatorConfig", "GradientServer"]
