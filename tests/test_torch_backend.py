"""The torch.distributed backend "gradserver" and the protocol it rides on.

Protocol: generic collective keys (group + operation sequence number, any length, AVG or SUM,
bit-identical whatever the arrival order) and Join asking for a rank, at the table, codec and
real-server level.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import itertools
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel

from gradserver.common import codec
from gradserver.common.errors import FailedPreconditionError, InvalidArgumentError
from gradserver.common.messages import (
    AveragedChunkOut,
    ChunkHeader,
    ChunkIn,
    DType,
    ErrorOut,
    JoinRequestIn,
    ReduceOp,
    TensorKey,
)
from gradserver.server.reduction import ReductionTable
from gradserver.torch._collective import CollectiveClient

from .helpers.logwait import log_waiter
from .helpers.processes import ROOT
from .helpers.ranks import rank_results, spawn_and_join
from .helpers.server import TEST_TIMEOUTS, ServerThread, run_each

CHUNK = 4


def _chunks(worker: int, key: TensorKey, data: np.ndarray) -> list[ChunkIn]:
    header = ChunkHeader(DType.FLOAT32, data.size, ())
    return [
        ChunkIn(worker, key, header, off, data[off : off + CHUNK].astype("<f4").tobytes())
        for off in range(0, max(1, data.size), CHUNK)
    ]


def _reduce_in_order(data: list[np.ndarray], order: tuple[int, ...], op: ReduceOp) -> bytes:
    table = ReductionTable(len(data), CHUNK, 10.0, lambda: 0.0)
    key = TensorKey.collective(7, 3, op)
    out = []
    for w in order:
        for chunk in _chunks(w, key, data[w]):
            out += table.contribute(chunk)
    results = {o.event.offset: o.event.data for o in out if isinstance(o.event, AveragedChunkOut)}
    assert not [o for o in out if isinstance(o.event, ErrorOut)]
    return b"".join(bytes(results[off]) for off in sorted(results))


@pytest.mark.parametrize("op", [ReduceOp.AVG, ReduceOp.SUM])
def test_collective_key_is_exact_and_independent_of_arrival_order(op: ReduceOp) -> None:
    rng = np.random.default_rng(5)
    data = [(rng.standard_normal(11) * 1e4).astype(np.float32) for _ in range(3)]
    results = {_reduce_in_order(data, order, op) for order in itertools.permutations(range(3))}
    assert len(results) == 1
    total = data[0].astype(np.float64) + data[1] + data[2]
    expected = (total / 3 if op is ReduceOp.AVG else total).astype(np.float32)
    assert results.pop() == expected.tobytes()


def test_collective_sum_of_disjoint_segments_is_a_concatenation() -> None:
    """What broadcast and allgather rely on: x + 0 is x, bit for bit."""
    data = [np.array([1.5, 0, 0, 0], np.float32), np.array([0, 2.25, 65535, 7], np.float32)]
    got = _reduce_in_order(data, (1, 0), ReduceOp.SUM)
    assert got == np.array([1.5, 2.25, 65535, 7], np.float32).tobytes()


def test_collective_keys_that_disagree_on_the_op_fail_the_operation_naming_it() -> None:
    table = ReductionTable(2, CHUNK, 10.0, lambda: 0.0)
    data = np.ones(3, np.float32)
    table.contribute(_chunks(0, TensorKey.collective(0, 0, ReduceOp.SUM), data)[0])
    out = table.contribute(_chunks(1, TensorKey.collective(0, 0, ReduceOp.AVG), data)[0])
    errors = [o.event for o in out if isinstance(o.event, ErrorOut)]
    assert errors and errors[0].step_failed
    assert "AVG" in errors[0].message and "SUM" in errors[0].message and "worker 1" in errors[0].message


def test_collective_sum_overflow_fails_the_operation_naming_the_element() -> None:
    table = ReductionTable(2, CHUNK, 10.0, lambda: 0.0)
    key = TensorKey.collective(0, 0, ReduceOp.SUM)
    data = np.array([1.0, 3e38], np.float32)
    table.contribute(_chunks(0, key, data)[0])
    out = table.contribute(_chunks(1, key, data)[0])
    errors = [o.event for o in out if isinstance(o.event, ErrorOut)]
    assert errors and "overflows float32 at element 1" in errors[0].message


def test_codec_round_trips_collective_keys_and_join_ranks() -> None:
    limits = codec.WireLimits(chunk_elements=CHUNK, max_tensor_elements=100)
    key = TensorKey.collective(12, 4, ReduceOp.SUM)
    raw = codec.encode_worker_event(_chunks(1, key, np.arange(3, dtype=np.float32))[0])
    decoded = codec.decode_worker_message(raw, limits)
    assert isinstance(decoded, ChunkIn)
    assert decoded.key == key and decoded.key.op is ReduceOp.SUM and decoded.key.index == 4
    assert str(decoded.key) == "operation 12 collective SUM of group 4"
    for rank in (None, 0, 3):
        request = JoinRequestIn("n", 0, "torch", codec.PROTOCOL_VERSION, rank=rank)
        assert codec.decode_join_request(codec.encode_join_request(request)).rank == rank


def test_codec_refuses_an_unknown_reduce_op() -> None:
    from gradserver.common._pb import gradient_server_pb2 as pb

    msg = pb.WorkerMessage(
        chunk=pb.GradientChunk(
            worker_id=0,
            key=pb.TensorKey(step=1, collective=pb.CollectiveKey(group=0, op=9)),
            dtype=1,
            total_elements=1,
            data=b"\0\0\0\0",
        )
    )
    limits = codec.WireLimits(chunk_elements=CHUNK, max_tensor_elements=100)
    with pytest.raises(InvalidArgumentError, match="unknown reduce op 9"):
        codec.decode_worker_message(msg.SerializeToString(), limits)


def _join_ranks(address: str, ranks: list[int]) -> list[CollectiveClient]:
    with concurrent.futures.ThreadPoolExecutor(len(ranks)) as pool:
        futures = [
            pool.submit(CollectiveClient.connect_as_rank, address, r, timeout=TEST_TIMEOUTS) for r in ranks
        ]
        return [f.result(timeout=TEST_TIMEOUTS.join + 5) for f in futures]


def test_join_as_rank_and_collectives_through_a_real_server(
    coordinator: Callable[..., ServerThread],
) -> None:
    server = coordinator(world_size=2)
    clients = _join_ranks(server.address, [1, 0])
    try:
        assert [c.worker_id for c in clients] == [1, 0]
        rng = np.random.default_rng(2)
        data = {c.worker_id: rng.standard_normal(1000).astype(np.float32) for c in clients}

        def run(client: CollectiveClient) -> list[bytes]:
            results = []
            for seq, op in enumerate([ReduceOp.SUM, ReduceOp.AVG]):
                client.send_collective(seq, 0, data[client.worker_id], op)
                results.append(client.receive_collective(timeout=20).tobytes())
            client.send_collective(2, 0, np.zeros(0, np.float32), ReduceOp.SUM)
            assert client.receive_collective(timeout=20).size == 0
            return results

        first, second = run_each(clients, run)
        assert first == second
        total = data[0].astype(np.float64) + data[1]
        assert first[0] == total.astype(np.float32).tobytes()
        assert first[1] == (total / 2).astype(np.float32).tobytes()
    finally:
        for c in clients:
            c.close()


def test_join_refuses_an_out_of_range_or_duplicate_rank(coordinator: Callable[..., ServerThread]) -> None:
    server = coordinator(world_size=2, join_timeout=20.0)
    with pytest.raises(InvalidArgumentError, match="rank 2, out of range for a world of 2"):
        CollectiveClient.connect_as_rank(server.address, 2, timeout=TEST_TIMEOUTS)
    with log_waiter() as log, concurrent.futures.ThreadPoolExecutor(1) as pool:
        first = pool.submit(
            CollectiveClient.connect_as_rank, server.address, 1, node_id="a", timeout=TEST_TIMEOUTS
        )
        # The first joiner holds rank 1 while it waits for the rest of the world.
        log.wait_for(r"worker 1 joined: node 'a'", timeout=20)
        with pytest.raises(FailedPreconditionError, match="rank 1, which is already taken by node 'a'"):
            CollectiveClient.connect_as_rank(server.address, 1, node_id="b", timeout=TEST_TIMEOUTS)
        other = CollectiveClient.connect_as_rank(server.address, 0, timeout=TEST_TIMEOUTS)
        joined = first.result(timeout=30)
        try:
            assert (joined.worker_id, other.worker_id) == (1, 0)
        finally:
            joined.close()
            other.close()


# --- the torch.distributed backend, two real processes ---------------------------------------------

STEPS = 20


class _SmallCnn(torch.nn.Module):
    """A model the project does not define: convolutions with BatchNorm buffers, and a head that
    is never used (so find_unused_parameters matters)."""

    def __init__(self) -> None:
        super().__init__()
        self.features = torch.nn.Sequential(
            torch.nn.Conv2d(3, 8, 3, padding=1),
            torch.nn.BatchNorm2d(8),
            torch.nn.ReLU(),
            torch.nn.Conv2d(8, 8, 3, padding=1),
            torch.nn.BatchNorm2d(8),
            torch.nn.ReLU(),
            torch.nn.AdaptiveAvgPool2d(1),
            torch.nn.Flatten(),
        )
        self.head = torch.nn.Linear(8, 4)
        self.unused = torch.nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


def _flat(tensors: Any) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1).double().cpu() for t in tensors])


def _train_rank(
    rank: int, backend: str, store_path: str, out_dir: str, die_at: int, device: str = "cpu"
) -> None:
    """One DDP rank on `device`: STEPS steps; odd steps accumulate two micro-batches under no_sync()."""
    import gradserver.torch  # noqa: F401 - registers "gradserver"

    dist.init_process_group(backend, init_method=f"file://{store_path}", rank=rank, world_size=2)
    out = Path(out_dir)
    try:
        torch.manual_seed(0)
        module = _SmallCnn().to(device)
        device_ids = [module.head.weight.device.index] if device != "cpu" else None
        model = DistributedDataParallel(module, device_ids=device_ids, find_unused_parameters=True)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        generator = torch.Generator().manual_seed(100 + rank)
        params, buffers = [], []
        for step in range(STEPS):
            if step == die_at and rank == 1:
                os.kill(os.getpid(), signal.SIGKILL)
            optimizer.zero_grad()
            micro_batches = 2 if step % 2 else 1
            for micro in range(micro_batches):
                x = torch.randn(6, 3, 8, 8, generator=generator).to(device)
                y = torch.randint(0, 4, (6,), generator=generator).to(device)
                context = model.no_sync() if micro < micro_batches - 1 else contextlib.nullcontext()
                with context:
                    torch.nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
            params.append(_flat(model.module.parameters()))
            # Each rank's own BatchNorm statistics (DDP broadcasts rank 0's at the next forward).
            buffers.append(_flat(model.module.buffers()))
        dist.barrier()
        gathered = [torch.zeros(2, dtype=torch.int64) for _ in range(2)]
        dist.all_gather(gathered, torch.tensor([rank, 7 * rank + 1]))
        flag = torch.tensor([True, rank == 0]) if rank == 0 else torch.zeros(2, dtype=torch.bool)
        dist.broadcast(flag, src=0)
        result = {"params": torch.stack(params), "buffers": torch.stack(buffers)}
        torch.save({**result, "gathered": gathered, "flag": flag}, out / f"rank{rank}.pt")
    except Exception as exc:
        (out / f"rank{rank}.error").write_text(f"{type(exc).__name__}: {exc}")
    finally:
        dist.destroy_process_group()


def _run_ranks(
    tmp: Path, backend: str, die_at: int = -1, device: str = "cpu"
) -> list[mp.process.BaseProcess]:
    tmp.mkdir()
    argss = [(r, backend, str(tmp / "store"), str(tmp), die_at, device) for r in range(2)]
    return spawn_and_join(_train_rank, argss, check_exits=die_at < 0)


def _results(tmp: Path) -> list[dict[str, Any]]:
    return rank_results(tmp, 2)


@pytest.mark.processes
@pytest.mark.timeout(600)
def test_ddp_trains_identically_on_every_rank_and_like_gloo(tmp_path: Path) -> None:
    _run_ranks(tmp_path / "gradserver", "gradserver")
    _run_ranks(tmp_path / "gloo", "gloo")
    ours, gloo = _results(tmp_path / "gradserver"), _results(tmp_path / "gloo")
    # Parameters after every step: bit-identical across ranks, and gloo's within tolerance.
    assert ours[0]["params"].shape[0] == STEPS
    assert torch.equal(ours[0]["params"], ours[1]["params"])
    assert not torch.equal(ours[0]["params"][0], ours[0]["params"][-1])
    for rank in range(2):
        torch.testing.assert_close(ours[rank]["params"], gloo[rank]["params"])
        torch.testing.assert_close(ours[rank]["buffers"], gloo[rank]["buffers"])
    for result in ours:
        assert [t.tolist() for t in result["gathered"]] == [[0, 1], [1, 8]]
        assert result["flag"].tolist() == [True, True]


@pytest.mark.processes
@pytest.mark.timeout(600)
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_ddp_on_cuda_tensors_trains_identically_on_every_rank_and_like_gloo(tmp_path: Path) -> None:
    """Both ranks share the GPU; DDP's buckets are CUDA tensors, which the backend copies to the
    host and back on the caller's stream."""
    _run_ranks(tmp_path / "gradserver", "gradserver", device="cuda")
    _run_ranks(tmp_path / "gloo", "gloo", device="cuda")
    ours, gloo = _results(tmp_path / "gradserver"), _results(tmp_path / "gloo")
    assert torch.equal(ours[0]["params"], ours[1]["params"])
    assert not torch.equal(ours[0]["params"][0], ours[0]["params"][-1])
    for rank in range(2):
        torch.testing.assert_close(ours[rank]["params"], gloo[rank]["params"])
        torch.testing.assert_close(ours[rank]["buffers"], gloo[rank]["buffers"])


@pytest.mark.processes
@pytest.mark.timeout(300)
def test_a_killed_rank_fails_the_other_naming_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GRADSERVER_HEARTBEAT_TIMEOUT", "2")
    started = time.monotonic()
    procs = _run_ranks(tmp_path / "run", "gradserver", die_at=5)
    elapsed = time.monotonic() - started
    assert [p.exitcode for p in procs] == [0, -signal.SIGKILL]
    error = (tmp_path / "run" / "rank0.error").read_text()
    assert "worker 1 disconnected" in error and "rank 0: gradserver " in error, error
    # Bounded by the heartbeat timeout plus process start-up, far below any torch timeout.
    assert elapsed < 120, elapsed


# --- collectives beyond DDP's: three real ranks against local references in rank order ------------

WORLD = 3
R = dist.ReduceOp
# (name, op, dtype): every rank reduces the inputs `_case_input` gives it.
CASES = [
    ("sum_f32", R.SUM, torch.float32),
    ("avg_f32", R.AVG, torch.float32),
    ("sum_f16", R.SUM, torch.float16),
    ("avg_bf16", R.AVG, torch.bfloat16),
    ("sum_f64", R.SUM, torch.float64),
    ("avg_f64", R.AVG, torch.float64),
    ("sum_i64", R.SUM, torch.int64),
    ("sum_i8", R.SUM, torch.int8),
    ("min_f32", R.MIN, torch.float32),
    ("max_f64", R.MAX, torch.float64),
    ("product_f32", R.PRODUCT, torch.float32),
    ("product_i32", R.PRODUCT, torch.int32),
    ("max_i16", R.MAX, torch.int16),
    ("min_bool", R.MIN, torch.bool),
    ("bxor_i64", R.BXOR, torch.int64),
    ("bor_u8", R.BOR, torch.uint8),
]


def _case_input(name: str, dtype: torch.dtype, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(sum(map(ord, name)) + 17 * rank)  # not hash(): salted per process
    if dtype == torch.bool:
        return torch.rand(9, generator=g) > 0.3
    if dtype.is_floating_point:
        return (torch.randn(2, 9, generator=g, dtype=torch.float64) * (3 if "product" in name else 1e3)).to(
            dtype
        )
    if dtype == torch.int64:
        return torch.randint(-(2**62), 2**62, (9,), generator=g, dtype=torch.int64)
    info = torch.iinfo(dtype)
    return torch.randint(info.min, info.max, (9,), generator=g, dtype=torch.int64).to(dtype)


def _reference(name: str, op: Any, dtype: torch.dtype) -> torch.Tensor:
    """torch's semantics, reduced in rank order; SUM/AVG of float32 (and the half types widened
    to it) as the coordinator does: a float64 sum rounded once."""
    parts = [_case_input(name, dtype, r) for r in range(WORLD)]
    if op in (R.SUM, R.AVG) and dtype in (torch.float32, torch.float16, torch.bfloat16):
        total = sum(p.double() for p in parts)
        return (total / WORLD if op == R.AVG else total).float().to(dtype)
    combine = {R.SUM: torch.add, R.AVG: torch.add, R.MIN: torch.minimum, R.MAX: torch.maximum}
    combine |= {R.PRODUCT: torch.mul, R.BXOR: torch.bitwise_xor, R.BOR: torch.bitwise_or}
    result = parts[0]
    for p in parts[1:]:
        result = combine[op](result, p)
    return result / WORLD if op == R.AVG else result


def _collectives_rank(rank: int, store_path: str, out_dir: str) -> None:
    import gradserver.torch  # noqa: F401 - registers "gradserver"

    dist.init_process_group("gradserver", init_method=f"file://{store_path}", rank=rank, world_size=WORLD)
    try:
        results: dict[str, Any] = {}
        for name, op, dtype in CASES:
            tensor = _case_input(name, dtype, rank)
            dist.all_reduce(tensor, op=op)
            results[name] = tensor
        # reduce_scatter: rank r gets the SUM of every rank's piece r.
        pieces = [torch.full((4,), 0.1 * (rank + 1) + piece, dtype=torch.float32) for piece in range(WORLD)]
        scattered = torch.zeros(4)
        dist.reduce_scatter(scattered, pieces)
        results["reduce_scatter"] = scattered
        # alltoall: rank r sends [100 r + j] to rank j.
        received = [torch.zeros(2, dtype=torch.int64) for _ in range(WORLD)]
        dist.all_to_all(received, [torch.tensor([100 * rank + j, -j]) for j in range(WORLD)])
        results["alltoall"] = received
        # The single-tensor forms (FSDP's) and the rooted ones.
        gathered = torch.zeros(WORLD, 3)
        dist.all_gather_into_tensor(gathered, torch.tensor([rank, 10.0 * rank, -1.0]))
        results["all_gather_into_tensor"] = gathered
        shard = torch.zeros(2, dtype=torch.float64)
        dist.reduce_scatter_tensor(shard, torch.arange(2.0 * WORLD, dtype=torch.float64) * (rank + 1))
        results["reduce_scatter_tensor"] = shard
        exchanged = torch.zeros(WORLD, 2, dtype=torch.int32)
        dist.all_to_all_single(
            exchanged, torch.tensor([[100 * rank + j, j] for j in range(WORLD)], dtype=torch.int32)
        )
        results["all_to_all_single"] = exchanged
        reduced = torch.tensor([1.5 * (rank + 1)])
        dist.reduce(reduced, dst=1, op=dist.ReduceOp.MAX)
        results["reduce"] = reduced
        gather_list = [torch.zeros(2, dtype=torch.int64) for _ in range(WORLD)] if rank == 0 else None
        dist.gather(torch.tensor([rank, -rank]), gather_list, dst=0)
        results["gather"] = gather_list
        scattered_piece = torch.zeros(3)
        pieces = [torch.full((3,), 7.0 + r) for r in range(WORLD)] if rank == 1 else None
        dist.scatter(scattered_piece, pieces, src=1)
        results["scatter"] = scattered_piece
        if rank == 0:
            dist.send(torch.tensor([1.5, -2.0]), dst=1, tag=4)
        elif rank == 1:
            received = torch.zeros(2)
            results["p2p_from"] = dist.recv(received, src=None, tag=4)
            results["p2p"] = received
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    except Exception as exc:
        (Path(out_dir) / f"rank{rank}.error").write_text(f"{type(exc).__name__}: {exc}")
    finally:
        dist.destroy_process_group()


@pytest.mark.processes
@pytest.mark.timeout(300)
def test_collectives_match_torch_semantics_in_rank_order_on_every_rank(tmp_path: Path) -> None:
    spawn_and_join(_collectives_rank, [(r, str(tmp_path / "store"), str(tmp_path)) for r in range(WORLD)])
    errors = {p.name: p.read_text() for p in tmp_path.glob("*.error")}
    assert not errors, errors
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD)]
    for name, op, dtype in CASES:
        expected = _reference(name, op, dtype)
        for rank in range(WORLD):
            got = results[rank][name]
            assert got.dtype == dtype, (name, got.dtype)
            assert torch.equal(got, expected), (name, rank, got, expected)
    for rank in range(WORLD):
        total = sum(torch.full((4,), 0.1 * (r + 1) + rank, dtype=torch.float64) for r in range(WORLD))
        assert torch.equal(results[rank]["reduce_scatter"], total.float()), rank
        assert [t.tolist() for t in results[rank]["alltoall"]] == [
            [100 * r + rank, -rank] for r in range(WORLD)
        ]
        got = results[rank]
        assert got["all_gather_into_tensor"].tolist() == [[r, 10.0 * r, -1.0] for r in range(WORLD)]
        base = torch.arange(2.0 * WORLD, dtype=torch.float64)[2 * rank : 2 * rank + 2]
        assert torch.equal(got["reduce_scatter_tensor"], base * sum(r + 1 for r in range(WORLD)))
        assert got["all_to_all_single"].tolist() == [[100 * r + rank, rank] for r in range(WORLD)]
        # The root holds the reduction; the other ranks' tensors are untouched.
        assert got["reduce"].tolist() == ([1.5 * WORLD] if rank == 1 else [1.5 * (rank + 1)])
        if rank == 0:
            assert [t.tolist() for t in got["gather"]] == [[r, -r] for r in range(WORLD)]
        assert got["scatter"].tolist() == [7.0 + rank] * 3
    assert results[1]["p2p"].tolist() == [1.5, -2.0] and results[1]["p2p_from"] == 0


SINGLE_RANK_SCRIPT = """
import sys
import torch
import torch.distributed as dist

dist.init_process_group("gradserver", init_method="file://" + sys.argv[1], rank=0, world_size=1)
assert "gradserver.torch" in sys.modules  # loaded by torch's entry point
assert dist.get_backend() == "gradserver"
big = torch.tensor([2**62 + 1, -5, 3], dtype=torch.int64)
dist.all_reduce(big)
assert big.tolist() == [2**62 + 1, -5, 3], big
x = torch.tensor([0.1, -2.5])
dist.all_reduce(x, op=dist.ReduceOp.AVG)
assert x.tolist() == torch.tensor([0.1, -2.5]).tolist()
premul = dist._make_nccl_premul_sum(2.0)
for bad, kwargs in [
    (torch.ones(2, dtype=torch.int64), {"op": premul}),
    (torch.ones(2), {"op": dist.ReduceOp.BAND}),
]:
    try:
        dist.all_reduce(bad, **kwargs)
    except (NotImplementedError, TypeError) as exc:
        print(f"{type(exc).__name__}: {exc}")
bad_shapes = [
    lambda: dist.all_gather_into_tensor(torch.zeros(3), torch.ones(2)),
    lambda: dist.reduce_scatter_tensor(torch.zeros(2), torch.ones(4, 2).t()),
    lambda: dist.gather(torch.ones(2), [torch.zeros(2), torch.zeros(2)], dst=0),
    lambda: dist.scatter(torch.zeros(2), [torch.zeros(3)], src=0),
]
for call in bad_shapes:
    try:
        call()
    except ValueError as exc:
        print(f"ValueError: {exc}")
sub = dist.new_group([0])  # a subgroup: its own embedded coordinator
y = torch.tensor([1.5])
dist.all_reduce(y, group=sub)
assert y.tolist() == [1.5], y
dist.barrier()
dist.destroy_process_group()
print("ok")
"""


def _script_lines(script: str, tmp_path: Path) -> list[str]:
    """Runs `script` (one process, its store under tmp_path); it must exit 0 and end with 'ok'."""
    result = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path / "store")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[-1] == "ok", result.stdout
    return lines


@pytest.mark.processes
def test_init_process_group_gradserver_works_without_importing_gradserver(tmp_path: Path) -> None:
    lines = _script_lines(SINGLE_RANK_SCRIPT, tmp_path)
    assert lines[0] == "TypeError: gradserver allreduce: PREMUL_SUM takes floating types, not ['torch.int64']"
    assert lines[1].startswith(
        "TypeError: gradserver allreduce: dtype torch.float32 with BAND is not supported"
    )
    assert lines[2:6] == [
        "ValueError: gradserver all_gather_into_tensor: a torch.float32 tensor of 3 elements cannot "
        "hold 1 pieces of 2 torch.float32 elements",
        "ValueError: gradserver reduce_scatter_tensor: the tensors must be contiguous",
        "ValueError: gradserver gather: the root needs a gather_list of 1 tensors",
        "ValueError: gradserver scatter: every scatter_list tensor must match the output tensor",
    ], lines


@pytest.mark.processes
@pytest.mark.timeout(300)
def test_the_example_runs_under_torchrun_with_the_gradserver_backend(tmp_path: Path) -> None:
    torchrun = Path(sys.executable).with_name("torchrun")
    command = [str(torchrun), "--standalone", "--nproc-per-node", "2", str(ROOT / "examples" / "ddp_cnn.py")]
    proc = subprocess.Popen(
        [*command, "--backend", "gradserver", "--steps", "6", "--log-every", "5"],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # so the workers torchrun starts can be stopped with it
    )
    try:
        output, _ = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    assert proc.returncode == 0, output
    assert "step 5 loss" in output, output
    assert "backend gradserver world 2:" in output and "samples/s" in output, output


CUDA_SCRIPT = """
import sys
import torch
import torch.distributed as dist
import gradserver.torch  # noqa: F401

dist.init_process_group("gradserver", init_method="file://" + sys.argv[1], rank=0, world_size=1)
side = torch.cuda.Stream()
with torch.cuda.stream(side):
    # Written by a kernel on the caller's stream just before the call: the copy to the host must
    # wait for it; the result, read on the same stream after wait(), must follow the copy back.
    x = torch.full((1 << 20,), 0.5, device="cuda") * 3
    work = dist.all_reduce(x, op=dist.ReduceOp.MAX, async_op=True)
    work.wait()
    y = x + 1
    h = torch.arange(6, device="cuda", dtype=torch.float16)
    dist.all_reduce(h)
    out = [torch.zeros(3, device="cuda", dtype=torch.int64)]
    dist.all_gather(out, torch.tensor([1, 2, 3], device="cuda"))
side.synchronize()
assert torch.equal(y.cpu(), torch.full((1 << 20,), 2.5)), y
assert h.device.type == "cuda" and h.tolist() == [0, 1, 2, 3, 4, 5]
assert out[0].tolist() == [1, 2, 3]
try:
    dist.all_reduce_coalesced([torch.ones(1, device="cuda"), torch.ones(1)])
except ValueError as exc:
    print(exc)
dist.destroy_process_group()
print("ok")
"""


@pytest.mark.processes
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_tensors_are_copied_on_the_callers_stream(tmp_path: Path) -> None:
    lines = _script_lines(CUDA_SCRIPT, tmp_path)
    assert "the tensors of one call must be on one device" in lines[0], lines
