"""gradserver.torch.diloco over real processes: three replicas, each a spawned torch rank of the
"gradserver" backend, run every case below once (one spawn for the module) and save what they saw.

- Outer steps (H = 5) in float32, bf16, int8, int4 and streaming (2 fragments, delay 2, int8):
  the global weights' digest after every outer step, equal on every replica; the held-out loss
  of each format close to float32's; the relative error of the averaged pseudo-gradient each outer
  step applied against the exact average of the same pseudo-gradients, and of their sum (error
  feedback keeps the sum's error within one step's).
- The identity: H = 1, inner SGD, outer SGD lr 1 without momentum is data-parallel SGD on the
  averaged gradient, θ ← θ - η·mean gᵢ (up to float32 rounding of Δᵢ = θ - (θ - η gᵢ)).
- The weighting: with outer SGD lr 1 without momentum the new global weights are the weighted
  mean of the replicas' local weights, Σ wᵢθᵢ / Σ wᵢ, a replica that counted 0 left out.
- `flush` after a mid-period stop, called or by leaving the `with` block: every fragment's global
  weights hold the last inner step, the model takes them, a second flush sends nothing; its rule
  (flush="mean": the replicas' mean weights, the outer optimizer untouched; "outer": an outer step).
- A checkpoint (`state_dict`, `load_state_dict`) taken mid-period and loaded by new objects: the
  run ends as the one that never stopped, bit for bit (also one saved before the flush rule
  existed); a checkpoint that does not fit is refused.
- `exchange_times`: a replica's exchange hidden behind its slow inner step is not waited for;
  one whose other replica is late to send is, with nothing of it hidden.
- Refusals with clear messages (replicas with different settings among them), and an example run
  under `gradserver run`.
"""

from __future__ import annotations

import functools
import io
import re
import sys
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist

from gradserver.worker import state_digest

from .helpers.processes import ROOT, ProcessGroup
from .helpers.ranks import gradserver_rank, rank_results, spawn_and_join

pytestmark = [pytest.mark.processes, pytest.mark.timeout(600)]

WORLD = 3
H = 5
STEPS = 60  # inner steps of each training run: 12 outer steps
TEACHER_SEED = 11
RUNS: dict[str, dict[str, Any]] = {
    "float32": {},
    "bf16": {"quantize": "bf16"},
    "int8": {"quantize": "int8"},
    "int4": {"quantize": "int4"},
    "streaming": {"quantize": "int8", "fragments": 2, "delay": 2, "keep_local": 0.5},
    # Over a gloo group the int8 payloads are all-gathered and summed on every replica; over the
    # "gradserver" group (the runs above) the coordinator sums them.
    "int8-gloo": {"quantize": "int8", "gloo": True},
}


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))


def _batch(step: int, replica: int, size: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * step + replica)
    x = torch.randn(size, 8, generator=generator)
    teacher = torch.randn(8, 1, generator=torch.Generator().manual_seed(TEACHER_SEED)) * 0.35
    return x, torch.sin(x @ teacher)


def _held_out_loss(model: torch.nn.Module, weights: dict[str, torch.Tensor]) -> float:
    x, y = _batch(10**6, 0, size=512)
    with torch.no_grad():
        prediction = torch.func.functional_call(model, weights, (x,))
    return float(torch.nn.functional.mse_loss(prediction, y))


class _RecordingSGD(torch.optim.SGD):
    """SGD that keeps every gradient it steps with: the averaged pseudo-gradient of each outer step."""

    def __init__(self, params: list[torch.Tensor], **options: Any) -> None:
        super().__init__(params, **options)
        self.seen: list[torch.Tensor] = []

    def step(self, closure: Any = None) -> Any:
        grads = [p.grad for group in self.param_groups for p in group["params"]]
        self.seen.append(torch.cat([g.reshape(-1) for g in grads if g is not None]).clone())
        return super().step(closure)


def _pseudo_gradient(model: torch.nn.Module, outer: Any) -> torch.Tensor:
    weights = outer.global_tensors()
    return torch.cat([(weights[n] - p.detach()).reshape(-1) for n, p in model.named_parameters()])


def _train(rank: int, options: dict[str, Any]) -> dict[str, Any]:
    """STEPS inner steps (AdamW) with outer steps every H; the inner optimizer's hook is not used
    here: the loop calls `outer.step()` so that it can take the exact average first."""
    from gradserver.torch.diloco import DiLoCo

    model = _model()
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
    recorders: list[_RecordingSGD] = []

    def outer_optimizer(params: list[torch.Tensor]) -> torch.optim.Optimizer:
        recorders.append(_RecordingSGD(params, lr=0.7, momentum=0.9, nesterov=True))
        return recorders[-1]

    options = dict(options)
    group = dist.new_group(backend="gloo") if options.pop("gloo", False) else None
    outer = DiLoCo(model, inner, sync_every=H, outer_optimizer=outer_optimizer, group=group, **options)
    exact: list[torch.Tensor] = []
    digests: list[int] = []
    local_equals_global: list[bool] = []
    for step in range(STEPS):
        x, y = _batch(step, rank)
        torch.nn.functional.mse_loss(model(x), y).backward()
        inner.step()
        inner.zero_grad()
        if "fragments" not in options and (step + 1) % H == 0:
            average = _pseudo_gradient(model, outer)
            dist.all_reduce(average, op=dist.ReduceOp.AVG)  # exact: float64 sums, rounded once
            exact.append(average)
        before = outer.outer_steps
        outer.step()
        if outer.outer_steps > before:
            digests.append(state_digest(outer.global_tensors()))
            local_equals_global.append(
                all(torch.equal(p, outer.global_tensors()[n]) for n, p in model.named_parameters())
            )
    outer.close()  # applies what streaming still had on its way
    if outer.outer_steps > len(digests):
        digests.append(state_digest(outer.global_tensors()))
    return {
        "digests": digests,
        "local_equals_global": local_equals_global,
        "loss": _held_out_loss(model, outer.global_tensors()),
        "untrained_loss": _held_out_loss(_model(), dict(_model().named_parameters())),
        "applied": recorders[0].seen if "fragments" not in options else [],
        "exact": exact,
        "sent_bytes": outer.sent_bytes,
        "received_bytes": outer.received_bytes,
    }


def _identity(rank: int) -> dict[str, Any]:
    """H = 1, inner SGD, outer SGD lr 1 momentum 0; beside it the same steps of data-parallel SGD
    computed here from every replica's batch."""
    from gradserver.torch.diloco import DiLoCo

    lr = 0.05
    model, reference = _model(), _model()
    inner = torch.optim.SGD(model.parameters(), lr=lr)
    sgd = functools.partial(torch.optim.SGD, lr=1.0, momentum=0.0)
    globals_seen, reference_seen = [], []
    with DiLoCo(model, inner, sync_every=1, outer_optimizer=sgd) as outer:
        for step in range(8):
            x, y = _batch(step, rank)
            torch.nn.functional.mse_loss(model(x), y).backward()
            inner.step()  # the hook runs the outer step
            inner.zero_grad()
            globals_seen.append(torch.cat([t.reshape(-1) for t in outer.global_tensors().values()]).clone())
            grads = []
            for replica in range(WORLD):
                reference.zero_grad()
                rx, ry = _batch(step, replica)
                torch.nn.functional.mse_loss(reference(rx), ry).backward()
                grads.append([p.grad.clone() for p in reference.parameters() if p.grad is not None])
            with torch.no_grad():
                for index, param in enumerate(reference.parameters()):
                    param.sub_(lr * torch.stack([g[index] for g in grads]).mean(dim=0))
            reference_seen.append(torch.cat([p.detach().reshape(-1) for p in reference.parameters()]).clone())
    return {"globals": globals_seen, "reference": reference_seen}


def _weighted(rank: int, quantize: str | None) -> dict[str, Any]:
    """Two periods of H = 3, outer SGD lr 1 momentum 0: replica r counts 10(r+1) a step in the
    first, replica 0 counts 0 in the second; the local weights of every replica gathered before
    each outer step."""
    from gradserver.torch.diloco import DiLoCo

    model = _model()
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sgd = functools.partial(torch.optim.SGD, lr=1.0, momentum=0.0)
    outer = DiLoCo(model, inner, sync_every=3, outer_optimizer=sgd, quantize=quantize)
    locals_gathered, weights, globals_after = [], [], []
    for step in range(6):
        x, y = _batch(step, rank)
        torch.nn.functional.mse_loss(model(x), y).backward()
        inner.step()
        inner.zero_grad()
        outer.count(10 * (rank + 1) if step < 3 else (0 if rank == 0 else 7))
        if (step + 1) % 3 == 0:
            mine = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
            everyone = [torch.empty_like(mine) for _ in range(WORLD)]
            dist.all_gather(everyone, mine)
            locals_gathered.append(torch.stack(everyone))
            weights.append([30.0 * (r + 1) for r in range(WORLD)] if step < 3 else [0.0, 21.0, 21.0])
        outer.step()
        if (step + 1) % 3 == 0:
            globals_after.append(torch.cat([t.reshape(-1) for t in outer.global_tensors().values()]).clone())
    return {"locals": locals_gathered, "weights": weights, "globals": globals_after}


def _flushed(
    rank: int, quantize: str | None, leave_block: bool = False, flush: str | None = None
) -> dict[str, Any]:
    """Streaming (H = 4, 2 fragments exchanged at inner steps 2 and 4 of each period, delay 1,
    keep_local 0.5), outer SGD lr 1 momentum 0, stopped after inner step 6, mid-period: fragment 0
    was sent at step 6 and is on its way, fragment 1 was last sent at step 4. The local weights of
    every replica gathered just before `flush` (`leave_block`: before leaving the `with` block,
    which flushes); what it sent and applied; a second flush. With a `flush` rule given: the
    default outer optimizer (Nesterov, lr 0.7, momentum 0.9) and that rule, and whether fragment
    1's outer optimizer state (its momentum) is what it was before the flush."""
    from gradserver.torch.diloco import DiLoCo, nesterov_outer_optimizer

    model = _model()
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sgd = functools.partial(torch.optim.SGD, lr=1.0, momentum=0.0)
    outer = DiLoCo(
        model,
        inner,
        sync_every=4,
        outer_optimizer=sgd if flush is None else nesterov_outer_optimizer,
        fragments=2,
        delay=1,
        keep_local=0.5,
        quantize=quantize,
        flush=flush or "outer",
    )

    def momentum() -> list[torch.Tensor]:
        state = outer._fragments[1].outer.state_dict()["state"]
        return [state[i]["momentum_buffer"].clone() for i in sorted(state)]

    def train() -> None:
        for step in range(6):
            x, y = _batch(step, rank)
            torch.nn.functional.mse_loss(model(x), y).backward()
            inner.step()  # inside the block the hook runs the outer step
            inner.zero_grad()
            if not leave_block:
                outer.step()

    def gathered() -> torch.Tensor:
        mine = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        everyone = [torch.empty_like(mine) for _ in range(WORLD)]
        dist.all_gather(everyone, mine)
        return torch.stack(everyone)

    if leave_block:
        with outer:
            train()
            local_weights = gathered()
            before = (outer.outer_steps, outer.sent_bytes)
    else:
        train()
        local_weights = gathered()
        before = (outer.outer_steps, outer.sent_bytes)
        momentum_before = momentum() if flush is not None else []
        outer.flush()
    momentum_kept = flush is not None and all(
        torch.equal(a, b) for a, b in zip(momentum_before, momentum(), strict=True)
    )
    after = (outer.outer_steps, outer.sent_bytes)
    outer.flush()
    again = (outer.outer_steps, outer.sent_bytes)
    outer.close()
    weights = outer.global_tensors()
    return {
        "locals": local_weights,
        "globals": torch.cat([weights[n].reshape(-1) for n, _ in model.named_parameters()]).clone(),
        "model_is_global": all(torch.equal(p, weights[n]) for n, p in model.named_parameters()),
        "fragment_numel": [sum(p.numel() for p in f.params) for f in outer._fragments],
        "counts": [before, after, again],
        "momentum_kept": momentum_kept,
    }


def _resumed(rank: int) -> dict[str, Any]:
    """Streaming int8 (H = 4, 2 fragments, delay 1, keep_local 0.5), the replicas counting unequal
    batches: 10 inner steps and a flush in one run, and the same run saved after inner step 6
    (fragment 0 on its way; model, inner optimizer and outer state through torch.save) and taken
    up by new objects, as a restarted process would. Refusals: other settings, a replica that
    loaded another step's state, a load after the first inner step."""
    from gradserver.torch.diloco import DiLoCo

    def build(
        fragments: int = 2, flush: str = "outer"
    ) -> tuple[torch.nn.Module, torch.optim.Optimizer, DiLoCo]:
        model = _model()
        inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
        outer = DiLoCo(
            model,
            inner,
            sync_every=4,
            fragments=fragments,
            delay=1,
            keep_local=0.5,
            quantize="int8",
            flush=flush,
        )
        return model, inner, outer

    def train(model: torch.nn.Module, inner: torch.optim.Optimizer, outer: DiLoCo, last: int) -> None:
        for step in outer.steps(last):
            x, y = _batch(step, rank, size=16 + 8 * rank)
            torch.nn.functional.mse_loss(model(x), y).backward()
            outer.count(len(x))
            inner.step()
            inner.zero_grad()
            outer.step()

    def saved(model: torch.nn.Module, inner: torch.optim.Optimizer, outer: DiLoCo) -> bytes:
        buffer = io.BytesIO()
        state = {"model": model.state_dict(), "inner": inner.state_dict(), "outer": outer.state_dict()}
        torch.save(state, buffer)
        return buffer.getvalue()

    def flat(tensors: Any) -> torch.Tensor:
        return torch.cat([t.detach().reshape(-1) for t in tensors]).clone()

    model, inner, outer = build()
    train(model, inner, outer, 10)
    outer.flush()
    straight = (flat(outer.global_tensors().values()), flat(model.parameters()), outer.outer_steps)

    model, inner, outer = build()
    train(model, inner, outer, 5)
    at_5 = saved(model, inner, outer)
    train(model, inner, outer, 6)
    at_6 = saved(model, inner, outer)
    del model, inner, outer  # the process that saved them is gone

    def resume(
        checkpoint: bytes, fragments: int = 2, flush: str = "outer", before_flush: bool = False
    ) -> tuple[torch.nn.Module, torch.optim.Optimizer, DiLoCo]:
        model, inner, outer = build(fragments, flush)
        state = torch.load(io.BytesIO(checkpoint), weights_only=True)
        if before_flush:  # a state saved before DiLoCo had a flush rule
            del state["outer"]["settings"]["flush"], state["outer"]["extra"]["settings"]
        model.load_state_dict(state["model"])
        inner.load_state_dict(state["inner"])
        outer.load_state_dict(state["outer"])
        return model, inner, outer

    resumed: dict[str, tuple[torch.Tensor, torch.Tensor, int]] = {}
    for name, before_flush in (("resumed", False), ("resumed_older", True)):
        model, inner, outer = resume(at_6, before_flush=before_flush)
        at = outer.inner_step
        train(model, inner, outer, 10)
        outer.flush()
        resumed[name] = (flat(outer.global_tensors().values()), flat(model.parameters()), outer.outer_steps)
    return {
        "straight": straight,
        **resumed,
        "at": at,
        "other_settings": _error_of(lambda: resume(at_6, fragments=1)),
        "other_flush": _error_of(lambda: resume(at_6, flush="mean")),
        "other_step": _error_of(lambda: resume(at_5 if rank == 2 else at_6)),
        "late": _error_of(
            lambda: outer.load_state_dict(torch.load(io.BytesIO(at_6), weights_only=True)["outer"])
        ),
    }


def _error_of(call: Callable[[], object]) -> str:
    try:
        call()
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def _refusals(rank: int) -> dict[str, str]:
    from gradserver.torch.diloco import DiLoCo

    model = _model()
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    found = {
        "sync_every": _error_of(lambda: DiLoCo(model, inner, sync_every=0)),
        "format": _error_of(lambda: DiLoCo(model, inner, sync_every=5, quantize="int3")),
        "fragments": _error_of(lambda: DiLoCo(model, inner, sync_every=2, fragments=3)),
        "delay": _error_of(lambda: DiLoCo(model, inner, sync_every=4, delay=4)),
        "flush": _error_of(lambda: DiLoCo(model, inner, sync_every=4, flush="last")),
        # Collectives: every replica takes part in each of these.
        "other_flush": _error_of(
            lambda: DiLoCo(model, inner, sync_every=4, flush="mean" if rank == 1 else "outer")
        ),
        "other_delay": _error_of(lambda: DiLoCo(model, inner, sync_every=4, delay=rank % 2)),
    }
    different = _model()
    if rank == 1:
        with torch.no_grad():
            different[2].bias += 1e-6
    found["different"] = _error_of(
        lambda: DiLoCo(different, torch.optim.SGD(different.parameters(), lr=0.1), sync_every=5)
    )
    outer = DiLoCo(model, inner, sync_every=1, quantize="int8")
    found["count"] = _error_of(lambda: outer.count(-1))
    if rank == 2:
        with torch.no_grad():
            model[0].weight[0, 0] = float("nan")
    found["nan"] = _error_of(outer.step)
    return found


# A slow replica, keyed by (rank, inner step): seconds it spends in that inner step, after the
# exchange sent at the step before (rank 0: beside it) or before its own send (rank 1: late).
SLOW = {(0, 5): 0.5, (1, 8): 1.5}


def _timed(rank: int) -> dict[str, Any]:
    """H = 4, delay 2, 8 inner steps: the first exchange (sent at step 4, due at 6) is hidden on
    rank 0 behind its slow step 5; the second (sent at 8, waited for by `close`) waits for rank 1,
    late to send it."""
    import time

    from gradserver.torch.diloco import DiLoCo

    model = _model()
    inner = torch.optim.SGD(model.parameters(), lr=0.05)
    outer = DiLoCo(model, inner, sync_every=4, delay=2)
    for step in range(8):
        x, y = _batch(step, rank)
        torch.nn.functional.mse_loss(model(x), y).backward()
        inner.step()
        inner.zero_grad()
        time.sleep(SLOW.get((rank, step + 1), 0.0))
        outer.step()
    outer.close()
    return outer.exchange_times.as_dict()


def _results(rank: int) -> dict[str, Any]:
    results: dict[str, Any] = {"refusals": _refusals(rank), "identity": _identity(rank)}
    results["times"] = _timed(rank)
    results["weighted"] = _weighted(rank, None)
    results["weighted_int8"] = _weighted(rank, "int8")
    results["flushed"] = _flushed(rank, None)
    results["flushed_int8"] = _flushed(rank, "int8")
    results["flushed_on_leaving"] = _flushed(rank, None, leave_block=True)
    results["flushed_mean"] = _flushed(rank, None, flush="mean")
    results["flushed_outer"] = _flushed(rank, None, flush="outer")
    results["resumed"] = _resumed(rank)
    for name, options in RUNS.items():
        results[name] = _train(rank, options)
    return results


def _rank_main(rank: int, store_path: str, out_dir: str) -> None:
    gradserver_rank(rank, WORLD, store_path, out_dir, _results)


@pytest.fixture(scope="module")
def replicas(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("diloco")
    spawn_and_join(_rank_main, [(r, str(out / "store"), str(out)) for r in range(WORLD)], timeout_s=500)
    return rank_results(out, WORLD)


@pytest.mark.parametrize("run", list(RUNS))
def test_the_global_weights_are_bit_identical_on_every_replica_after_every_outer_step(
    replicas: list[dict[str, Any]], run: str
) -> None:
    digests = [r[run]["digests"] for r in replicas]
    fragments = RUNS[run].get("fragments", 1)
    assert len(digests[0]) == fragments * STEPS // H
    assert len(set(digests[0])) == len(digests[0])  # every outer step changed them
    assert digests[1] == digests[0] and digests[2] == digests[0]
    if fragments == 1:  # the local weights then become the global ones
        assert all(all(r[run]["local_equals_global"]) for r in replicas)


@pytest.mark.parametrize("run", [r for r in RUNS if r != "float32"])
def test_each_format_trains_to_a_loss_close_to_float32s(replicas: list[dict[str, Any]], run: str) -> None:
    baseline = replicas[0]["float32"]
    print(f"{run}: held-out loss {replicas[0][run]['loss']:.5f}, float32 {baseline['loss']:.5f}")
    assert baseline["loss"] < 0.5 * baseline["untrained_loss"], baseline
    assert replicas[0][run]["loss"] < baseline["loss"] * 1.1 + 0.002, (
        run,
        replicas[0][run]["loss"],
        baseline,
    )


# Relative error of the averaged pseudo-gradient of one outer step against the exact average of
# the same pseudo-gradients (at most), and of their sum over the 12 outer steps.
STEP_ERROR = {"float32": 1e-6, "bf16": 0.01, "int8": 0.02, "int4": 0.2, "int8-gloo": 0.02}


@pytest.mark.parametrize("run", list(STEP_ERROR))
def test_the_averaged_pseudo_gradient_is_as_accurate_as_its_format(
    replicas: list[dict[str, Any]], run: str
) -> None:
    result = replicas[0][run]
    applied, exact = torch.stack(result["applied"]), torch.stack(result["exact"])
    assert applied.shape == exact.shape and applied.shape[0] == STEPS // H
    step_errors = (applied - exact).norm(dim=1) / exact.norm(dim=1)
    sum_error = float((applied.sum(0) - exact.sum(0)).norm() / exact.sum(0).norm())
    print(
        f"{run}: loss {result['loss']:.5f}, per outer step {step_errors.tolist()}, of the sum {sum_error:.3g}"
    )
    assert float(step_errors.max()) <= STEP_ERROR[run]
    if run != "float32":
        assert float(step_errors.min()) > 0  # it was quantized
        # Error feedback: the sum trails by one residual, not by the sum of the steps' errors.
        assert sum_error < float(step_errors.mean())


def test_wire_bytes_are_one_payload_each_way_and_n_down_when_gathered(replicas: list[dict[str, Any]]) -> None:
    numel = sum(p.numel() for p in _model().parameters())
    outer_steps = STEPS // H
    float32 = replicas[0]["float32"]
    assert float32["sent_bytes"] == float32["received_bytes"] == outer_steps * 4 * (numel + 1 + WORLD)
    # The coordinator sums the records: one payload up, one down, beside [weight, counts].
    for run, record in (("int8", 68), ("int4", 36)):
        summed = replicas[0][run]
        assert summed["sent_bytes"] == summed["received_bytes"]
        assert summed["sent_bytes"] == outer_steps * (record * -(-numel // 64) + 4 * (1 + WORLD))
    gathered = replicas[0]["int8-gloo"]
    payload = 8 + numel + 4 * -(-numel // 64)
    payload += -payload % 8
    assert gathered["sent_bytes"] == outer_steps * payload
    assert gathered["received_bytes"] == WORLD * gathered["sent_bytes"]


def test_with_h_1_and_outer_sgd_lr_1_it_is_data_parallel_sgd(replicas: list[dict[str, Any]]) -> None:
    for replica in replicas:
        seen = replica["identity"]
        assert len(seen["globals"]) == 8
        for got, expected in zip(seen["globals"], seen["reference"], strict=True):
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    assert all(
        torch.equal(r["identity"]["globals"][-1], replicas[0]["identity"]["globals"][-1]) for r in replicas
    )


@pytest.mark.parametrize("run", ["weighted", "weighted_int8"])
def test_the_average_is_weighted_by_what_each_replica_counted(
    replicas: list[dict[str, Any]], run: str
) -> None:
    seen = replicas[0][run]
    for local_weights, counted, got in zip(seen["locals"], seen["weights"], seen["globals"], strict=True):
        w = torch.tensor(counted)[:, None]
        expected = (local_weights * w).sum(0) / w.sum()
        tolerance = 1e-6 if run == "weighted" else 2e-3  # int8: the deltas carry a 1/254 step error
        torch.testing.assert_close(got, expected, rtol=0, atol=tolerance)
        equal = torch.stack([local_weights[1], local_weights[2]]).mean(0)
        assert not torch.allclose(got, equal, rtol=0, atol=1e-6) or counted[0] == 0
    assert all(torch.equal(r[run]["globals"][-1], seen["globals"][-1]) for r in replicas)


@pytest.mark.parametrize("run", ["flushed", "flushed_int8", "flushed_on_leaving"])
def test_flush_gives_every_fragment_its_last_inner_steps_and_the_model_the_global_weights(
    replicas: list[dict[str, Any]], run: str
) -> None:
    """With outer SGD lr 1 the global weights a fragment's outer step makes are the mean of the
    replicas' local weights it was sent with: after `flush` that is every fragment's at the last
    inner step (fragment 0's sent at step 6 and landed in the flush, fragment 1's sent by it)."""
    seen = replicas[0][run]
    tolerance = 2e-3 if run == "flushed_int8" else 1e-6  # int8: the deltas carry a 1/254 step error
    torch.testing.assert_close(seen["globals"], seen["locals"].mean(0), rtol=0, atol=tolerance)
    before, after, again = seen["counts"]
    assert after[0] == before[0] + 2  # fragment 0's landing, fragment 1's flush exchange
    fragment_1 = seen["fragment_numel"][1]
    if run == "flushed_int8":
        sent = 68 * -(-fragment_1 // 64) + 4 * (1 + WORLD)
    else:
        sent = 4 * (fragment_1 + 1 + WORLD)
    assert after[1] - before[1] == sent
    assert again == after  # nothing left to send
    for replica in replicas:
        assert replica[run]["model_is_global"]
        assert torch.equal(replica[run]["globals"], seen["globals"])


@pytest.mark.parametrize("rule", ["mean", "outer"])
def test_the_flush_rule_decides_how_the_flush_applies_what_it_sends(
    replicas: list[dict[str, Any]], rule: str
) -> None:
    """The fragment the flush sends (fragment 1): with flush="mean" its global weights become
    the replicas' mean local weights and its outer optimizer's momentum stays as it was; with
    "outer" (Nesterov, lr 0.7, momentum 0.9) it takes an outer step, which lands elsewhere and
    moves the momentum. Either way every replica ends on the same global weights, in its model."""
    seen = replicas[0][f"flushed_{rule}"]
    start = seen["fragment_numel"][0]
    mean, flushed = seen["locals"].mean(0)[start:], seen["globals"][start:]
    if rule == "mean":
        torch.testing.assert_close(flushed, mean, rtol=0, atol=1e-6)
        assert seen["momentum_kept"]
    else:
        assert float((flushed - mean).abs().max()) > 1e-3
        assert not seen["momentum_kept"]
    before, after, _ = seen["counts"]
    assert after[0] == before[0] + 2  # fragment 0's landing (an outer step either way), the flush's
    for replica in replicas:
        assert replica[f"flushed_{rule}"]["model_is_global"]
        assert torch.equal(replica[f"flushed_{rule}"]["globals"], seen["globals"])


def test_exchange_times_say_what_the_inner_steps_hid_and_what_was_waited_for(
    replicas: list[dict[str, Any]],
) -> None:
    times = replicas[0]["times"]
    print(times)
    assert times["exchanges"] == 2
    # The first ran beside rank 0's slow step: not waited for; the second was (rank 1 was late).
    assert times["waited"] == 1
    assert times["in_flight_s"] >= SLOW[(0, 5)]
    assert times["waited_waiting_s"] >= 0.5  # rank 1 was 1.5 s late, less rank 0's own 0.5 s
    assert times["waited_in_flight_s"] < 0.1  # `close` waited for it as soon as it was sent
    assert times["hidden_share"] is not None and times["hidden_share"] < 0.25
    assert times["exposed_s"] == pytest.approx(times["sending_s"] + times["waiting_s"])
    assert all(r["times"]["exchanges"] == 2 for r in replicas)


def test_a_run_resumed_from_its_checkpoint_ends_as_the_run_that_never_stopped(
    replicas: list[dict[str, Any]],
) -> None:
    """Bit for bit: the global weights, the model and the outer steps after the flush; every piece
    of the outer state counts (int8's kept error, fragment 0's average on its way, the weights
    counted since each fragment's exchange)."""
    for replica in replicas:
        seen = replica["resumed"]
        assert seen["at"] == 6
        globals_, model, outer_steps = seen["resumed"]
        assert torch.equal(globals_, seen["straight"][0])
        assert torch.equal(model, seen["straight"][1])
        assert outer_steps == seen["straight"][2] == 6  # 5 exchanges, fragment 0's in flight, the flush
        assert torch.equal(globals_, replicas[0]["resumed"]["resumed"][0])
        # A state saved before DiLoCo had a flush rule resumes with the rule it ran with.
        assert all(
            torch.equal(a, b) for a, b in zip(seen["resumed_older"][:2], seen["straight"][:2], strict=True)
        )


def test_a_checkpoint_that_does_not_fit_is_refused_on_every_replica(replicas: list[dict[str, Any]]) -> None:
    for rank, replica in enumerate(replicas):
        seen = replica["resumed"]
        assert seen["other_settings"] == (
            "FailedPreconditionError: FAILED_PRECONDITION: DiLoCo.load_state_dict: the state was saved "
            "with fragments=2, this DiLoCo has fragments=1: resume with the settings it was saved with"
        )
        assert seen["other_step"].startswith(
            f"FailedPreconditionError: FAILED_PRECONDITION: replica {rank}: parameter 'outer/position' "
            "differs across replicas at the start (replicas [2] against replica 0)"
        ), seen["other_step"]
        assert seen["other_flush"] == (
            "FailedPreconditionError: FAILED_PRECONDITION: DiLoCo.load_state_dict: the state was saved "
            "with flush='outer', this DiLoCo has flush='mean': resume with the settings it was saved with"
        )
        assert seen["late"] == (
            "FailedPreconditionError: FAILED_PRECONDITION: DiLoCo.load_state_dict: this replica is at "
            "inner step 10; load a checkpoint before the first inner step"
        )


def test_bad_input_is_refused_with_a_clear_message(replicas: list[dict[str, Any]]) -> None:
    found = replicas[0]["refusals"]
    assert (
        found["sync_every"]
        == "InvalidArgumentError: INVALID_ARGUMENT: sync_every must be at least 1 inner step, got 0"
    )
    assert found["format"] == (
        "InvalidArgumentError: INVALID_ARGUMENT: unknown quantization format 'int3': use one of bf16, int8, "
        "int4 or None"
    )
    assert "fragments must be between 1 and min(sync_every, parameters) = 2, got 3" in found["fragments"]
    assert "delay must be between 0 and sync_every - 1 = 3 inner steps, got 4" in found["delay"]
    assert (
        found["flush"]
        == "InvalidArgumentError: INVALID_ARGUMENT: flush must be 'outer' or 'mean', got 'last'"
    )
    assert (
        found["count"] == "InvalidArgumentError: INVALID_ARGUMENT: count takes a non-negative amount, got -1"
    )
    for rank, replica in enumerate(replicas):
        for setting in ("other_flush", "other_delay"):
            assert replica["refusals"][setting] == (
                f"FailedPreconditionError: FAILED_PRECONDITION: replica {rank}: the DiLoCo settings differ "
                "across replicas at the start (replicas [1] against replica 0): every replica must run "
                "with the same sync_every, fragments, delay, keep_local, quantize, block and flush"
            ), setting
        assert replica["refusals"]["different"] == (
            f"FailedPreconditionError: FAILED_PRECONDITION: replica {rank}: parameter '2.bias' differs "
            "across replicas at the start (replicas [1] against replica 0): every replica must start "
            "from the same weights (seed the model's initialisation, or load one checkpoint)"
        )
        assert re.fullmatch(
            r"FailedPreconditionError: FAILED_PRECONDITION: outer step at inner step 1: the pseudo-gradient "
            r"of parameters 0\.weight\.\.2\.bias holds NaN or Inf on replicas 2 \(1 values\)",
            replica["refusals"]["nan"],
        ), replica["refusals"]["nan"]


def test_the_example_runs_under_gradserver_run(processes: ProcessGroup) -> None:
    run = processes.gradserver(
        "run",
        "--workers",
        "2",
        "--",
        sys.executable,
        str(ROOT / "examples" / "diloco.py"),
        "--steps",
        "100",
        "--quantize",
        "int4",
        name="run",
        env={"OMP_NUM_THREADS": "1"},
    )
    assert run.wait(300) == 0, run.output
    digests = re.findall(r'"param_sha256": "([0-9a-f]+)"', run.output)
    assert len(digests) == 2 and digests[0] == digests[1], run.output
    found = re.findall(
        r"rank \d: 5 outer steps, \d+ bytes sent, \d+ received; the exchanges held it \d+\.\d+ s", run.output
    )
    assert len(found) == 2, run.output
