"""DiLoCo's int8 pseudo-gradients summed by the coordinator, with the model on CPU and on CUDA
(issues 51 and 52): two spawned ranks of the "gradserver" backend, the process group's
`quantized_allreduce` staging the device's tensors like any collective. The CUDA case runs in
scripts/gpu-check.sh's `tests` part (it selects `-k cuda`); here it is skipped without a GPU.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch

from gradserver.worker import state_digest

from .helpers.ranks import gradserver_rank, rank_results, spawn_and_join

pytestmark = [pytest.mark.processes, pytest.mark.timeout(300)]

WORLD = 2
H = 2
STEPS = 6  # 3 outer steps


def _refusal(call: Any) -> str:
    try:
        call()
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "accepted"


def _results(rank: int, device: str) -> dict[str, Any]:
    import torch.distributed as dist

    from gradserver.torch.diloco import DiLoCo

    group: Any = dist.group.WORLD
    refusals = {  # refused before anything is queued, so every rank's order stays the same
        "wire": _refusal(lambda: group.quantized_allreduce(torch.zeros(3, device=device), "int16")),
        "dtype": _refusal(lambda: group.quantized_allreduce(torch.zeros(3, dtype=torch.float64), "int8")),
    }

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 96), torch.nn.Tanh(), torch.nn.Linear(96, 1)).to(device)
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
    digests: list[int] = []
    with DiLoCo(model, inner, sync_every=H, quantize="int8") as outer:
        for step in range(STEPS):
            generator = torch.Generator().manual_seed(1000 * step + rank)
            x = torch.randn(16, 8, generator=generator)
            y = x.sum(dim=1, keepdim=True).sin()
            torch.nn.functional.mse_loss(model(x.to(device)), y.to(device)).backward()
            inner.step()  # every H-th step is also an outer step
            inner.zero_grad()
            if (step + 1) % H == 0:
                weights = {name: w.detach().cpu() for name, w in outer.global_tensors().items()}
                digests.append(state_digest(weights))
    return {
        "refusals": refusals,
        "digests": digests,
        "sent": outer.sent_bytes,
        "received": outer.received_bytes,
        "devices": sorted({str(w.device.type) for w in outer.global_tensors().values()}),
    }


def _rank_main(rank: int, store_path: str, out_dir: str, device: str) -> None:
    gradserver_rank(rank, WORLD, store_path, out_dir, functools.partial(_results, device=device))


@pytest.mark.parametrize(
    "device",
    [
        "cpu",
        pytest.param(
            "cuda",
            marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
        ),
    ],
)
def test_int8_outer_steps_are_summed_by_the_coordinator_and_identical_on_every_rank(
    device: str, tmp_path: Any
) -> None:
    spawn_and_join(
        _rank_main, [(r, str(tmp_path / "store"), str(tmp_path), device) for r in range(WORLD)], timeout_s=240
    )
    ranks = rank_results(tmp_path, WORLD)
    refusals = ranks[0]["refusals"]
    assert (
        refusals["wire"].startswith("InvalidArgumentError")
        and "'int16' is not one of int8, int4" in refusals["wire"]
    )
    assert (
        refusals["dtype"].startswith("InvalidArgumentError")
        and "float32 tensor, got torch.float64" in refusals["dtype"]
    )
    assert ranks[0]["devices"] == [device]
    assert len(ranks[0]["digests"]) == STEPS // H
    assert len(set(ranks[0]["digests"])) == STEPS // H, "every outer step moved the global weights"
    assert all(r["digests"] == ranks[0]["digests"] for r in ranks)
    numel = 8 * 96 + 96 + 96 + 1
    # One payload up and one down (68-byte records, and [weight, counts] beside them), not N down.
    payload = 68 * -(-numel // 64) + 4 * (1 + WORLD)
    assert ranks[0]["sent"] == ranks[0]["received"] == (STEPS // H) * payload
