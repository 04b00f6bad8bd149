"""torch.distributed.pipelining on the backend under test trains bit-identically to gloo.

A small transformer-ish model (an input projection, pre-norm residual MLP blocks, a head; float32)
is built with one seed on every rank, and each rank keeps its stage's layers (a manual split: the
full model's parameter names stay, so ranks and runs compare name by name). Each run trains a few
Adam steps of 4 microbatches on fixed data, once with gloo and once with BACKEND (separate spawned
rank sets), and every rank's results are compared exactly: the last stage's losses and outputs
and every parameter of every stage (torch.equal, and the same dtype and shape).

- ScheduleGPipe and Schedule1F1B, 2 stages (2 ranks) and 3 stages (3 ranks). torch 2.13's
  PipelineStage, without example inputs, infers shapes at the first step: a vote with send/recv
  (int32), then each stage's metadata with send_object_list/recv_object_list(use_batch=True);
  activations and gradients then go with isend/irecv, and 1F1B's steady state mixes a send and a
  receive in one batch_isend_irecv. One case gives the stages example inputs and outputs (static
  metadata: the vote only, then straight to the tensors).
- A 2-D mesh of 4 ranks: 2 pipeline stages x 2 data-parallel replicas (init_device_mesh, so the
  pipeline's peers are ranks of a sub-group, translated to global ranks), each replica its own
  data, gradients averaged over the replica pair with all_reduce(AVG) before the optimizer step:
  with two inputs the float32 average is rounded once by either backend, so it is exact too.

Computation on one rank is deterministic (one intra-op thread per rank), so any difference comes
from what the backend delivered.
"""

from __future__ import annotations

import datetime
from collections import OrderedDict
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from .helpers.ranks import rank_results, spawn_and_join

# The backend compared with gloo. Set it to "gloo" to check the tests themselves (gloo vs gloo).
BACKEND = "gradserver"
OP_TIMEOUT = datetime.timedelta(seconds=45)
RANK_TIMEOUT_S = 70.0  # per rank: above OP_TIMEOUT, so a rank stuck in an operation reports it
pytestmark = [pytest.mark.processes, pytest.mark.timeout(180)]

IN_FEATURES, HIDDEN, OUT_FEATURES = 8, 16, 4
BLOCKS = 6  # divisible by 2 and 3 stages
BATCH, SEQ = 8, 3
MICROBATCHES = 4
STEPS = 3


class Block(nn.Module):
    """Pre-norm residual MLP, the shape of a transformer block without attention."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(nn.functional.gelu(self.up(self.norm(x))))


def full_model() -> nn.Sequential:
    torch.manual_seed(0)  # every rank builds the same model
    return nn.Sequential(
        nn.Linear(IN_FEATURES, HIDDEN),
        *(Block(HIDDEN) for _ in range(BLOCKS)),
        nn.Linear(HIDDEN, OUT_FEATURES),
    )


def stage_module(model: nn.Sequential, stage: int, stages: int) -> nn.Sequential:
    """Stage `stage` of `stages`: an equal share of the blocks, the input projection on the first
    stage and the head on the last; children keep their index in the full model as their name."""
    per = BLOCKS // stages
    indices = list(range(1 + stage * per, 1 + (stage + 1) * per))
    if stage == 0:
        indices.insert(0, 0)
    if stage == stages - 1:
        indices.append(BLOCKS + 1)
    return nn.Sequential(OrderedDict((str(i), model[i]) for i in indices))


def batch(step: int, replica: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets) of one step for one data-parallel replica; every rank can make them."""
    generator = torch.Generator().manual_seed(1000 + 10 * step + replica)
    x = torch.randn(BATCH, SEQ, IN_FEATURES, generator=generator)
    y = torch.randn(BATCH, SEQ, OUT_FEATURES, generator=generator)
    return x, y


def _train_rank(
    backend: str,
    schedule_name: str,
    stages: int,
    replicas: int,
    static: bool,
    rank: int,
    store: str,
    out_dir: str,
) -> None:
    """One rank: trains its stage and saves {"losses", "outputs", "params"} to OUT/rankN.pt."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    import gradserver.torch  # noqa: F401 - registers "gradserver"

    torch.set_num_threads(1)  # deterministic and alike in both runs; the ranks share the cores
    world = stages * replicas
    dist.init_process_group(
        backend, init_method=f"file://{store}", rank=rank, world_size=world, timeout=OP_TIMEOUT
    )
    out = Path(out_dir)
    try:
        if replicas > 1:
            mesh = init_device_mesh("cpu", (replicas, stages), mesh_dim_names=("dp", "pp"))
            pp_group, dp_group = mesh.get_group("pp"), mesh.get_group("dp")
            stage, replica = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
        else:
            pp_group, dp_group, stage, replica = None, None, rank, 0
        module = stage_module(full_model(), stage, stages)
        example: dict[str, Any] = {}
        if static:
            micro = BATCH // MICROBATCHES
            # Examples are what torch infers otherwise, requires_grad included: the gradient
            # buffers exist only for tensors that require grad (all but the first input).
            width_in = IN_FEATURES if stage == 0 else HIDDEN
            width_out = OUT_FEATURES if stage == stages - 1 else HIDDEN
            example["input_args"] = torch.empty(micro, SEQ, width_in, requires_grad=stage > 0)
            example["output_args"] = torch.empty(micro, SEQ, width_out, requires_grad=True)
        pipeline_stage = PipelineStage(module, stage, stages, torch.device("cpu"), group=pp_group, **example)
        schedule_class = {"GPipe": ScheduleGPipe, "1F1B": Schedule1F1B}[schedule_name]
        schedule = schedule_class(pipeline_stage, n_microbatches=MICROBATCHES, loss_fn=nn.functional.mse_loss)
        optimizer = torch.optim.Adam(module.parameters(), lr=0.01)
        losses: list[torch.Tensor] = []
        outputs: list[torch.Tensor] = []
        for step in range(STEPS):
            x, y = batch(step, replica)
            optimizer.zero_grad()
            if stage == 0:
                schedule.step(x)
            elif stage == stages - 1:
                step_losses: list[torch.Tensor] = []
                outputs.append(schedule.step(target=y, losses=step_losses).detach())
                losses.append(torch.stack(step_losses).detach())
            else:
                schedule.step()
            if dp_group is not None:
                for p in module.parameters():
                    assert p.grad is not None
                    dist.all_reduce(p.grad, op=dist.ReduceOp.AVG, group=dp_group)
            optimizer.step()
        results = {
            "stage": stage,
            "replica": replica,
            "losses": torch.stack(losses) if losses else torch.empty(0),
            "outputs": torch.stack(outputs) if outputs else torch.empty(0),
            "params": {name: p.detach().clone() for name, p in module.named_parameters()},
        }
        dist.barrier()  # no rank leaves while a peer still receives from it
        torch.save(results, out / f"rank{rank}.pt")
    except Exception as exc:
        (out / f"rank{rank}.error").write_text(f"{type(exc).__name__}: {exc}")
    finally:
        dist.destroy_process_group()


def train(
    tmp: Path, backend: str, role: str, schedule: str, stages: int, replicas: int = 1, static: bool = False
) -> list[dict[str, Any]]:
    world = stages * replicas
    out = tmp / f"{role}-{backend}"
    out.mkdir()
    argss = [
        (backend, schedule, stages, replicas, static, r, str(out / "store"), str(out)) for r in range(world)
    ]
    spawn_and_join(_train_rank, argss, RANK_TIMEOUT_S)
    return rank_results(out, world)


def assert_bit_identical(got: dict[str, Any], want: dict[str, Any], where: str) -> None:
    assert (got["stage"], got["replica"]) == (want["stage"], want["replica"]), where
    for key in ("losses", "outputs"):
        assert got[key].dtype == want[key].dtype and torch.equal(got[key], want[key]), (
            where,
            key,
            got[key],
            want[key],
        )
    assert sorted(got["params"]) == sorted(want["params"]), where
    for name, tensor in want["params"].items():
        assert got["params"][name].dtype == tensor.dtype, (where, name)
        assert torch.equal(got["params"][name], tensor), (where, name)


def compare(
    tmp: Path, schedule: str, stages: int, replicas: int = 1, static: bool = False
) -> list[dict[str, Any]]:
    """Trains with gloo, then with BACKEND; asserts each rank's results are identical; returns gloo's."""
    gloo = train(tmp, "gloo", "reference", schedule, stages, replicas, static)
    ours = train(tmp, BACKEND, "tested", schedule, stages, replicas, static)
    for rank, (got, want) in enumerate(zip(ours, gloo, strict=True)):
        assert_bit_identical(got, want, f"{BACKEND} rank {rank}")
    # The comparison means something: the last stage reports every microbatch's loss, the loss
    # moves, and every parameter was trained away from its initial value.
    initial = dict(full_model().named_parameters())
    for result in gloo:
        if result["stage"] == stages - 1:
            assert result["losses"].shape == (STEPS, MICROBATCHES), result["losses"]
            assert not torch.equal(result["losses"][0], result["losses"][-1])
        for name, tensor in result["params"].items():
            assert not torch.equal(tensor, initial[name]), name
    return gloo


@pytest.mark.parametrize("schedule", ["GPipe", "1F1B"])
@pytest.mark.parametrize("stages", [2, 3])
def test_a_pipeline_trains_bit_identically_to_gloo(tmp_path: Path, schedule: str, stages: int) -> None:
    gloo = compare(tmp_path, schedule, stages)
    assert [r["stage"] for r in gloo] == list(range(stages))
    # Every layer of the full model is on exactly one stage.
    names = [name for r in gloo for name in r["params"]]
    assert sorted(names) == sorted(dict(full_model().named_parameters()))


def test_a_pipeline_with_static_stage_shapes_trains_bit_identically_to_gloo(tmp_path: Path) -> None:
    compare(tmp_path, "1F1B", 3, static=True)


def test_pipeline_and_data_parallel_on_a_2d_mesh_train_bit_identically_to_gloo(tmp_path: Path) -> None:
    gloo = compare(tmp_path, "1F1B", stages=2, replicas=2)
    # mesh (dp, pp) = (2, 2): ranks 0, 1 are replica 0's stages, ranks 2, 3 replica 1's.
    assert [(r["replica"], r["stage"]) for r in gloo] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    # The replicas saw different data but averaged gradients: the same parameters, other losses.
    for stage in range(2):
        first, second = gloo[stage], gloo[2 + stage]
        for name, tensor in first["params"].items():
            assert torch.equal(second["params"][name], tensor), name
    assert not torch.equal(gloo[1]["losses"], gloo[3]["losses"])
