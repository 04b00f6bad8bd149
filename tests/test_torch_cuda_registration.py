"""The torch backend for CUDA tensors, as far as a machine without a GPU can check it (issue 52).

Registration: a gradserver group is the backend of both device types it was registered for, in
torch's eyes too: `_device_types` holds cpu and cuda and `_get_backend(torch.device("cuda"))` is
the group, for the default group, `dist.new_group` and DeviceMesh groups (1-D and 2-D). Torch
found no backend for cuda before (FSDP2, DeviceMesh and `init_process_group(device_id=...)` ask).
A backend string that gives a device type to another backend ("cpu:gloo,cuda:gradserver") is
refused, naming it: torch would hand the whole group to gradserver and never run the other one.

The former names of the single-tensor collectives (`_allgather_base`, ...), which older torch
releases call for `all_gather_into_tensor`, `reduce_scatter_tensor` and `all_to_all_single`.

Staging: every collective runs on host tensors, device tensors being copied in and out through
`_staging`. Here host tensors are staged as if they were on a device (the copies are plain ones),
so every collective's copies in and out are checked, results exact, on the CPU; the CUDA copies
themselves (pinned buffers, streams, events) run in scripts/gpu-check.sh.
"""

from __future__ import annotations

import concurrent.futures
import socket
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from gradserver.torch._collective import CollectiveClient
from gradserver.torch._devices import BlockingTransfers, DeviceTransfers, Transfers
from gradserver.torch._registration import DEVICE_TYPES, device_backends, served_devices
from gradserver.torch._staging import Staging
from gradserver.torch.backend import ProcessGroupGradServer

from .helpers.ranks import rank_results, spawn_and_join
from .helpers.server import TEST_TIMEOUTS, ServerThread

# --- registration, in torch's own process groups ---------------------------------------------

MESH_WORLD = 4


def _describe(group: Any) -> dict[str, Any]:
    """What torch sees of a group's backends."""
    seen: dict[str, Any] = {
        "type": type(group).__name__,
        "device_types": [str(d) for d in group._device_types],
        "capability": dist.distributed_c10d._device_capability(group),
        "backend": dist.get_backend(group),
    }
    for device in ("cpu", "cuda", "xpu"):
        try:
            seen[f"{device} backend"] = (
                "the group" if group._get_backend(torch.device(device)) is group else "other"
            )
        except RuntimeError as exc:
            seen[f"{device} backend"] = str(exc)
    return seen


def _registration_rank(rank: int, store: str, out: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    import gradserver.torch  # noqa: F401 - registers the backend in this fresh process

    dist.init_process_group("gradserver", init_method=f"file://{store}", rank=rank, world_size=MESH_WORLD)
    try:
        groups = {"world": dist.group.WORLD, "new_group": dist.new_group([0, 1, 2, 3])}
        groups["mesh 1-D"] = init_device_mesh("cpu", (MESH_WORLD,)).get_group()
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        groups["mesh 2-D replicate"] = mesh.get_group("replicate")
        groups["mesh 2-D shard"] = mesh.get_group("shard")
        seen: dict[str, Any] = {name: _describe(group) for name, group in groups.items()}
        # Object collectives pick their device from the group's device types: still the host.
        seen["object device"] = dist.distributed_c10d._get_object_coll_device()
        objects: list[Any] = [None] * MESH_WORLD
        dist.all_gather_object(objects, {"rank": rank})
        seen["objects"] = objects
        torch.save(seen, Path(out) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.processes
@pytest.mark.timeout(300)
def test_every_gradserver_group_is_the_backend_for_cpu_and_cuda(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    argss = [(rank, str(tmp_path / "store"), str(out)) for rank in range(MESH_WORLD)]
    spawn_and_join(_registration_rank, argss)
    for rank, seen in enumerate(rank_results(out, MESH_WORLD)):
        for name in ("world", "new_group", "mesh 1-D", "mesh 2-D replicate", "mesh 2-D shard"):
            assert seen[name] == {
                "type": "ProcessGroupGradServer",
                "device_types": ["cpu", "cuda"],
                "capability": ["cpu", "cuda"],
                "backend": "gradserver",
                "cpu backend": "the group",
                "cuda backend": "the group",
                "xpu backend": "No backend type associated with device type xpu",
            }, (rank, name)
        assert seen["object device"] == "cpu"
        assert seen["objects"] == [{"rank": r} for r in range(MESH_WORLD)]


BACKEND_STRINGS = (
    "cpu:gloo,cuda:gradserver",
    "cpu:gradserver,cuda:gloo",
    "cpu:gradserver",
    "cuda:gradserver",
)


def _backend_strings_rank(rank: int, world: int, stores: str, out: str) -> None:
    import gradserver.torch  # noqa: F401 - registers the backend in this fresh process

    results: dict[str, Any] = {}
    for i, backend in enumerate(BACKEND_STRINGS):
        try:
            dist.init_process_group(backend, init_method=f"file://{stores}/{i}", rank=rank, world_size=world)
        except ValueError as exc:
            results[backend] = f"refused: {exc}"
            continue
        try:
            seen = _describe(dist.group.WORLD)
            tensor = torch.full((3,), float(rank + 1))
            dist.all_reduce(tensor)
            seen["sum"] = tensor.tolist()
            results[backend] = seen
        finally:
            dist.destroy_process_group()
    torch.save(results, Path(out) / f"rank{rank}.pt")


@pytest.mark.processes
@pytest.mark.timeout(300)
def test_a_backend_string_sharing_the_group_with_another_backend_is_refused_naming_it(
    tmp_path: Path,
) -> None:
    world = 2
    out, stores = tmp_path / "out", tmp_path / "stores"
    out.mkdir()
    stores.mkdir()
    spawn_and_join(_backend_strings_rank, [(rank, world, str(stores), str(out)) for rank in range(world)])
    for results in rank_results(out, world):
        for backend, other, device in (
            ("cpu:gloo,cuda:gradserver", "gloo", "cpu"),
            ("cpu:gradserver,cuda:gloo", "gloo", "cuda"),
        ):
            refusal = results[backend]
            assert isinstance(refusal, str), (backend, refusal)
            assert refusal.startswith(
                f'refused: gradserver cannot share a process group with another backend: "{backend}" asks '
                f"for {other} for {device} tensors."
            ), refusal
            assert f"so {other} would never run" in refusal, refusal
        # A string that gives gradserver one device type: the group is the backend of that one.
        for backend, device, absent in (
            ("cpu:gradserver", "cpu", "cuda"),
            ("cuda:gradserver", "cuda", "cpu"),
        ):
            seen = results[backend]
            assert seen["device_types"] == [device] and seen["capability"] == [device], (backend, seen)
            assert seen[f"{device} backend"] == "the group", (backend, seen)
            assert seen[f"{absent} backend"] == f"No backend type associated with device type {absent}"
            assert seen["sum"] == [3.0, 3.0, 3.0], (backend, seen)


def test_a_group_made_outside_torchs_group_builder_serves_every_registered_device() -> None:
    """The creator reads the device map from torch's frame that calls it; from any other caller
    (this test's frame) it has none, and the group serves cpu and cuda."""
    assert device_backends(sys._getframe()) is None
    assert served_devices(None) == DEVICE_TYPES == ("cpu", "cuda")
    assert served_devices({"cpu": "gradserver", "cuda": "gradserver"}) == ("cpu", "cuda")
    with pytest.raises(ValueError, match=r'"cpu:gradserver,cuda:nccl" asks for nccl for cuda tensors'):
        served_devices({"cpu": "gradserver", "cuda": "nccl"})


def _twice_rank(rank: int, world: int, port: int, out: str) -> None:
    import datetime

    import gradserver.torch  # noqa: F401 - registers the backend in this fresh process

    # One Store for both, as torchrun's outlives every group of its ranks.
    store = dist.TCPStore(
        "127.0.0.1", port, world, is_master=rank == 0, timeout=datetime.timedelta(seconds=60)
    )
    sums = []
    for incarnation in range(2):
        dist.init_process_group(
            "gradserver", store=store, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=20)
        )
        try:
            tensor = torch.full((2,), float(rank + incarnation))
            dist.all_reduce(tensor)
            sums.append(tensor.tolist())
        finally:
            dist.destroy_process_group()
    torch.save(sums, Path(out) / f"rank{rank}.pt")


@pytest.mark.processes
@pytest.mark.timeout(300)
def test_the_default_group_created_again_on_one_store_joins_its_new_coordinator(tmp_path: Path) -> None:
    """torch numbers groups from 0 again after destroy_process_group, so the second default group
    has the first one's name on the same Store: rank 1 read the first coordinator's address, gone
    by then, and failed to connect (as bench.torch_cuda's gloo-then-gradserver runs did)."""
    world = 2
    with socket.socket() as probe:  # a free port for rank 0's Store
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    spawn_and_join(_twice_rank, [(rank, world, port, str(tmp_path)) for rank in range(world)])
    for sums in rank_results(tmp_path, world):
        assert sums == [[1.0, 1.0], [3.0, 3.0]]


# --- two ranks in this process ----------------------------------------------------------------


def _groups(
    address: str, world: int, transfers: Callable[[], DeviceTransfers] | None = None
) -> list[ProcessGroupGradServer]:
    with concurrent.futures.ThreadPoolExecutor(world) as pool:
        joins = [
            pool.submit(CollectiveClient.connect_as_rank, address, r, timeout=TEST_TIMEOUTS)
            for r in range(world)
        ]
        clients = [f.result(timeout=TEST_TIMEOUTS.join + 5) for f in joins]
    if transfers is None:
        return [ProcessGroupGradServer(client) for client in clients]
    return [ProcessGroupGradServer(client, transfers=transfers()) for client in clients]


def _on_every_rank(
    groups: Sequence[ProcessGroupGradServer], call: Callable[[int, ProcessGroupGradServer], Any]
) -> list[Any]:
    with concurrent.futures.ThreadPoolExecutor(len(groups)) as pool:
        futures = [pool.submit(call, rank, group) for rank, group in enumerate(groups)]
        return [f.result(timeout=60) for f in futures]


@pytest.mark.timeout(120)
def test_the_former_names_of_the_single_tensor_collectives_run_them(
    coordinator: Callable[..., ServerThread],
) -> None:
    """Older torch releases call `group._allgather_base(out, in)` for all_gather_into_tensor (and
    so on); the C++ base class answered "No backend type associated with device type cpu"."""
    groups = _groups(coordinator(world_size=2).address, 2)
    try:

        def call(rank: int, group: ProcessGroupGradServer) -> dict[str, list[float]]:
            mine = torch.tensor([rank + 1.0, 10.0 * (rank + 1)])
            gathered, scattered, exchanged = torch.zeros(4), torch.zeros(1), torch.zeros(2)
            group._allgather_base(gathered, mine).wait()
            group._reduce_scatter_base(scattered, mine).wait()
            group.alltoall_base(exchanged, mine, [], []).wait()
            coalesced_gather, coalesced_scatter = torch.zeros(4), torch.zeros(1)
            group.allgather_into_tensor_coalesced([coalesced_gather], [mine]).wait()
            group.reduce_scatter_tensor_coalesced([coalesced_scatter], [mine]).wait()
            return {
                "gathered": gathered.tolist(),
                "scattered": scattered.tolist(),
                "exchanged": exchanged.tolist(),
                "coalesced gather": coalesced_gather.tolist(),
                "coalesced scatter": coalesced_scatter.tolist(),
            }

        results = _on_every_rank(groups, call)
        for rank, got in enumerate(results):
            assert got == {
                "gathered": [1.0, 10.0, 2.0, 20.0],
                "scattered": [[3.0], [30.0]][rank],
                "exchanged": [[1.0, 2.0], [10.0, 20.0]][rank],
                "coalesced gather": [1.0, 10.0, 2.0, 20.0],
                "coalesced scatter": [[3.0], [30.0]][rank],
            }, rank
    finally:
        for group in groups:
            group.shutdown()


# --- staging -----------------------------------------------------------------------------------


class _RecordingTransfers(BlockingTransfers):
    """Plain copies, recording which of the caller's tensors went to and from which buffer."""

    def __init__(self) -> None:
        self.to_host_calls: list[list[tuple[torch.Tensor, torch.Tensor]]] = []
        self.to_device_calls: list[list[tuple[torch.Tensor, torch.Tensor]]] = []

    def to_host(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.to_host_calls.append(list(pairs))
        super().to_host(pairs)

    def to_device(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> object:
        self.to_device_calls.append(list(pairs))
        return super().to_device(pairs)

    def clear(self) -> None:
        self.to_host_calls.clear()
        self.to_device_calls.clear()


class _StageEverything(DeviceTransfers):
    """Stages host tensors as if they were on a device: each goes through a buffer of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.recording = _RecordingTransfers()

    def stages(self, tensor: torch.Tensor) -> bool:
        return True

    def for_device(self, device: torch.device) -> Transfers:
        return self.recording


def _copied(calls: list[list[tuple[torch.Tensor, torch.Tensor]]], caller_side: int) -> list[torch.Tensor]:
    """The caller's tensors among the pairs (index `caller_side` of each), checking that each
    went through a buffer of its own."""
    tensors = []
    for pairs in calls:
        for pair in pairs:
            caller, buffer = pair[caller_side], pair[1 - caller_side]
            assert buffer.data_ptr() != caller.data_ptr() and buffer.is_contiguous()
            tensors.append(caller)
    return tensors


def _same(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> bool:
    return sorted(map(id, a)) == sorted(map(id, b))


def _staged_collectives(rank: int, group: ProcessGroupGradServer) -> dict[str, Any]:
    """Every collective once; for each, the results and which tensors were copied in and out."""
    recording = group._transfers.for_device(torch.device("cpu"))
    assert isinstance(recording, _RecordingTransfers)
    results: dict[str, Any] = {}

    def check(name: str, reads: Sequence[torch.Tensor], writes: Sequence[torch.Tensor], value: Any) -> None:
        assert _same(_copied(recording.to_host_calls, 0), reads), name
        assert _same(_copied(recording.to_device_calls, 1), writes), name
        results[name] = value
        recording.clear()

    other = 1 - rank
    # In place; a transposed (non-contiguous) view, written back through its strides.
    base = torch.arange(6.0).reshape(2, 3) * (rank + 1)
    view = base.t()
    group.allreduce([view]).wait()
    check("allreduce transposed", [view], [view], base.tolist())

    for dtype, op, name in (
        (torch.bfloat16, dist.ReduceOp.AVG, "AVG"),
        (torch.int64, dist.ReduceOp.SUM, "SUM"),
        (torch.float64, dist.ReduceOp.MAX, "MAX"),
    ):
        t = torch.tensor([1, 2, 3], dtype=dtype) * (rank + 1)
        group.allreduce([t], op).wait()
        check(f"allreduce {dtype} {name}", [t], [t], t.tolist())

    a, b = torch.full((2,), 1.0 + rank), torch.full((3,), 10.0 * (rank + 1))
    group.allreduce_coalesced([a, b]).wait()
    check("allreduce_coalesced", [a, b], [a, b], [a.tolist(), b.tolist()])

    options = dist.BroadcastOptions()
    options.rootRank = 1
    t = torch.full((4,), float(rank))
    group.broadcast([t], options).wait()
    check("broadcast", [t] if rank == 1 else [], [] if rank == 1 else [t], t.tolist())

    mine = torch.tensor([rank + 1.0, -(rank + 1.0)])
    outs = [torch.zeros(2), torch.zeros(2)]
    group.allgather([outs], [mine]).wait()
    check("allgather", [mine], outs, [o.tolist() for o in outs])

    # FSDP's all-gather: the input is this rank's own piece of the output.
    output = torch.zeros(4)
    own = output[2 * rank : 2 * rank + 2]
    own.copy_(torch.tensor([rank + 0.5, rank + 0.25]))
    group.all_gather_single(output, own).wait()
    check("all_gather_into_tensor in place", [own], [output], output.tolist())

    source, part = torch.arange(4.0) * (rank + 1), torch.zeros(2)
    group.reduce_scatter_single(part, source).wait()
    check("reduce_scatter_tensor", [source], [part], part.tolist())

    pieces, part = [torch.full((2,), 1.0 + rank), torch.full((2,), 5.0 + rank)], torch.zeros(2)
    group.reduce_scatter([part], [pieces]).wait()
    check("reduce_scatter", pieces, [part], part.tolist())

    inputs, outputs = [torch.tensor([rank + 1.0])], [torch.zeros(2)]
    group.all_gather_single_coalesced(outputs, inputs).wait()
    check("all_gather_into_tensor_coalesced", inputs, outputs, outputs[0].tolist())

    inputs, outputs = [torch.tensor([1.0, 2.0]) * (rank + 1)], [torch.zeros(1)]
    group.reduce_scatter_single_coalesced(outputs, inputs).wait()
    check("reduce_scatter_tensor_coalesced", inputs, outputs, outputs[0].tolist())

    source, received = torch.tensor([10.0 * rank, 10.0 * rank + 1]), torch.zeros(2)
    group.all_to_all_single(received, source, [], []).wait()
    check("all_to_all_single even", [source], [received], received.tolist())

    # Uneven: rank 0 sends 1 row to itself and 2 to rank 1; rank 1 sends 3 to rank 0, 1 to itself.
    sends = [[1, 2], [3, 1]][rank]
    gets = [[1, 3], [2, 1]][rank]
    source = torch.arange(float(sum(sends))).reshape(-1, 1) + 100 * rank
    received = torch.zeros(sum(gets), 1)
    group.all_to_all_single(received, source, gets, sends).wait()
    check("all_to_all_single uneven", [source], [received], received.flatten().tolist())

    sources = [torch.tensor([rank * 10.0 + j]) for j in range(2)]
    receives = [torch.zeros(1), torch.zeros(1)]
    group.alltoall(receives, sources).wait()
    check("alltoall", sources, receives, [t.item() for t in receives])

    reduce_options = dist.ReduceOptions()
    reduce_options.rootRank = 0
    reduce_options.reduceOp = dist.ReduceOp.SUM
    t = torch.full((3,), 2.0 + rank)
    group.reduce([t], reduce_options).wait()
    check("reduce", [t], [t] if rank == 0 else [], t.tolist())

    gather_options = dist.GatherOptions()
    gather_options.rootRank = 1
    t, gathered = torch.tensor([rank + 7.0]), [torch.zeros(1), torch.zeros(1)]
    group.gather([gathered] if rank == 1 else [], [t], gather_options).wait()
    check("gather", [t], gathered if rank == 1 else [], [g.item() for g in gathered])

    scatter_options = dist.ScatterOptions()
    scatter_options.rootRank = 0
    chunks, got = [torch.tensor([30.0]), torch.tensor([31.0])], torch.zeros(1)
    group.scatter([got], [chunks] if rank == 0 else [], scatter_options).wait()
    check("scatter", chunks if rank == 0 else [], [got], got.item())

    group.barrier().wait()
    check("barrier", [], [], None)

    if rank == 0:
        t = torch.tensor([4.0, 5.0, 6.0])
        group.send([t], other, 3).wait()
        check("send/recv", [t], [], None)
    else:
        t = torch.zeros(3)
        group.recv([t], other, 3).wait()
        check("send/recv", [], [t], t.tolist())
    return results


@pytest.mark.timeout(120)
def test_every_collective_stages_device_tensors_through_host_buffers_exactly(
    coordinator: Callable[..., ServerThread],
) -> None:
    groups = _groups(coordinator(world_size=2).address, 2, _StageEverything)
    try:
        results = _on_every_rank(groups, _staged_collectives)
    finally:
        for group in groups:
            group.shutdown()
    expected: list[dict[str, Any]] = [
        {
            "allreduce transposed": [[0.0, 3.0, 6.0], [9.0, 12.0, 15.0]],
            "allreduce torch.bfloat16 AVG": [1.5, 3.0, 4.5],
            "allreduce torch.int64 SUM": [3, 6, 9],
            "allreduce torch.float64 MAX": [2.0, 4.0, 6.0],
            "allreduce_coalesced": [[3.0, 3.0], [30.0, 30.0, 30.0]],
            "broadcast": [1.0] * 4,
            "allgather": [[1.0, -1.0], [2.0, -2.0]],
            "all_gather_into_tensor in place": [0.5, 0.25, 1.5, 1.25],
            "reduce_scatter_tensor": [[0.0, 3.0], [6.0, 9.0]][rank],
            "reduce_scatter": [[3.0, 3.0], [11.0, 11.0]][rank],
            "all_gather_into_tensor_coalesced": [1.0, 2.0],
            "reduce_scatter_tensor_coalesced": [[3.0], [6.0]][rank],
            "all_to_all_single even": [[0.0, 10.0], [1.0, 11.0]][rank],
            "all_to_all_single uneven": [[0.0, 100.0, 101.0, 102.0], [1.0, 2.0, 103.0]][rank],
            "alltoall": [[0.0, 10.0], [1.0, 11.0]][rank],
            "reduce": [[5.0] * 3, [3.0] * 3][rank],
            "gather": [[0.0, 0.0], [7.0, 8.0]][rank],
            "scatter": [30.0, 31.0][rank],
            "barrier": None,
            "send/recv": [None, [4.0, 5.0, 6.0]][rank],
        }
        for rank in range(2)
    ]
    for rank in range(2):
        assert results[rank] == expected[rank], rank


def test_host_tensors_go_through_no_buffer_and_one_call_keeps_to_one_device() -> None:
    transfers = DeviceTransfers()
    host = torch.ones(3)
    staging = Staging("allreduce", [host], transfers)
    assert staging.update(host) is host and staging.read(host) is host
    assert not staging.device_resident and staging.nbytes == 12
    with pytest.raises(
        ValueError, match=r"the tensors of one call must be on one device, got \['cpu', 'meta'\]"
    ):
        Staging("allreduce_coalesced", [host, torch.ones(3, device="meta")], transfers)


def test_a_tensor_declared_twice_has_one_buffer_read_and_written_once() -> None:
    transfers = _StageEverything()
    tensor, other = torch.arange(4.0), torch.zeros(2)
    view = tensor[:2]
    staging = Staging("test", [tensor, view, other], transfers)
    buffer = staging.read(tensor)
    assert staging.write(tensor) is buffer  # read, then written: one buffer, both ways
    assert staging.read(view) is not buffer  # another view of the same memory: its own
    staging.write(other)
    with staging.running():
        staging.copy_in()
        assert torch.equal(buffer, tensor) and buffer.data_ptr() != tensor.data_ptr()
        buffer.add_(1)
        staging.copy_out()
    recording = transfers.recording
    assert _same(_copied(recording.to_host_calls, 0), [tensor, view])
    assert _same(_copied(recording.to_device_calls, 1), [tensor, other])
    assert torch.equal(tensor, torch.arange(4.0) + 1)
