"""Point-to-point operations of the torch backend (send, recv, isend, irecv, batch_isend_irecv,
send_object_list, recv_object_list), each scenario run by real ranks once on gloo and once on the
backend under test, and compared rank by rank: dtype, shape and every byte of what each rank got.

The scenarios follow torch.distributed's documentation, as gloo (torch 2.13) runs it:
- tags: messages are matched by (source, tag), not by arrival. gloo's blocking `send` waits until
  the peer has posted the matching `recv`, so a blocking send of tag 1 then tag 2 deadlocks a
  receiver that asks for tag 2 first; the out-of-order case therefore sends with `isend`. Two
  messages with the same tag between the same pair arrive in the order they were sent.
- any dtype, byte for byte: payloads are random bytes (NaNs with payloads, negative zeros,
  subnormals), some empty, some spanning many chunks (3 MiB and 3 MiB + 1 byte); sent tensors are
  contiguous (gloo refuses others).
- a ring with batch_isend_irecv, its receives listed before its sends (the order within a batch
  must not matter), 4 MiB per message: with 2 ranks the previous and the next rank are one peer.
- recv from any source (src=None) returns the sender's global rank, also when filtered by tag.
- Work.wait(timeout) on an irecv nobody sends to raises (gloo: RuntimeError) within about that
  time. Afterwards gloo closes the pair ("Application timeout caused pair closure"), so nothing is
  compared after it and the ranks end through a FileStore of their own, not the group.
- send_object_list / recv_object_list, also with use_batch=True (what torch.distributed.pipelining
  sends its stage metadata with), and the sender rank recv_object_list returns.

Every rank runs with the group's timeout OP_TIMEOUT, so a hang becomes an error the test shows.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from .helpers.ranks import rank_results, spawn_and_join

# The backend compared with gloo. Set it to "gloo" to check the tests themselves (gloo vs gloo).
BACKEND = "gradserver"
WORLDS = (2, 3)
OP_TIMEOUT = datetime.timedelta(seconds=30)
# Per rank; above OP_TIMEOUT, so that a rank stuck in an operation fails with its error first.
RANK_TIMEOUT_S = 50.0
WAIT_TIMEOUT_S = 2.0
# Two spawned rank sets, each normally a few seconds; a hang ends at OP_TIMEOUT.
pytestmark = [pytest.mark.processes, pytest.mark.timeout(150)]

MIB = 2**20
Results = dict[str, Any]
Scenario = Callable[[int, int], Results]  # (rank, world) -> what the rank got


# --- payloads -----------------------------------------------------------------------------------


def _seed(name: str) -> int:
    return sum(ord(c) * 131**i for i, c in enumerate(name)) % 2**31  # not hash(): salted per process


def payload(name: str, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """Deterministic contents for `name`: random bytes reinterpreted as `dtype` (any bit pattern a
    float can hold, NaN payloads included), or random True/False for bool."""
    generator = torch.Generator().manual_seed(_seed(name))
    numel = 1
    for size in shape:
        numel *= size
    if dtype == torch.bool:
        return (torch.randint(0, 2, (numel,), generator=generator, dtype=torch.uint8) == 1).reshape(shape)
    itemsize = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (numel * itemsize,), generator=generator, dtype=torch.uint8)
    return raw.view(dtype).reshape(shape)


def buffer(dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """A receive buffer filled with a pattern no payload is likely to be, so a receive that wrote
    nothing shows."""
    numel = 1
    for size in shape:
        numel *= size
    itemsize = torch.empty((), dtype=dtype).element_size()
    if dtype == torch.bool:
        return torch.zeros(shape, dtype=torch.bool)
    return torch.full((numel * itemsize,), 0x5A, dtype=torch.uint8).view(dtype).reshape(shape)


def as_bytes(tensor: torch.Tensor) -> bytes:
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def assert_same(got: Any, want: Any, where: str = "") -> None:
    """Equal structure; tensors equal in dtype, shape and bytes (NaNs compare by their bits)."""
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor), (where, type(got))
        assert (got.dtype, tuple(got.shape)) == (want.dtype, tuple(want.shape)), (where, got, want)
        assert as_bytes(got) == as_bytes(want), (where, got, want)
    elif isinstance(want, dict):
        assert isinstance(got, dict), (where, type(got))
        assert sorted(got, key=str) == sorted(want, key=str), (where, list(got), list(want))
        for key in want:
            assert_same(got[key], want[key], f"{where}[{key!r}]")
    elif isinstance(want, list | tuple):
        assert type(got) is type(want) and len(got) == len(want), (where, got, want)
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            assert_same(g, w, f"{where}[{i}]")
    else:
        assert got == want, (where, got, want)


# --- ranks --------------------------------------------------------------------------------------


def _init(backend: str, rank: int, world: int, store: str) -> None:
    import gradserver.torch  # noqa: F401 - registers "gradserver"

    torch.set_num_threads(1)  # several ranks share the test machine's cores
    dist.init_process_group(
        backend, init_method=f"file://{store}", rank=rank, world_size=world, timeout=OP_TIMEOUT
    )


def _rank(scenario: str, backend: str, rank: int, world: int, store: str, out_dir: str) -> None:
    """One rank of one scenario: its results to OUT/rankN.pt, or its error to OUT/rankN.error."""
    _init(backend, rank, world, store)
    out = Path(out_dir)
    try:
        results = SCENARIOS[scenario](rank, world)
        # No rank leaves while a peer may still be receiving from it (rank 0 of gradserver runs
        # the embedded coordinator).
        dist.barrier()
        torch.save(results, out / f"rank{rank}.pt")
    except Exception as exc:
        (out / f"rank{rank}.error").write_text(f"{type(exc).__name__}: {exc}")
    finally:
        dist.destroy_process_group()


def run(tmp: Path, scenario: str, backend: str, world: int, role: str) -> list[Results]:
    out = tmp / f"{scenario}-{role}-{backend}"
    out.mkdir()
    spawn_and_join(
        _rank,
        [(scenario, backend, r, world, str(out / "store"), str(out)) for r in range(world)],
        RANK_TIMEOUT_S,
    )
    return rank_results(out, world)


def run_both(tmp: Path, scenario: str, world: int) -> tuple[list[Results], list[Results]]:
    """(gloo's results, BACKEND's results), by rank, after checking they are the same."""
    gloo = run(tmp, scenario, "gloo", world, "reference")
    ours = run(tmp, scenario, BACKEND, world, "tested")
    for rank in range(world):
        assert_same(ours[rank], gloo[rank], f"{BACKEND} rank {rank}")
    return gloo, ours


# --- tags ---------------------------------------------------------------------------------------

TAG_RECEIVER = 1


def _tag_senders(world: int) -> list[int]:
    return [r for r in range(world) if r != TAG_RECEIVER]


def _tags(rank: int, world: int) -> Results:
    if rank != TAG_RECEIVER:
        # Out of order: the receiver asks for tag 2 first (gloo needs isend for this, see above).
        first = dist.isend(payload(f"a{rank}", torch.float32, (3,)), TAG_RECEIVER, tag=1)
        second = dist.isend(payload(f"b{rank}", torch.float32, (5,)), TAG_RECEIVER, tag=2)
        assert first is not None and second is not None
        first.wait()
        second.wait()
        # In order, blocking.
        dist.send(payload(f"c{rank}", torch.int64, (4,)), TAG_RECEIVER, tag=3)
        dist.send(payload(f"d{rank}", torch.int64, (2,)), TAG_RECEIVER, tag=4)
        # One tag, several messages: they arrive in the order sent.
        for i in range(2):
            dist.send(payload(f"e{rank}.{i}", torch.float32, (4,)), TAG_RECEIVER, tag=5)
        works = [
            dist.isend(payload(f"f{rank}.{i}", torch.float32, (4,)), TAG_RECEIVER, tag=6) for i in range(3)
        ]
        for work in works:
            assert work is not None
            work.wait()
        return {}

    got: Results = {"returned": []}

    def recv(name: str, src: int, tag: int, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
        tensor = buffer(dtype, shape)
        got["returned"].append((src, dist.recv(tensor, src, tag=tag)))
        got[f"{name} from {src}"] = tensor

    senders = _tag_senders(world)
    # With two senders the receives also alternate between them (the first ones in reverse).
    for src in reversed(senders):
        recv("b", src, 2, torch.float32, (5,))
    for src in senders:
        recv("a", src, 1, torch.float32, (3,))
    for src in senders:
        recv("c", src, 3, torch.int64, (4,))
        recv("d", src, 4, torch.int64, (2,))
    for src in senders:
        for i in range(2):
            recv(f"e{i}", src, 5, torch.float32, (4,))
        for i in range(3):
            recv(f"f{i}", src, 6, torch.float32, (4,))
    return got


@pytest.mark.parametrize("world", WORLDS)
def test_tagged_messages_match_by_source_and_tag_like_gloo(tmp_path: Path, world: int) -> None:
    gloo, _ = run_both(tmp_path, "tags", world)
    got = gloo[TAG_RECEIVER]
    want: dict[str, torch.Tensor] = {}
    for src in _tag_senders(world):
        want[f"a from {src}"] = payload(f"a{src}", torch.float32, (3,))
        want[f"b from {src}"] = payload(f"b{src}", torch.float32, (5,))
        want[f"c from {src}"] = payload(f"c{src}", torch.int64, (4,))
        want[f"d from {src}"] = payload(f"d{src}", torch.int64, (2,))
        for i in range(2):
            want[f"e{i} from {src}"] = payload(f"e{src}.{i}", torch.float32, (4,))
        for i in range(3):
            want[f"f{i} from {src}"] = payload(f"f{src}.{i}", torch.float32, (4,))
    assert_same({k: v for k, v in got.items() if k != "returned"}, want)
    # recv returns the sender's rank.
    assert all(src == returned for src, returned in got["returned"]), got["returned"]


# --- dtypes and sizes ---------------------------------------------------------------------------

# (name, dtype, shape); every case goes once through send/recv and once through isend/irecv.
DTYPE_CASES: list[tuple[str, torch.dtype, tuple[int, ...]]] = [
    ("f32 scalar", torch.float32, ()),
    ("f32 empty", torch.float32, (0,)),
    ("f32", torch.float32, (7,)),
    ("f32 3d", torch.float32, (3, 4, 5)),
    ("f32 3MiB", torch.float32, (3 * MIB // 4,)),
    ("f64", torch.float64, (4, 3)),
    ("bf16", torch.bfloat16, (17,)),
    ("bf16 empty 2d", torch.bfloat16, (0, 3)),
    ("f16", torch.float16, (2, 2, 2)),
    ("i64", torch.int64, (9,)),
    ("i32", torch.int32, (4,)),
    ("u8", torch.uint8, (5,)),
    ("i8 3MiB+1", torch.int8, (3 * MIB + 1,)),
    ("bool", torch.bool, (13,)),
    ("c64", torch.complex64, (6,)),
]


def _dtypes(rank: int, world: int) -> Results:
    """Rank 0 sends every case to every other rank, blocking, then all of them with isend."""
    got: Results = {}
    for method in ("send", "isend"):
        for name, dtype, shape in DTYPE_CASES:
            key = f"{method} {name}"
            if rank == 0:
                data = payload(key, dtype, shape)
                if method == "send":
                    for dst in range(1, world):
                        dist.send(data, dst)
                else:
                    works = [dist.isend(data, dst) for dst in range(1, world)]
                    for work in works:
                        assert work is not None
                        work.wait()
            else:
                tensor = buffer(dtype, shape)
                if method == "send":
                    dist.recv(tensor, 0)
                else:
                    work = dist.irecv(tensor, 0)
                    assert work is not None
                    work.wait()
                got[key] = tensor
    return got


@pytest.mark.parametrize("world", WORLDS)
def test_every_dtype_and_size_arrives_byte_for_byte_like_gloo(tmp_path: Path, world: int) -> None:
    gloo, _ = run_both(tmp_path, "dtypes", world)
    assert gloo[0] == {}
    for rank in range(1, world):
        for method in ("send", "isend"):
            for name, dtype, shape in DTYPE_CASES:
                key = f"{method} {name}"
                assert_same(gloo[rank][key], payload(key, dtype, shape), f"rank {rank} {key}")


# --- a ring with batch_isend_irecv --------------------------------------------------------------

RING_ROUNDS = 3
RING_BIG = (MIB,)  # float32: 4 MiB
RING_SMALL = (5,)


def _ring(rank: int, world: int) -> Results:
    """Each round every rank passes on what it got the round before (its own payloads first) to
    the next rank, and gets the previous rank's, in one batch: receives listed first."""
    nxt, prev = (rank + 1) % world, (rank - 1) % world
    small, big = (
        payload(f"ring small {rank}", torch.float64, RING_SMALL),
        payload(f"ring big {rank}", torch.float32, RING_BIG),
    )
    got: Results = {}
    for round_ in range(RING_ROUNDS):
        small_in, big_in = buffer(torch.float64, RING_SMALL), buffer(torch.float32, RING_BIG)
        ops = [
            dist.P2POp(dist.irecv, big_in, prev, tag=7),
            dist.P2POp(dist.irecv, small_in, prev),
            dist.P2POp(dist.isend, small, nxt),
            dist.P2POp(dist.isend, big, nxt, tag=7),
        ]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        got[f"small {round_}"], got[f"big {round_}"] = small_in, big_in
        small, big = small_in, big_in
    return got


@pytest.mark.parametrize("world", WORLDS)
def test_a_batch_isend_irecv_ring_passes_4_mib_messages_like_gloo(tmp_path: Path, world: int) -> None:
    gloo, _ = run_both(tmp_path, "ring", world)
    for rank in range(world):
        for round_ in range(RING_ROUNDS):
            origin = (rank - round_ - 1) % world
            want_small = payload(f"ring small {origin}", torch.float64, RING_SMALL)
            assert_same(gloo[rank][f"small {round_}"], want_small, f"rank {rank} round {round_}")
            want_big = payload(f"ring big {origin}", torch.float32, RING_BIG)
            assert_same(gloo[rank][f"big {round_}"], want_big, f"rank {rank} round {round_}")


# --- recv from any source -----------------------------------------------------------------------

ANY_SHAPE = (4,)


def _any_source(rank: int, world: int) -> Results:
    """Rank 0 receives from whoever sends (src=None), first untagged, then tag 6 before tag 5."""
    if rank != 0:
        dist.send(payload(f"any {rank}", torch.float64, ANY_SHAPE), 0)
        later = dist.isend(payload(f"tag5 {rank}", torch.float64, ANY_SHAPE), 0, tag=5)
        dist.send(payload(f"tag6 {rank}", torch.float64, ANY_SHAPE), 0, tag=6)
        assert later is not None
        later.wait()
        return {}
    got: Results = {}
    for key, tag in (("any", 0), ("tag6", 6), ("tag5", 5)):
        senders = []
        for _ in range(1, world):
            tensor = buffer(torch.float64, ANY_SHAPE)
            sender = dist.recv(tensor, tag=tag)  # src=None: any source
            senders.append(sender)
            got[f"{key} from {sender}"] = tensor
        # Arrival order between senders is up to timing: only which ranks sent is compared.
        got[f"{key} senders"] = sorted(senders)
    return got


@pytest.mark.parametrize("world", WORLDS)
def test_recv_from_any_source_returns_the_sender_like_gloo(tmp_path: Path, world: int) -> None:
    gloo, _ = run_both(tmp_path, "any_source", world)
    for key in ("any", "tag6", "tag5"):
        assert gloo[0][f"{key} senders"] == list(range(1, world))
        for sender in range(1, world):
            want = payload(f"{key} {sender}", torch.float64, ANY_SHAPE)
            assert_same(gloo[0][f"{key} from {sender}"], want, f"{key} from {sender}")


# --- object lists -------------------------------------------------------------------------------


def _objects(sender: int, receiver: int, use_batch: bool) -> list[Any]:
    return [
        "foo",
        12,
        {1: 2, "x": [3.5, None]},
        (sender, receiver, use_batch),
        "z" * 300_000,  # several chunks
        payload(f"object tensor {sender} {receiver}", torch.float32, (3, 2)),
    ]


def _object_lists(rank: int, world: int) -> Results:
    """Rank 0 sends a list to every other rank, plainly and with use_batch=True; then the last
    rank sends one back to rank 0."""
    got: Results = {}
    last = world - 1
    for use_batch in (False, True):
        if rank == 0:
            for dst in range(1, world):
                dist.send_object_list(_objects(0, dst, use_batch), dst=dst, use_batch=use_batch)
        else:
            objects: list[Any] = [None] * len(_objects(0, rank, use_batch))
            got[f"sender batch={use_batch}"] = dist.recv_object_list(objects, src=0, use_batch=use_batch)
            got[f"from 0 batch={use_batch}"] = objects
    if rank == last:
        dist.send_object_list(_objects(last, 0, True), dst=0, use_batch=True)
    elif rank == 0:
        objects = [None] * len(_objects(last, 0, True))
        got["sender"] = dist.recv_object_list(objects, src=last, use_batch=True)
        got[f"from {last}"] = objects
    return got


@pytest.mark.parametrize("world", WORLDS)
def test_object_lists_round_trip_like_gloo(tmp_path: Path, world: int) -> None:
    gloo, _ = run_both(tmp_path, "object_lists", world)
    last = world - 1
    assert gloo[0]["sender"] == last
    assert_same(gloo[0][f"from {last}"], _objects(last, 0, True), "rank 0")
    for rank in range(1, world):
        for use_batch in (False, True):
            assert gloo[rank][f"sender batch={use_batch}"] == 0
            assert_same(gloo[rank][f"from 0 batch={use_batch}"], _objects(0, rank, use_batch), f"rank {rank}")


# --- Work.wait with a timeout -------------------------------------------------------------------


def _wait_timeout_rank(backend: str, rank: int, store: str, signals: str, out_dir: str) -> None:
    """Rank 0 waits WAIT_TIMEOUT_S on an irecv from rank 1, which sends nothing. Rank 1 stays in
    the group until rank 0's wait has ended (on gloo a peer that leaves fails the wait at once,
    "Connection reset by peer"), then leaves first, so rank 0 (gradserver's coordinator) ends last.
    They synchronise through a FileStore: gloo closes the pair after the timeout."""
    _init(backend, rank, 2, store)
    out = Path(out_dir)
    signals_store = dist.FileStore(signals, 2)
    try:
        if rank == 0:
            work = dist.irecv(torch.zeros(3), 1, tag=77)
            assert work is not None
            start = time.monotonic()
            error: Exception | None = None
            try:
                work.wait(timeout=datetime.timedelta(seconds=WAIT_TIMEOUT_S))
            except Exception as exc:
                error = exc
            elapsed = time.monotonic() - start
            signals_store.set("waited", "1")
            signals_store.wait(["left"], OP_TIMEOUT)
            torch.save(
                {
                    "raised": error is not None,
                    "elapsed": elapsed,
                    "error": f"{type(error).__name__}: {error}" if error else "",
                },
                out / f"rank{rank}.pt",
            )
        else:
            signals_store.wait(["waited"], OP_TIMEOUT)
            dist.destroy_process_group()
            signals_store.set("left", "1")
            torch.save({}, out / f"rank{rank}.pt")
    except Exception as exc:
        (out / f"rank{rank}.error").write_text(f"{type(exc).__name__}: {exc}")
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _wait_timeout(tmp: Path, backend: str, role: str) -> Results:
    out = tmp / f"wait-{role}-{backend}"
    out.mkdir()
    argss = [(backend, r, str(out / "store"), str(out / "signals"), str(out)) for r in range(2)]
    spawn_and_join(_wait_timeout_rank, argss, RANK_TIMEOUT_S)
    return rank_results(out, 2)[0]


def test_waiting_with_a_timeout_on_a_recv_nobody_sends_raises_in_about_that_time_like_gloo(
    tmp_path: Path,
) -> None:
    # Compared: that both raise (an Exception; gloo's is a RuntimeError, the types may differ)
    # and both within about WAIT_TIMEOUT_S. Not compared: the group afterwards (gloo's is broken).
    for backend, role in (("gloo", "reference"), (BACKEND, "tested")):
        result = _wait_timeout(tmp_path, backend, role)
        assert result["raised"], (backend, result)
        assert 0.9 * WAIT_TIMEOUT_S <= result["elapsed"] <= WAIT_TIMEOUT_S + 5.0, (backend, result)


SCENARIOS: dict[str, Scenario] = {
    "tags": _tags,
    "dtypes": _dtypes,
    "ring": _ring,
    "any_source": _any_source,
    "object_lists": _object_lists,
}
