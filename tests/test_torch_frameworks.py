"""What torch builds on process groups, on the gradserver backend, against gloo's run.

Two real ranks per backend (spawned processes, file:// rendezvous). With two ranks every reduction
has two inputs, which gradserver sums exactly as gloo does, so losses and parameters are bit-equal.
- FSDP2 and DTensor: they start (a DeviceMesh needs the group's name); `fully_shard` on every
  layer and the model, AdamW, `clip_grad_norm_` (a SUM allreduce of DTensor norms), 10 steps,
  then `full_tensor()` (a functional all-gather) of every parameter.
- DDP with the PowerSGD communication hook: it chains collectives in future callbacks, which
  deadlocked the group's thread.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from .helpers.ranks import rank_results, spawn_and_join

pytestmark = [pytest.mark.processes, pytest.mark.timeout(300)]

STEPS = 10
RANK_TIMEOUT_S = 180.0


def _fsdp_rank(rank: int, backend: str, store_path: str, out_dir: str) -> None:
    from torch.distributed._functional_collectives import all_reduce as functional_all_reduce
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, distribute_tensor

    import gradserver.torch  # noqa: F401 - registers "gradserver"

    dist.init_process_group(backend, init_method=f"file://{store_path}", rank=rank, world_size=2)
    out = Path(out_dir)
    try:
        mesh = init_device_mesh("cpu", (2,))
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            torch.nn.Linear(16, 32),
            torch.nn.ReLU(),
            torch.nn.Linear(32, 32),
            torch.nn.ReLU(),
            torch.nn.Linear(32, 4),
        )
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
        losses, norms = [], []
        for step in range(STEPS):
            generator = torch.Generator().manual_seed(100 + 10 * step + rank)
            x, y = torch.randn(8, 16, generator=generator), torch.randn(8, 4, generator=generator)
            loss = ((model(x) - y) ** 2).mean()
            optimizer.zero_grad()
            loss.backward()
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0).full_tensor())
            optimizer.step()
            losses.append(loss.detach())
        params = {name: p.full_tensor() for name, p in model.named_parameters()}
        # DTensor and functional collectives directly.
        source = torch.arange(12.0).reshape(4, 3) if rank == 0 else torch.zeros(4, 3)
        replicated = distribute_tensor(source, mesh, [Replicate()]).to_local()
        summed = functional_all_reduce(torch.full((5,), float(rank + 1)), "sum", mesh)
        torch.save(
            {
                "losses": torch.stack(losses),
                "norms": torch.stack(norms),
                "params": params,
                "replicated": replicated,
                "summed": summed.wait() if hasattr(summed, "wait") else summed,
            },
            out / f"rank{rank}.pt",
        )
    except Exception as exc:
        (out / f"rank{rank}.error").write_text(f"{type(exc).__name__}: {exc}")
    finally:
        dist.destroy_process_group()


def _powersgd_rank(rank: int, backend: str, store_path: str, out_dir: str) -> None:
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

    import gradserver.torch  # noqa: F401 - registers "gradserver"

    dist.init_process_group(backend, init_method=f"file://{store_path}", rank=rank, world_size=2)
    out = Path(out_dir)
    try:
        torch.manual_seed(0)
        model = torch.nn.parallel.DistributedDataParallel(
            torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
        )
        state = powerSGD_hook.PowerSGDState(
            process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=2, min_compression_rate=0.5
        )
        model.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        params = []
        for step in range(2 * STEPS):
            generator = torch.Generator().manual_seed(100 + 10 * step + rank)
            x, y = torch.randn(16, 64, generator=generator), torch.randn(16, 4, generator=generator)
            optimizer.zero_grad()
            ((model(x) - y) ** 2).mean().backward()
            optimizer.step()
            params.append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]))
        torch.save({"params": torch.stack(params)}, out / f"rank{rank}.pt")
    except Exception as exc:
        (out / f"rank{rank}.error").write_text(f"{type(exc).__name__}: {exc}")
    finally:
        dist.destroy_process_group()


def _run(
    tmp: Path, backend: str, target: Callable[..., None] = _fsdp_rank, *extra: object
) -> list[dict[str, Any]]:
    tmp.mkdir()
    spawn_and_join(
        target, [(r, backend, str(tmp / "store"), str(tmp), *extra) for r in range(2)], RANK_TIMEOUT_S
    )
    return rank_results(tmp, 2)


def test_fsdp2_and_dtensor_train_exactly_as_with_gloo(tmp_path: Path) -> None:
    ours, gloo = _run(tmp_path / "gradserver", "gradserver"), _run(tmp_path / "gloo", "gloo")
    for rank in range(2):
        for name in ("losses", "norms"):
            torch.testing.assert_close(ours[rank][name], gloo[rank][name], rtol=0, atol=0)
        torch.testing.assert_close(ours[rank]["params"], gloo[rank]["params"], rtol=0, atol=0)
        torch.testing.assert_close(ours[rank]["params"], ours[0]["params"], rtol=0, atol=0)
        torch.testing.assert_close(ours[rank]["replicated"], torch.arange(12.0).reshape(4, 3), rtol=0, atol=0)
        torch.testing.assert_close(ours[rank]["summed"], torch.full((5,), 3.0), rtol=0, atol=0)
    assert not torch.equal(ours[0]["losses"][0], ours[0]["losses"][-1])


def test_ddp_with_a_powersgd_hook_trains_exactly_as_with_gloo(tmp_path: Path) -> None:
    # (torch 2.13's batched_powerSGD_hook fails its own shape assertion with gloo too.)
    ours = _run(tmp_path / "gradserver", "gradserver", _powersgd_rank)
    gloo = _run(tmp_path / "gloo", "gloo", _powersgd_rank)
    for rank in range(2):
        torch.testing.assert_close(ours[rank]["params"], gloo[rank]["params"], rtol=0, atol=0)
    torch.testing.assert_close(ours[0]["params"], ours[1]["params"], rtol=0, atol=0)
    assert not torch.equal(ours[0]["params"][0], ours[0]["params"][-1])
