"""The torch backend on the coordinator's native collectives (ALL_GATHER, BROADCAST,
REDUCE_SCATTER, ALL_TO_ALL): the same bytes as gloo for every collective and dtype, the bytes each
rank puts on the wire (the coordinator's counters), and the caller's tensors left resizable.

The comparison with gloo runs real ranks as processes: each initialises "gradserver" as its
default group and a gloo group beside it, and runs every case on both. The byte counts and the
shared-memory path run in one process: one `ProcessGroupGradServer` per rank, driven from threads.
"""

from __future__ import annotations

import concurrent.futures
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist

from gradserver.common.errors import FailedPreconditionError, InvalidArgumentError
from gradserver.common.messages import CollectiveKind
from gradserver.torch._collective import CollectiveClient
from gradserver.torch.backend import ProcessGroupGradServer

from .helpers.ranks import rank_results, spawn_and_join
from .helpers.server import TEST_TIMEOUTS, ServerThread
from .test_partitioned_coordinators import partitioned  # noqa: F401 - the fixture: K coordinator partitions

# --- every collective against gloo, ranks as processes ---------------------------------------

Case = Callable[[int, int, Any], list[torch.Tensor]]


def _seeded(name: str, rank: int) -> torch.Generator:
    return torch.Generator().manual_seed(sum(map(ord, name)) * 31 + rank)  # not hash(): salted


def _values(name: str, rank: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Deterministic values of `dtype` for one rank of one case (floats are whole numbers where a
    sum of three would otherwise round differently from gloo's float32 sum)."""
    g = _seeded(name, rank)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=g, dtype=torch.float64) * 1e3).round().to(dtype)
    return torch.randint(-(2**14), 2**14, shape, generator=g, dtype=torch.int64).to(dtype)


def _all_gather_into_tensor(dtype: torch.dtype, shape: tuple[int, ...]) -> Case:
    def case(rank: int, world: int, group: Any) -> list[torch.Tensor]:
        out = torch.full((world * shape[0], *shape[1:]), 7, dtype=dtype)
        dist.all_gather_into_tensor(out, _values(f"ag{dtype}", rank, shape, dtype), group=group)
        return [out]

    return case


def _all_gather_list(rank: int, world: int, group: Any) -> list[torch.Tensor]:
    outputs = [torch.zeros(2, 3, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(outputs, _values("agl", rank, (2, 3), torch.int64), group=group)
    return outputs


def _broadcast(dtype: torch.dtype, shape: tuple[int, ...], last_root: bool) -> Case:
    def case(rank: int, world: int, group: Any) -> list[torch.Tensor]:
        tensor = _values(f"bc{dtype}", rank, shape, dtype)
        dist.broadcast(tensor, src=world - 1 if last_root else 0, group=group)
        return [tensor]

    return case


def _reduce_scatter_tensor(dtype: torch.dtype, op: Any, random: bool = False) -> Case:
    def case(rank: int, world: int, group: Any) -> list[torch.Tensor]:
        if random:  # exact against gloo only for two inputs: their float32 sum is rounded once
            data = torch.randn(world * 5, generator=_seeded("rsr", rank), dtype=dtype)
        else:
            data = _values(f"rs{dtype}", rank, (world * 5,), dtype)
        out = torch.zeros(5, dtype=dtype)
        dist.reduce_scatter_tensor(out, data, op=op, group=group)
        return [out]

    return case


def _reduce_scatter_list(rank: int, world: int, group: Any) -> list[torch.Tensor]:
    pieces = [_values(f"rsl{j}", rank, (2, 2), torch.float32) for j in range(world)]
    out = torch.zeros(2, 2)
    dist.reduce_scatter(out, pieces, group=group)
    return [out]


def _all_to_all_single_equal(rank: int, world: int, group: Any) -> list[torch.Tensor]:
    out = torch.zeros(world * 2, 3)
    dist.all_to_all_single(out, _values("a2a", rank, (world * 2, 3), torch.float32), group=group)
    return [out]


def _rows(src: int, dst: int) -> int:
    """Rows rank `src` sends rank `dst` in the uneven all-to-all (0 for some pairs)."""
    return (src + 2 * dst) % 3


def _all_to_all_single_uneven(rank: int, world: int, group: Any) -> list[torch.Tensor]:
    sent = [_rows(rank, j) for j in range(world)]
    received = [_rows(j, rank) for j in range(world)]
    out = torch.full((sum(received), 2), -1, dtype=torch.int32)
    data = _values("a2au", rank, (sum(sent), 2), torch.int32)  # gloo refuses int16
    dist.all_to_all_single(out, data, received, sent, group=group)
    return [out]


def _all_to_all_list(rank: int, world: int, group: Any) -> list[torch.Tensor]:
    outputs = [torch.zeros(3, dtype=torch.bfloat16) for _ in range(world)]
    inputs = [_values(f"a2al{j}", rank, (3,), torch.bfloat16) for j in range(world)]
    dist.all_to_all(outputs, inputs, group=group)
    return outputs


def _gather(rank: int, world: int, group: Any) -> list[torch.Tensor]:
    root = world - 1
    outputs = [torch.zeros(4, dtype=torch.int64) for _ in range(world)] if rank == root else None
    dist.gather(_values("ga", rank, (4,), torch.int64), outputs, dst=root, group=group)
    return outputs or []


def _scatter(rank: int, world: int, group: Any) -> list[torch.Tensor]:
    root = world - 1
    pieces = [_values(f"sc{j}", rank, (2, 2), torch.float32) for j in range(world)] if rank == root else None
    out = torch.zeros(2, 2)
    dist.scatter(out, pieces, src=root, group=group)
    return [out]


def _reduce(dtype: torch.dtype, op: Any, last_root: bool) -> Case:
    def run(rank: int, world: int, group: Any) -> list[torch.Tensor]:
        root = world - 1 if last_root else 0
        tensor = _values(f"rd{dtype}", rank, (5,), dtype)
        dist.reduce(tensor, dst=root, op=op, group=group)
        return [tensor] if rank == root else []  # what the others hold after it is unspecified

    return run


def _all_reduce_max(rank: int, world: int, group: Any) -> list[torch.Tensor]:
    tensor = _values("armax", rank, (6,), torch.int32)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)
    return [tensor]


CASES: dict[str, Case] = {
    "all_gather_into_tensor float32": _all_gather_into_tensor(torch.float32, (5,)),
    "all_gather_into_tensor bfloat16 2-D": _all_gather_into_tensor(torch.bfloat16, (2, 3)),
    "all_gather_into_tensor int64": _all_gather_into_tensor(torch.int64, (4,)),
    "all_gather_into_tensor bool": _all_gather_into_tensor(torch.bool, (7,)),
    "all_gather_into_tensor zero-size": _all_gather_into_tensor(torch.float32, (0,)),
    "all_gather list int64": _all_gather_list,
    "broadcast bfloat16 from the last rank": _broadcast(torch.bfloat16, (3, 2), last_root=True),
    "broadcast bool from rank 0": _broadcast(torch.bool, (9,), last_root=False),
    "broadcast int64 from rank 0": _broadcast(torch.int64, (5,), last_root=False),
    "broadcast zero-size": _broadcast(torch.int64, (0,), last_root=True),
    "reduce_scatter_tensor float32 SUM": _reduce_scatter_tensor(torch.float32, dist.ReduceOp.SUM),
    "reduce_scatter_tensor int64 SUM": _reduce_scatter_tensor(torch.int64, dist.ReduceOp.SUM),
    "reduce_scatter_tensor float64 MAX": _reduce_scatter_tensor(torch.float64, dist.ReduceOp.MAX),
    "reduce_scatter list float32": _reduce_scatter_list,
    "all_to_all_single equal": _all_to_all_single_equal,
    "all_to_all_single uneven": _all_to_all_single_uneven,
    "all_to_all list bfloat16": _all_to_all_list,
    "gather int64 to the last rank": _gather,
    "scatter float32 from the last rank": _scatter,
    "all_reduce int32 MAX": _all_reduce_max,
    "reduce float32 SUM to the last rank": _reduce(torch.float32, dist.ReduceOp.SUM, last_root=True),
    "reduce int64 SUM to rank 0": _reduce(torch.int64, dist.ReduceOp.SUM, last_root=False),
    "reduce bfloat16 SUM to the last rank": _reduce(torch.bfloat16, dist.ReduceOp.SUM, last_root=True),
    "reduce float32 MAX to rank 0": _reduce(torch.float32, dist.ReduceOp.MAX, last_root=False),
}
TWO_RANK_CASES: dict[str, Case] = {
    "reduce_scatter_tensor float32 SUM of random values": _reduce_scatter_tensor(
        torch.float32, dist.ReduceOp.SUM, random=True
    ),
}


def _cases(world: int) -> dict[str, Case]:
    return CASES | TWO_RANK_CASES if world == 2 else CASES


def _both_backends_rank(rank: int, world: int, store: str, out_dir: str, transport: str) -> None:
    import warnings

    import gradserver.torch  # noqa: F401 - registers "gradserver"

    warnings.filterwarnings("ignore", category=FutureWarning)  # torch renames the *_tensor forms
    os.environ["GRADSERVER_TRANSPORT"] = transport
    torch.set_num_threads(1)
    dist.init_process_group("gradserver", init_method=f"file://{store}", rank=rank, world_size=world)
    where = "creating the gloo group"
    try:
        gloo = dist.new_group(backend="gloo")
        results: dict[str, Any] = {}
        for name, case in _cases(world).items():
            results[name] = {}
            for backend, group in (("gradserver", None), ("gloo", gloo)):
                where = f"{name} on {backend}"
                results[name][backend] = case(rank, world, group)
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    except Exception as exc:
        (Path(out_dir) / f"rank{rank}.error").write_text(f"{where}: {type(exc).__name__}: {exc}")
    finally:
        dist.destroy_process_group()


def _bytes(tensor: torch.Tensor) -> bytes:
    return tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


@pytest.mark.processes
@pytest.mark.timeout(400)
@pytest.mark.parametrize(("world", "transport"), [(2, "auto"), (3, "grpc")])
def test_every_collective_gives_the_bytes_gloo_gives_on_every_rank(
    tmp_path: Path, world: int, transport: str
) -> None:
    """N=2 over shared memory (the same-host default), N=3 over gRPC; each rank runs every case
    on gradserver and on gloo and compares dtype, shape and bytes."""
    store = str(tmp_path / "store")
    spawn_and_join(_both_backends_rank, [(r, world, store, str(tmp_path), transport) for r in range(world)])
    results = rank_results(tmp_path, world)
    for rank in range(world):
        assert set(results[rank]) == set(_cases(world))
        for name, got in results[rank].items():
            ours, gloo = got["gradserver"], got["gloo"]
            assert len(ours) == len(gloo), (name, rank)
            for a, b in zip(ours, gloo, strict=True):
                assert (a.dtype, a.shape) == (b.dtype, b.shape), (name, rank, a, b)
                assert _bytes(a) == _bytes(b), (name, rank, a, b)


# --- in one process: bytes on the wire, shared memory, resizable tensors ---------------------


def _groups(address: str, world: int, transport: str = "auto") -> list[ProcessGroupGradServer]:
    """One group per rank, joined over `transport` ("shm" fails unless shared memory is used)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("GRADSERVER_TRANSPORT", transport)
        with concurrent.futures.ThreadPoolExecutor(world) as pool:
            joins = [
                pool.submit(CollectiveClient.connect_as_rank, address, r, timeout=TEST_TIMEOUTS)
                for r in range(world)
            ]
            return [ProcessGroupGradServer(f.result(timeout=TEST_TIMEOUTS.join + 5)) for f in joins]


def _on_every_rank(
    groups: list[ProcessGroupGradServer], call: Callable[[int, ProcessGroupGradServer], Any]
) -> list[Any]:
    with concurrent.futures.ThreadPoolExecutor(len(groups)) as pool:
        futures = [pool.submit(call, rank, group) for rank, group in enumerate(groups)]
        return [f.result(timeout=60) for f in futures]


def _shutdown(groups: list[ProcessGroupGradServer]) -> None:
    for group in groups:
        group.shutdown()


def _traffic(server: ServerThread, world: int) -> list[tuple[int, int]]:
    """(received from, sent to) payload bytes per rank, as the coordinator counted them."""

    def read(gs: Any) -> list[tuple[int, int]]:
        return [(t.received_bytes, t.sent_bytes) for t in (gs.traffic(r) for r in range(world))]

    result: list[tuple[int, int]] = server.call(read)
    return result


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", ["grpc", "shm"])
def test_each_rank_sends_and_receives_only_the_bytes_its_collective_needs(
    coordinator: Callable[..., ServerThread], transport: str
) -> None:
    """All-gather of S bytes: S up, N*S down; broadcast: S up from the root, nothing from the
    others, S down to each; reduce-scatter of S bytes: S up, S/N down; reduce of S bytes: S up
    from each, S down to the root only over gRPC (within 10 %)."""
    world, elements = 3, 3 * 20_000
    size = elements * 4
    server = coordinator(world_size=world, chunk_mib=0.25)
    groups = _groups(server.address, world, transport)
    try:
        before = _traffic(server, world)

        def all_gather(rank: int, group: ProcessGroupGradServer) -> None:
            out = torch.zeros(world * elements)
            group.all_gather_single(out, torch.full((elements,), float(rank))).wait()
            assert torch.equal(out, torch.arange(world).float().repeat_interleave(elements))

        _on_every_rank(groups, all_gather)
        gathered = _traffic(server, world)
        for rank in range(world):
            up, down = (gathered[rank][i] - before[rank][i] for i in range(2))
            assert up + down <= 1.1 * (size + world * size), (rank, up, down)
            assert up >= size and down >= world * size, (rank, up, down)

        def broadcast(rank: int, group: ProcessGroupGradServer) -> None:
            options = dist.BroadcastOptions()
            options.rootRank = 1
            tensor = torch.full((elements,), float(rank))
            group.broadcast([tensor], options).wait()
            assert torch.equal(tensor, torch.ones(elements))

        _on_every_rank(groups, broadcast)
        broadcast_traffic = _traffic(server, world)
        for rank in range(world):
            up, down = (broadcast_traffic[rank][i] - gathered[rank][i] for i in range(2))
            assert up <= 1.1 * size if rank == 1 else up == 0, (rank, up)
            assert size <= down <= 1.1 * size, (rank, down)

        def reduce_scatter(rank: int, group: ProcessGroupGradServer) -> None:
            out = torch.zeros(elements // world)
            group.reduce_scatter_single(out, torch.full((elements,), float(rank + 1))).wait()
            assert torch.equal(out, torch.full((elements // world,), float(sum(range(1, world + 1)))))

        _on_every_rank(groups, reduce_scatter)
        scattered = _traffic(server, world)
        for rank in range(world):
            up, down = (scattered[rank][i] - broadcast_traffic[rank][i] for i in range(2))
            assert up + down <= 1.1 * (size + size / world), (rank, up, down)

        def reduce(rank: int, group: ProcessGroupGradServer) -> None:
            options = dist.ReduceOptions()
            options.rootRank, options.reduceOp = 2, dist.ReduceOp.SUM
            tensor = torch.full((elements,), float(rank + 1))
            group.reduce([tensor], options).wait()
            expected = float(sum(range(1, world + 1))) if rank == 2 else float(rank + 1)
            assert torch.equal(tensor, torch.full((elements,), expected)), rank

        _on_every_rank(groups, reduce)
        reduced = _traffic(server, world)
        for rank in range(world):
            up, down = (reduced[rank][i] - scattered[rank][i] for i in range(2))
            assert size <= up <= 1.1 * size, (rank, up)
            # Through the collective lane (every rank on the coordinator's host) every rank reads
            # the lane's output, as for any reduction: no link carries it.
            if transport == "grpc" or rank == 2:
                assert (size <= down <= 1.1 * size) if rank == 2 else down == 0, (rank, down)
    finally:
        _shutdown(groups)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", ["grpc", "shm"])
def test_results_spanning_many_chunks_arrive_whole_over_either_transport(
    coordinator: Callable[..., ServerThread], transport: str
) -> None:
    """Chunks of 1 KiB (256 bytes for BYTES): every result is many pieces, per rank for the
    all-to-all and the reduce-scatter."""
    world = 2
    server = coordinator(world_size=world, chunk_mib=1024 / 2**20)
    groups = _groups(server.address, world, transport)
    try:

        def run(rank: int, group: ProcessGroupGradServer) -> list[torch.Tensor]:
            mine = torch.arange(1000, dtype=torch.int64) * (rank + 1)
            gathered = torch.zeros(world * 1000, dtype=torch.int64)
            group.all_gather_single(gathered, mine).wait()
            sent = [100 + 50 * rank, 300 - 50 * rank]  # rank r sends sent[j] rows to rank j
            received = [100 + 50 * j if rank == 0 else 300 - 50 * j for j in range(world)]
            out = torch.zeros(sum(received), dtype=torch.float64)
            data = torch.arange(sum(sent), dtype=torch.float64) + 1000 * rank
            group.all_to_all_single(out, data, received, sent).wait()
            summed = torch.zeros(500)
            group.reduce_scatter_single(summed, torch.arange(1000.0) * (rank + 1)).wait()
            return [gathered, out, summed]

        results = _on_every_rank(groups, run)
        for rank in range(world):
            gathered, out, summed = results[rank]
            assert torch.equal(gathered, torch.cat([torch.arange(1000) * (r + 1) for r in range(world)]))
            # Rank 0 gets rows [0, 100) of rank 0 and [0, 150) of rank 1; rank 1 the rest of each.
            if rank == 0:
                expected = torch.cat([torch.arange(100.0), torch.arange(150.0) + 1000])
            else:
                expected = torch.cat([torch.arange(100.0, 400.0), torch.arange(150.0, 400.0) + 1000])
            assert torch.equal(out, expected)
            assert torch.equal(summed, (torch.arange(1000.0) * 3)[500 * rank : 500 * (rank + 1)])
    finally:
        _shutdown(groups)


@pytest.mark.timeout(120)
def test_every_tensor_a_native_collective_touched_stays_resizable(
    coordinator: Callable[..., ServerThread],
) -> None:
    """The outputs the coordinator's results are written straight into, and every input, keep a
    storage that `resize_` may grow, as with gloo."""
    world = 2
    groups = _groups(coordinator(world_size=world).address, world)
    try:

        def touch_all(rank: int, group: ProcessGroupGradServer) -> list[torch.Tensor]:
            mine = torch.full((2,), float(rank))
            gathered = torch.zeros(4)
            group.all_gather_single(gathered, mine).wait()
            whole = torch.full((4,), float(rank + 1))
            part = torch.zeros(2)
            group.reduce_scatter_single(part, whole).wait()
            sent = torch.arange(4, dtype=torch.int32) + 10 * rank
            exchanged = torch.zeros(4, dtype=torch.int32)
            group.all_to_all_single(exchanged, sent, [], []).wait()
            options = dist.ScatterOptions()
            options.rootRank = 0
            scattered = torch.zeros(2)
            pieces = [torch.full((2,), 5.0 + r) for r in range(world)]
            group.scatter([scattered], [pieces] if rank == 0 else [], options).wait()
            touched = [mine, gathered, whole, part, sent, exchanged, scattered, *pieces]
            results = [t.clone() for t in touched]
            for tensor in touched:
                tensor.resize_(64)  # "Trying to resize storage that is not resizable" if marked
            return results

        for rank, results in enumerate(_on_every_rank(groups, touch_all)):
            got = [t.tolist() for t in results[:7]]
            assert got == [
                [float(rank)] * 2,
                [0.0, 0.0, 1.0, 1.0],
                [float(rank + 1)] * 4,
                [3.0, 3.0],
                [10 * rank + j for j in range(4)],
                [2 * rank, 2 * rank + 1, 10 + 2 * rank, 10 + 2 * rank + 1],
                [5.0 + rank] * 2,
            ]
    finally:
        _shutdown(groups)


@pytest.mark.timeout(60)
def test_a_collective_that_cannot_fit_the_ranks_is_refused_before_anything_is_sent(
    coordinator: Callable[..., ServerThread],
) -> None:
    """The worker library names the key and what does not fit: a reduce-scatter that does not
    split into one part per rank, a broadcast root beyond the ranks, all-to-all splits that are
    not one per rank summing to what is sent."""
    world = 2
    server = coordinator(world_size=world)
    with concurrent.futures.ThreadPoolExecutor(world) as pool:
        joins = [
            pool.submit(CollectiveClient.connect_as_rank, server.address, r, timeout=TEST_TIMEOUTS)
            for r in range(world)
        ]
        clients = [f.result(timeout=TEST_TIMEOUTS.join + 5) for f in joins]
    try:
        client = clients[0]
        with pytest.raises(InvalidArgumentError, match=r"REDUCE_SCATTER.*3 elements do not split into 2"):
            client.send_collective(0, 0, np.ones(3, np.float32), kind=CollectiveKind.REDUCE_SCATTER)
        with pytest.raises(InvalidArgumentError, match=r"BROADCAST from rank 2.*root 2 is out of range"):
            client.send_collective(0, 0, np.ones(4, np.uint8), kind=CollectiveKind.BROADCAST, root=2)
        with pytest.raises(InvalidArgumentError, match=r"ALL_TO_ALL.*split_bytes \[1, 2\] must hold"):
            client.send_collective(
                0, 0, np.ones(4, np.uint8), kind=CollectiveKind.ALL_TO_ALL, split_bytes=(1, 2)
            )
        # Nothing was sent: the same operation still runs once every rank contributes.
        for rank, peer in enumerate(clients):
            peer.send_collective(0, 0, np.full(2, rank, np.uint8), kind=CollectiveKind.ALL_GATHER)
        for peer in clients:
            assert peer.receive_collective(30).tolist() == [0, 0, 1, 1]
    finally:
        for peer in clients:
            peer.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", ["grpc", "shm"])
def test_in_place_all_gather_and_reduce_scatter_give_what_separate_buffers_give(
    coordinator: Callable[..., ServerThread], transport: str
) -> None:
    """FSDP's in-place forms: the all-gather input is this rank's own piece of the output, the
    reduce-scatter output this rank's own part of the input, while results stream in in small
    chunks."""
    world, n = 3, 3000
    server = coordinator(world_size=world, chunk_mib=1024 / 2**20)
    groups = _groups(server.address, world, transport)
    try:

        def run(rank: int, group: ProcessGroupGradServer) -> list[torch.Tensor]:
            gathered = torch.zeros(world * n)
            own = gathered[rank * n : (rank + 1) * n]
            own.copy_(torch.arange(float(n)) + 10_000 * rank)
            group.all_gather_single(gathered, own).wait()
            whole = torch.arange(float(world * n)) * (rank + 1)
            group.reduce_scatter_single(whole[rank * n : (rank + 1) * n], whole).wait()
            return [gathered, whole[rank * n : (rank + 1) * n].clone()]

        total = sum(r + 1 for r in range(world))
        for rank, (gathered, part) in enumerate(_on_every_rank(groups, run)):
            assert torch.equal(
                gathered, torch.cat([torch.arange(float(n)) + 10_000 * r for r in range(world)])
            )
            assert torch.equal(part, torch.arange(float(rank * n), float((rank + 1) * n)) * total)
    finally:
        _shutdown(groups)


@pytest.mark.timeout(60)
def test_an_all_gather_larger_than_the_shared_memory_arena_goes_on_inline_without_waiting(
    coordinator: Callable[..., ServerThread],
) -> None:
    """An all-gather holds its input slots until its whole result is in: with 8 slots and 256
    chunks, the chunks beyond the arena go inline at once (each used to wait 2 s for a slot)."""
    world, nbytes = 2, 64 * 1024
    server = coordinator(world_size=world, chunk_mib=1024 / 2**20)
    with concurrent.futures.ThreadPoolExecutor(world) as pool:
        joins = [
            pool.submit(
                CollectiveClient.connect,
                server.address,
                rank=r,
                timeout=TEST_TIMEOUTS,
                transport="shm",
                shm_arena_mib=8 / 1024,
            )
            for r in range(world)
        ]
        clients = [f.result(timeout=TEST_TIMEOUTS.join + 5) for f in joins]
    try:
        data = [np.full(nbytes, 1 + rank, np.uint8) for rank in range(world)]

        def run(rank: int) -> np.ndarray:
            clients[rank].send_collective(0, 0, data[rank], kind=CollectiveKind.ALL_GATHER)
            return clients[rank].receive_collective(30)

        with concurrent.futures.ThreadPoolExecutor(world) as pool:
            results = list(pool.map(run, range(world)))
        for result in results:
            assert result.tobytes() == b"".join(d.tobytes() for d in data)
        assert all(client.transport == "shm" for client in clients)
    finally:
        for client in clients:
            client.close()


@pytest.mark.timeout(60)
def test_partitioned_coordinators_refuse_the_kinds_other_than_reduce_before_anything_is_sent(
    partitioned: Callable[..., Any],  # noqa: F811 - pytest passes the imported fixture
) -> None:
    """Each partition sees only its chunks, so none can gather, relay or route: the worker says
    so, naming the key, and the next REDUCE of the group still runs."""
    world = 2
    partitions = partitioned(2, world_size=world)
    with concurrent.futures.ThreadPoolExecutor(world) as pool:
        joins = [
            pool.submit(CollectiveClient.connect_as_rank, partitions.address, r, timeout=TEST_TIMEOUTS)
            for r in range(world)
        ]
        clients = [f.result(timeout=TEST_TIMEOUTS.join + 5) for f in joins]
    try:
        with pytest.raises(FailedPreconditionError, match=r"ALL_GATHER of group 0: partitioned coordinators"):
            clients[0].send_collective(0, 0, np.ones(4, np.uint8), kind=CollectiveKind.ALL_GATHER)
        for rank, client in enumerate(clients):
            client.send_collective(0, 0, np.full(3, rank + 1.0, np.float32))
        for client in clients:
            assert client.receive_collective(30).tolist() == [3.0] * 3
    finally:
        for client in clients:
            client.close()
