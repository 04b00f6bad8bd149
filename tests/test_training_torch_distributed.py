"""The trainer's torch.distributed engine reduces the gradients and the loss on the gradients'
device (with NCCL: on the GPU, never through the CPU)."""

from __future__ import annotations

import pytest
import torch

from gradserver.common import compute_block_sizes

SIZES = compute_block_sizes(8, 4, 16)


def test_torch_distributed_loss_is_reduced_on_the_gradients_device(monkeypatch) -> None:
    import torch.distributed as dist

    from gradserver.train.engines import TorchDistributedEngine

    reduced: list[torch.Tensor] = []

    class _Work:
        def wait(self) -> None:
            return None

    def all_reduce(tensor: torch.Tensor, async_op: bool = False) -> _Work:
        reduced.append(tensor)
        return _Work()

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_rank", lambda: 0)
    monkeypatch.setattr(dist, "get_world_size", lambda: 2)
    monkeypatch.setattr(dist, "get_backend", lambda: "nccl")
    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    backend = TorchDistributedEngine()
    backend.start_step(0)
    backend.submit_block(0, 1, torch.zeros(sum(SIZES), device="meta"), SIZES)
    backend.submit_loss(2.5, 8)
    assert [t.device.type for t in reduced] == ["meta", "meta"]
    assert reduced[1].dtype == torch.float64


@pytest.mark.skipif(
    not torch.cuda.is_available() or not torch.distributed.is_nccl_available(), reason="needs a CUDA GPU"
)
def test_nccl_engine_averages_gradients_and_loss_on_the_gpu(tmp_path) -> None:
    import torch.distributed as dist

    from gradserver.train.engines import TorchDistributedEngine

    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("nccl", store=store, rank=0, world_size=1)
    backend = TorchDistributedEngine()
    try:
        backend.start_step(0)
        backend.submit_block(0, 1, torch.full((sum(SIZES),), 2.0, device="cuda"), SIZES)
        backend.submit_loss(2.5, 8)
        [(key, average)] = backend.finish()
        assert key == ("block", 0) and average.device.type == "cuda"
        assert torch.equal(average.cpu(), torch.full((sum(SIZES),), 2.0))
        assert backend.global_loss() == pytest.approx(2.5)
    finally:
        backend.close()
