"""gradserver.torch.diloco with DDP inside each replica (issue 51: "two levels: fast averaging
inside a site, outer steps between sites").

Four spawned ranks of the "gradserver" backend make two replicas of two ranks each: ranks 0 and 1
are one site, 2 and 3 the other. Inside a site, DDP averages every step's gradients over the
site's group; between sites, `DiLoCo` averages the pseudo-gradients every H inner steps over an
outer group that holds one rank of each site (0 with 2, 1 with 3: each rank's outer group is the
ranks at its place in the other sites, as HSDP's replicate groups are). Both ranks of a site hold
the same weights (DDP), so both outer groups exchange the same pseudo-gradients and every rank
ends every outer step with the same global weights, bit for bit; between outer steps the sites'
local weights differ (they train on different data).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from gradserver.worker import state_digest

from .helpers.ranks import gradserver_rank, rank_results, spawn_and_join

pytestmark = [pytest.mark.processes, pytest.mark.timeout(300)]

SITES = 2
RANKS_PER_SITE = 2
WORLD = SITES * RANKS_PER_SITE
H = 4
STEPS = 16  # 4 outer steps


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(16, 8, generator=generator)
    return x, x.sum(dim=1, keepdim=True).sin()


def _results(rank: int) -> dict[str, Any]:
    from gradserver.torch.diloco import DiLoCo

    # Every rank creates every group, in the same order (torch.distributed's rule).
    sites = [dist.new_group(list(range(s * RANKS_PER_SITE, (s + 1) * RANKS_PER_SITE))) for s in range(SITES)]
    places = [dist.new_group([p + s * RANKS_PER_SITE for s in range(SITES)]) for p in range(RANKS_PER_SITE)]
    site, place = divmod(rank, RANKS_PER_SITE)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    ddp = torch.nn.parallel.DistributedDataParallel(model, process_group=sites[site])
    inner = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    digests: list[int] = []
    local: list[int] = []
    with DiLoCo(model, inner, sync_every=H, group=places[place]) as outer:
        for step in range(STEPS):
            x, y = _batch(step, rank)
            torch.nn.functional.mse_loss(ddp(x), y).backward()
            inner.step()  # every H-th step is also an outer step
            inner.zero_grad()
            local.append(state_digest({n: p.detach() for n, p in model.named_parameters()}))
            if (step + 1) % H == 0:
                digests.append(state_digest(outer.global_tensors()))
    return {"site": site, "digests": digests, "local": local}


def _rank_main(rank: int, store_path: str, out_dir: str) -> None:
    gradserver_rank(rank, WORLD, store_path, out_dir, _results)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("diloco-two-levels")
    spawn_and_join(_rank_main, [(r, str(out / "store"), str(out)) for r in range(WORLD)], timeout_s=240)
    return rank_results(out, WORLD)


def test_every_rank_of_every_site_has_the_same_global_weights_after_every_outer_step(
    ranks: list[dict[str, Any]],
) -> None:
    assert len(ranks[0]["digests"]) == STEPS // H
    assert all(r["digests"] == ranks[0]["digests"] for r in ranks)
    assert len(set(ranks[0]["digests"])) == STEPS // H, "the global weights moved at every outer step"


def test_ddp_keeps_a_sites_ranks_identical_and_the_sites_apart_between_outer_steps(
    ranks: list[dict[str, Any]],
) -> None:
    by_site = {s: [r for r in ranks if r["site"] == s] for s in range(SITES)}
    for members in by_site.values():
        assert all(r["local"] == members[0]["local"] for r in members), "DDP kept a site's ranks together"
    first, second = by_site[0][0]["local"], by_site[1][0]["local"]
    inner_steps = [i for i in range(STEPS) if (i + 1) % H]
    assert all(first[i] != second[i] for i in inner_steps), "the sites trained on different data"
    outer_steps = [i for i in range(STEPS) if (i + 1) % H == 0]
    assert all(first[i] == second[i] for i in outer_steps), (
        "after an outer step the local weights are the global ones"
    )
