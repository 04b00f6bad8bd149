"""gradserver.torch.diloco with FSDP2 inside each replica (issue 51: "Works with DDP or FSDP2
inside each replica").

Four spawned ranks of the "gradserver" backend on a 2 x 2 DeviceMesh ("site", "shard"): ranks 0
and 1 are one site, 2 and 3 the other. Inside a site, `fully_shard` over the mesh's "shard"
dimension shards every parameter over the site's two ranks and reduce-scatters each step's
gradients; between sites, `DiLoCo` averages the pseudo-gradients of each rank's own shards every
H inner steps over the mesh's "site" group (the ranks holding the same shard index in every
site, as HSDP's replicate groups are). Each rank's global shards must then be the same bytes as
those of its peer in the other site, and the full global weights (its shards gathered within the
site) the same on every rank; the result must also equal the same DiLoCo run with the model
unsharded (DDP inside each site), whose averages it computes from the same gradients. A run saved
mid-period (each rank its own shards' states) and resumed by new objects ends as the one that
never stopped.
"""

from __future__ import annotations

import io
from typing import Any

import pytest
import torch

from gradserver.worker import state_digest

from .helpers.ranks import gradserver_rank, rank_results, spawn_and_join

pytestmark = [pytest.mark.processes, pytest.mark.timeout(300)]

SITES = 2
RANKS_PER_SITE = 2
WORLD = SITES * RANKS_PER_SITE
H = 4
STEPS = 12  # 3 outer steps


def _batch(step: int, site: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The site's batch at `step`; each rank of a site takes its half (FSDP's and DDP's split)."""
    generator = torch.Generator().manual_seed(1000 * step + site)
    x = torch.randn(16, 8, generator=generator)
    return x, x.sum(dim=1, keepdim=True).sin()


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


def _train(rank: int, sharded: bool) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from gradserver.torch.diloco import DiLoCo

    mesh = init_device_mesh("cpu", (SITES, RANKS_PER_SITE), mesh_dim_names=("site", "shard"))
    site, place = divmod(rank, RANKS_PER_SITE)
    model = _model()
    if sharded:
        fully_shard(model, mesh=mesh["shard"])
        inner_model: torch.nn.Module = model
    else:
        inner_model = torch.nn.parallel.DistributedDataParallel(
            model, process_group=mesh["shard"].get_group()
        )
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
    shards: list[int] = []
    full: list[int] = []
    with DiLoCo(model, inner, sync_every=H, group=mesh["site"].get_group()) as outer:
        for step in range(STEPS):
            x, y = _batch(step, site)
            half = slice(place * 8, (place + 1) * 8)
            torch.nn.functional.mse_loss(inner_model(x[half]), y[half]).backward()
            inner.step()  # every H-th step is also an outer step
            inner.zero_grad()
            if (step + 1) % H == 0:
                # This rank's shards of the global weights; after an outer step (no streaming)
                # the local weights are the global ones, so the model gathers the full weights.
                shards.append(state_digest(outer.global_tensors()))
                full.append(
                    state_digest(
                        {
                            n: (p.full_tensor() if isinstance(p, DTensor) else p).detach()
                            for n, p in model.named_parameters()
                        }
                    )
                )
    return {"site": site, "place": place, "shards": shards, "full": full}


def _resumed(rank: int) -> str:
    """The sharded run saved after inner step 6 (mid-period: each rank its model's, inner
    optimizer's and outer state, its own shards) and taken up by a new model, optimizer and
    DiLoCo: the full global weights after step 12."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from gradserver.torch.diloco import DiLoCo

    mesh = init_device_mesh("cpu", (SITES, RANKS_PER_SITE), mesh_dim_names=("site", "shard"))
    site, place = divmod(rank, RANKS_PER_SITE)

    def build() -> tuple[torch.nn.Module, torch.optim.Optimizer, DiLoCo]:
        model = _model()
        fully_shard(model, mesh=mesh["shard"])
        inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
        return model, inner, DiLoCo(model, inner, sync_every=H, group=mesh["site"].get_group())

    def train(model: torch.nn.Module, inner: torch.optim.Optimizer, outer: DiLoCo, last: int) -> None:
        for step in outer.steps(last):
            x, y = _batch(step, site)
            half = slice(place * 8, (place + 1) * 8)
            torch.nn.functional.mse_loss(model(x[half]), y[half]).backward()
            inner.step()
            inner.zero_grad()
            outer.step()

    model, inner, outer = build()
    train(model, inner, outer, 6)
    buffer = io.BytesIO()
    torch.save(
        {"model": model.state_dict(), "inner": inner.state_dict(), "outer": outer.state_dict()}, buffer
    )
    model, inner, outer = build()
    state = torch.load(io.BytesIO(buffer.getvalue()), weights_only=False)  # DTensors: not weights only
    model.load_state_dict(state["model"])
    inner.load_state_dict(state["inner"])
    outer.load_state_dict(state["outer"])
    train(model, inner, outer, STEPS)
    outer.close()
    return state_digest({n: p.full_tensor().detach() for n, p in model.named_parameters()})


def _results(rank: int) -> dict[str, Any]:
    return {"fsdp": _train(rank, sharded=True), "ddp": _train(rank, sharded=False), "resumed": _resumed(rank)}


def _rank_main(rank: int, store_path: str, out_dir: str) -> None:
    gradserver_rank(rank, WORLD, store_path, out_dir, _results)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("diloco-fsdp")
    spawn_and_join(_rank_main, [(r, str(out / "store"), str(out)) for r in range(WORLD)], timeout_s=240)
    return rank_results(out, WORLD)


def test_a_ranks_global_shards_equal_its_peers_in_the_other_site_after_every_outer_step(
    ranks: list[dict[str, Any]],
) -> None:
    runs = [r["fsdp"] for r in ranks]
    for place in range(RANKS_PER_SITE):
        peers = [r for r in runs if r["place"] == place]
        assert len(peers) == SITES and len(peers[0]["shards"]) == STEPS // H
        assert all(p["shards"] == peers[0]["shards"] for p in peers)
    assert runs[0]["shards"] != runs[1]["shards"], "a site's two ranks hold different shards"


def test_the_full_global_weights_are_the_same_on_every_rank_and_move_at_every_outer_step(
    ranks: list[dict[str, Any]],
) -> None:
    runs = [r["fsdp"] for r in ranks]
    assert all(r["full"] == runs[0]["full"] for r in runs)
    assert len(set(runs[0]["full"])) == STEPS // H


def test_sharding_inside_the_sites_trains_as_ddp_inside_them_does(ranks: list[dict[str, Any]]) -> None:
    """FSDP2's reduce-scatter and DDP's all_reduce average the same two gradients per element (two
    ranks: one rounding either way), so AdamW and the outer steps see the same values."""
    assert ranks[0]["fsdp"]["full"] == ranks[0]["ddp"]["full"]


def test_a_sharded_run_resumed_from_its_checkpoint_ends_as_the_run_that_never_stopped(
    ranks: list[dict[str, Any]],
) -> None:
    """Each rank saves and loads its own shards' outer state (`DiLoCo.state_dict`)."""
    assert all(r["resumed"] == ranks[0]["fsdp"]["full"][-1] for r in ranks)
