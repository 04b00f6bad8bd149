"""The machine under a one-host figure: what it can do, and the floor that sets for an operation.

    python -m bench.machine                  # a table; about 3-10 s
    python -m bench.machine --json           # the same as one JSON record
    python -m bench.machine --quick          # small sizes, a second or two (tests; figures rough)

One-host speed depends on the machine (the same exchange ran at 0.3x gloo on one 2-vCPU machine
and at parity on another), so a one-host figure means little without the machine's own limits
beside it. `measure()` (what the other benches call with `--machine-floor`) finds:

- the cores this process may run on (`os.sched_getaffinity`), a cgroup CPU quota if one is set,
  the CPU model (/proc/cpuinfo) and the L3 size (/sys), and the 1-minute load average at the start
  (a loaded machine gives slower, noisier figures);
- copy bandwidth, always **bytes copied / time**: a copy of B bytes counts B (it reads B and
  writes B, so the memory traffic is 2B). From memory: numpy copies of one buffer into another
  (256 MiB each by default, far beyond any L3), each timed in 8 MiB parts, the median part (a
  loaded machine preempts most copies of hundreds of MiB, few of 8 MiB). The same buffers split
  over one thread per available core copying at once (median of whole copies: how much more
  memory gives to every core than to one). In cache: copies between two buffers that fit in half
  the L3 together (median of many);
- wake round trips between two processes, on the primitives the one-host paths use: the
  collective lane, the peer rings and the host arena wake a process with a futex on a 32-bit
  word of shared memory (`gradserver.common.futex.futex_wait` / `futex_wake`), after a short spin
  on the same word when every process has a core (`spin_for`). Both are measured as a ping-pong
  of two processes over a shared mapping (median round trip), the spin with no futex at all. On
  a loaded machine the spin's median is a scheduler time slice (milliseconds) whenever the two
  processes seldom run at once: that is what spinning costs there;
- a loopback TCP round trip of a small message (the plain API's control messages and every
  cross-process gRPC call ride on it) and a loopback gRPC unary round trip (grpcio, a server in
  this process on 127.0.0.1:0): what one control message to the coordinator costs at least.

The floor of an operation is the time the memory traffic its design must make takes at the
measured copy bandwidth, plus, for small collectives, the wakes it must wait for. Traffic is
counted in bytes read and bytes written (`Traffic`); `Traffic.copied` turns it into copy
equivalents, (read + written) / 2, so that `floor_s(traffic.copied, machine)` = bytes moved /
copy bandwidth measures both in the same unit (a copy of B bytes: read B + written B = B copied).

The models (S: bytes per worker or rank, N: workers or ranks):

- `exchange_traffic`: one step of `bench.exchange` over shared memory (docs/PERFORMANCE.md,
  "One host: averages written over the workers' own memory").
  Plain API: each worker copies its S into its arena (read S, write S), and the coordinator
  averages every chunk in place, reading the N inputs and writing the average over each of the
  N contributors' ranges: read 2NS, written 2NS. Tuned with `--zero-copy` (the gradients already
  live in the arena): the coordinator's pass only, read NS, written NS. Tuned without it
  (`into=` arrays outside the arena): copy into a staging slot (read NS, written NS), average
  into an output slot (read NS, written S), each worker copies its average out (read NS,
  written NS): read 3NS, written (2N + 1)S. The coordinator's sum is kept in a cache-sized
  float64 buffer, which costs no memory traffic. At N = 2 these are the ~8, ~4 and ~11 passes
  over S that docs/PERFORMANCE.md counts.
- `all_reduce_traffic`: an `all_reduce` of S bytes over the collective lane. A reduction with
  S * N <= `PEER_REDUCE_MAX_BYTES` is a peer operation: each rank copies its input into its
  input slot (read S, written S) and reduces all N input slots into its result (read NS,
  written S): read NS + N^2 S, written 2NS. A larger one goes through the coordinator: copy in
  (read NS, written NS), the coordinator reduces the N slots into an output slot (read NS,
  written S), each rank copies the output out (read NS, written NS): read 3NS, written (2N + 1)S.
- `all_reduce_wakes`: the one-way wakes on an all_reduce's critical path: 1 for a peer operation
  (the last rank to post wakes the others), 2 through the coordinator (a bell to the coordinator,
  then `done` to the ranks). One wake costs half a measured round trip: when the processes the
  round needs (N, or N + 1 with the coordinator) each have a core the lane spins before it
  sleeps, so the shorter of the spin's and the futex's; the futex's otherwise. For a 4-byte
  all_reduce the bytes are nothing and the floor is this wake.

Passes whose footprint (the distinct bytes they touch, `Traffic.footprint`) fits in half the L3
are timed at the in-cache copy bandwidth, others at the one from memory (`traffic_floor_s`).
`all_reduce_floor_s` adds the copies and the wakes (within one round they do not overlap).

What a floor is not: a bound no run can beat. The passes are counted as one thread would make
them one after another, but different processes make them, some at once, so a design can go
below its floor: from memory by up to `copy_all_cores_gbps / copy_gbps`, in cache by up to the
number of cores. It is the scale of the machine for that shape, so that time / floor compares
across machines where time / gloo does not. Not modelled: the exchange's gRPC control messages
(pipelined with its copies), the exchange over gRPC, and the collectives of `bench.collectives`
other than all_reduce.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import mmap
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent import futures
from pathlib import Path
from typing import Any

import numpy as np

# The lane's rule for peer operations; the models follow the design they describe.
from gradserver.common.cores import affinity_cores, cpu_quota_cores
from gradserver.common.lane import PEER_REDUCE_MAX_BYTES

_ROOT = Path(__file__).resolve().parent.parent
_STOP = 0xFFFFFFFF
# Word indices (32-bit) in the ping-pong mapping: each pair on its own cache lines, so the
# futex phase's stores never share a line with the spin phase's.
_FUTEX_PING, _FUTEX_PONG = 0, 16
_SPIN_PING, _SPIN_PONG = 32, 48
_MESSAGE = b"x" * 64
_COPY_PIECE_BYTES = 8 * 2**20
_ROUND_LIMIT_S = 5.0  # one round trip that takes longer means the peer is gone
_PEER_LIMIT_S = 120.0  # the peer's own bound on silence, should the parent die without saying so


@dataclasses.dataclass(frozen=True)
class Machine:
    """What `measure` found. Times in seconds, bandwidths in GB/s (1e9 bytes copied per second):
    `copy_gbps` between buffers of `copy_bytes` each, far larger than any cache;
    `copy_cached_gbps` between buffers of `copy_cached_bytes`, which fit in the L3 together."""

    cores: int
    cpu_quota_cores: float | None
    cpu_model: str
    l3_bytes: int | None
    load_average: float
    copy_bytes: int
    copy_gbps: float
    copy_all_cores_gbps: float
    copy_cached_bytes: int
    copy_cached_gbps: float
    futex_rtt_s: float | None
    spin_rtt_s: float | None
    tcp_rtt_s: float
    grpc_rtt_s: float
    measured_s: float
    # The one-way wake common.futex measures in-process and the spin it sizes from it (None: no
    # futexes here).
    wake_s: float | None = None
    spin_s: float | None = None


@dataclasses.dataclass(frozen=True)
class Traffic:
    """Memory traffic of an operation: bytes read and bytes written by all processes together,
    and its footprint, the distinct bytes those passes touch (whether they can stay in cache)."""

    read: int
    written: int
    footprint: int

    @property
    def copied(self) -> float:
        """In copy equivalents, the unit of copy bandwidth: a copy of B bytes reads B and writes B."""
        return (self.read + self.written) / 2


# --- the floor model -----------------------------------------------------------------------------


def floor_s(bytes_moved: float, machine: Machine, *, cached: bool = False) -> float:
    """Seconds to move `bytes_moved` (copy equivalents, `Traffic.copied`) at one thread's copy
    bandwidth: from memory, or (`cached`) within the L3."""
    gbps = machine.copy_cached_gbps if cached else machine.copy_gbps
    return bytes_moved / (gbps * 1e9)


def fits_in_cache(footprint: int, machine: Machine) -> bool:
    """Whether passes over `footprint` distinct bytes can run at cache speed: within half the L3
    (the other half for everything else the processes touch). Unknown L3: no."""
    return machine.l3_bytes is not None and footprint <= machine.l3_bytes // 2


def traffic_floor_s(traffic: Traffic, machine: Machine) -> float:
    return floor_s(traffic.copied, machine, cached=fits_in_cache(traffic.footprint, machine))


def exchange_traffic(set_bytes: int, workers: int, api: str = "plain", zero_copy: bool = False) -> Traffic:
    """One shared-memory step of `bench.exchange`: N workers averaging S bytes each (module
    docstring)."""
    s, n = set_bytes, workers
    if api == "plain":
        # The workers' gradients and their results in the arenas.
        return Traffic(read=2 * n * s, written=2 * n * s, footprint=2 * n * s)
    if api != "tuned":
        raise ValueError(f"unknown API {api!r}: plain or tuned")
    if zero_copy:
        return Traffic(read=n * s, written=n * s, footprint=n * s)
    # The gradients, the staging slots and the output slots, at most.
    return Traffic(read=3 * n * s, written=(2 * n + 1) * s, footprint=(2 * n + 1) * s)


def exchange_floor_s(
    set_bytes: int, workers: int, machine: Machine, api: str = "plain", zero_copy: bool = False
) -> float:
    return traffic_floor_s(exchange_traffic(set_bytes, workers, api, zero_copy), machine)


def all_reduce_peer(nbytes: int, ranks: int) -> bool:
    """Whether the lane runs this all_reduce as a peer operation (every rank reduces it)."""
    return nbytes * ranks <= PEER_REDUCE_MAX_BYTES


def all_reduce_traffic(nbytes: int, ranks: int) -> Traffic:
    """An all_reduce of S bytes per rank at N ranks over the collective lane (module docstring)."""
    s, n = nbytes, ranks
    if all_reduce_peer(nbytes, ranks):
        # The ranks' tensors and their input slots.
        return Traffic(read=n * s + n * n * s, written=2 * n * s, footprint=2 * n * s)
    # The tensors, the input slots and the output slot.
    return Traffic(read=3 * n * s, written=(2 * n + 1) * s, footprint=(2 * n + 1) * s)


def all_reduce_wakes(nbytes: int, ranks: int) -> int:
    """One-way wakes on the critical path: the last post to the others (peer), or a bell to the
    coordinator and its `done` back."""
    return 1 if all_reduce_peer(nbytes, ranks) else 2


def one_way_wake_s(processes: int, machine: Machine) -> float:
    """Half a round trip of the wake the lane uses when `processes` must run. When each has a
    core the lane spins briefly and then sleeps on a futex (`spin_for`), so whichever of the two
    round trips is shorter; a futex alone otherwise."""
    futex, spin = machine.futex_rtt_s, machine.spin_rtt_s
    if futex is None:  # no futexes here: the lane is not offered, so nothing to wake with
        return math.nan
    if spin is not None and machine.cores >= processes:
        return min(futex, spin) / 2
    return futex / 2


def all_reduce_floor_s(nbytes: int, ranks: int, machine: Machine) -> float:
    """The copies (`all_reduce_traffic`) and then the wakes (`all_reduce_wakes`)."""
    peer = all_reduce_peer(nbytes, ranks)
    wake = one_way_wake_s(ranks if peer else ranks + 1, machine)
    copies = traffic_floor_s(all_reduce_traffic(nbytes, ranks), machine)
    return copies + all_reduce_wakes(nbytes, ranks) * wake


# --- what the machine is -------------------------------------------------------------------------


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            name, _, value = line.partition(":")
            if name.strip() == "model name":
                return value.strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine() or "unknown"


def _size_bytes(text: str) -> int:
    text = text.strip().upper()
    for suffix, scale in (("K", 1024), ("M", 1024**2), ("G", 1024**3)):
        if text.endswith(suffix):
            return int(text[:-1]) * scale
    return int(text)


def _l3_bytes() -> int | None:
    for index in sorted(Path("/sys/devices/system/cpu/cpu0/cache").glob("index*")):
        try:
            if (index / "level").read_text().strip() == "3":
                return _size_bytes((index / "size").read_text())
        except (OSError, ValueError):
            continue
    return None


# --- bandwidth -----------------------------------------------------------------------------------


def _copy_gbps(source: np.ndarray, target: np.ndarray, repeats: int, pieces: int = 1) -> float:
    """`repeats` copies of the whole buffer, each timed in `pieces` consecutive parts: the median
    part. On a loaded machine a whole copy of hundreds of MiB is preempted more often than not,
    a part of a few MiB seldom; the parts are still read from memory, as the previous touch of
    each was a whole pass over both buffers earlier."""
    piece = source.nbytes // pieces
    times = []
    for _ in range(repeats):
        for start in range(0, piece * pieces, piece):
            began = time.perf_counter()
            np.copyto(target[start : start + piece], source[start : start + piece])
            times.append(time.perf_counter() - began)
    return piece / statistics.median(times) / 1e9


def _cached_copy_bytes(l3: int | None) -> int:
    """A buffer size for cache-resident copies: a quarter of the L3 (source and target together
    half of it), between 64 KiB and 8 MiB; 1 MiB when the L3 is not known."""
    if l3 is None:
        return 2**20
    return min(max(l3 // 4, 64 * 1024), 8 * 2**20)


def _copy_all_cores_gbps(source: np.ndarray, target: np.ndarray, threads: int, repeats: int) -> float:
    """Every thread copies its own part at once (numpy lets go of the GIL while it copies);
    the time is from the common start to the last thread's end."""
    part = source.nbytes // threads
    ready = threading.Barrier(threads + 1)
    ended: list[float] = []
    lock = threading.Lock()

    def copy(i: int) -> None:
        ready.wait()
        np.copyto(target[i * part : (i + 1) * part], source[i * part : (i + 1) * part])
        with lock:
            ended.append(time.perf_counter())

    times = []
    for _ in range(repeats):
        ended.clear()
        workers = [threading.Thread(target=copy, args=(i,)) for i in range(threads)]
        for worker in workers:
            worker.start()
        ready.wait()
        started = time.perf_counter()
        for worker in workers:
            worker.join()
        times.append(max(ended) - started)
    return part * threads / statistics.median(times) / 1e9


# --- round trips ---------------------------------------------------------------------------------


class _Words:
    """32-bit words of a shared mapping, read and written as the lane does (a numpy view)."""

    def __init__(self, mapping: mmap.mmap) -> None:
        self.words = np.frombuffer(mapping, dtype=np.uint32)
        self.base = int(self.words.__array_interface__["data"][0])

    def address(self, index: int) -> int:
        return self.base + 4 * index


def _ping_pong(
    words: _Words,
    ping: int,
    pong: int,
    rounds: int,
    budget_s: float,
    futex: bool,
    peer: subprocess.Popen[bytes],
) -> list[float]:
    """Round trips of the parent's side, then the stop that ends the peer's phase."""
    from gradserver.common.futex import futex_wait, futex_wake

    w = words.words
    times: list[float] = []
    phase_end = time.monotonic() + budget_s
    value = 0
    while True:
        value = _STOP if len(times) >= rounds or time.monotonic() > phase_end else value + 1
        started = time.perf_counter()
        w[ping] = value
        if futex:
            futex_wake(words.address(ping))
        give_up = time.monotonic() + _ROUND_LIMIT_S
        looks = 0
        while (seen := int(w[pong])) != value:
            if futex:
                futex_wait(words.address(pong), seen, 0.05)
            looks += 1
            # Only a slow answer is checked: a syscall in every round would be timed with it.
            if looks % 4096 == 0 or (futex and looks > 1):
                if peer.poll() is not None:
                    raise RuntimeError(f"the ping-pong peer ended ({peer.returncode})")
                if time.monotonic() > give_up:
                    raise RuntimeError(f"no answer to a ping within {_ROUND_LIMIT_S} s")
        if value == _STOP:
            return times
        times.append(time.perf_counter() - started)


def _peer_phase(words: _Words, ping: int, pong: int, futex: bool) -> None:
    """Echoes every new ping until the stop; gives up after `_PEER_LIMIT_S` without one."""
    from gradserver.common.futex import futex_wait, futex_wake

    w = words.words
    seen = 0
    looks = 0
    deadline = time.monotonic() + _PEER_LIMIT_S
    while True:
        value = int(w[ping])
        if value == seen:
            looks += 1
            if futex:
                futex_wait(words.address(ping), value, 0.05)
            if (futex or looks % 4096 == 0) and time.monotonic() > deadline:
                raise SystemExit("bench.machine peer: the parent stopped answering")
            continue
        seen = value
        w[pong] = value
        if futex:
            futex_wake(words.address(pong))
        if value == _STOP:
            return
        deadline = time.monotonic() + _PEER_LIMIT_S  # after the answer, so not timed with it


def _peer(path: str, port: int, futexes: bool) -> None:
    """The other process of the round trips: echoes the futex words, the spin words, then TCP."""
    with open(path, "r+b") as f:
        mapping = mmap.mmap(f.fileno(), mmap.PAGESIZE)
    words = _Words(mapping)
    with socket.create_connection(("127.0.0.1", port), timeout=_PEER_LIMIT_S) as conn:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if futexes:
            _peer_phase(words, _FUTEX_PING, _FUTEX_PONG, True)
        _peer_phase(words, _SPIN_PING, _SPIN_PONG, False)
        while message := conn.recv(65536):
            conn.sendall(message)


def _recv_exactly(conn: socket.socket, count: int) -> None:
    got = 0
    while got < count:
        chunk = conn.recv(count - got)
        if not chunk:
            raise RuntimeError("the TCP peer closed the connection")
        got += len(chunk)


def _tcp_round_trips(conn: socket.socket, rounds: int, budget_s: float) -> list[float]:
    times: list[float] = []
    end = time.monotonic() + budget_s
    while len(times) < rounds and time.monotonic() < end:
        started = time.perf_counter()
        conn.sendall(_MESSAGE)
        _recv_exactly(conn, len(_MESSAGE))
        times.append(time.perf_counter() - started)
    return times


def _process_round_trips(rounds: int, budget_s: float, futexes: bool) -> tuple[float | None, float, float]:
    """Median futex, spin and TCP round trips against a peer process."""
    with tempfile.NamedTemporaryFile(prefix="gradserver-machine-", dir=_shm_dir()) as f:
        f.truncate(mmap.PAGESIZE)
        mapping = mmap.mmap(f.fileno(), mmap.PAGESIZE)
        words = _Words(mapping)
        with socket.socket() as listener:
            listener.bind(("127.0.0.1", 0))
            listener.listen(1)
            listener.settimeout(0.2)
            command = [sys.executable, "-m", "bench.machine", "--role", "peer", "--shm", f.name]
            command += ["--port", str(listener.getsockname()[1])]
            if not futexes:
                command.append("--no-futex")
            peer = subprocess.Popen(command, cwd=_ROOT, stderr=subprocess.PIPE)
            try:
                conn = _accept(listener, peer)
                with conn:
                    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                    conn.settimeout(_ROUND_LIMIT_S)
                    futex = (
                        _ping_pong(words, _FUTEX_PING, _FUTEX_PONG, rounds, budget_s, True, peer)
                        if futexes
                        else []
                    )
                    spin = _ping_pong(words, _SPIN_PING, _SPIN_PONG, rounds, budget_s, False, peer)
                    tcp = _tcp_round_trips(conn, rounds, budget_s)
                peer.wait(30)
            except BaseException:
                peer.kill()
                _, err = peer.communicate(timeout=30)
                sys.stderr.write(err.decode(errors="replace")[-2000:])
                raise
            finally:
                del words
                # A failure's traceback may still hold a view of the words; the mapping then
                # closes when that goes, and the failure is what should be seen.
                with contextlib.suppress(BufferError):
                    mapping.close()
        if peer.returncode != 0:
            raise RuntimeError(f"the ping-pong peer failed ({peer.returncode})")
    return (statistics.median(futex) if futex else None), statistics.median(spin), statistics.median(tcp)


def _accept(listener: socket.socket, peer: subprocess.Popen[bytes]) -> socket.socket:
    """The peer's connection, once it has started (imports take a while on a loaded machine);
    an error at once if it ended first."""
    give_up = time.monotonic() + 60.0
    while True:
        try:
            return listener.accept()[0]
        except TimeoutError:
            if peer.poll() is not None:
                raise RuntimeError(
                    f"the ping-pong peer ended before it connected ({peer.returncode})"
                ) from None
            if time.monotonic() > give_up:
                raise RuntimeError("the ping-pong peer did not connect within 60 s") from None


def _shm_dir() -> str | None:
    """Shared memory's own file system where there is one, so the mapping never touches a disk."""
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None


def _grpc_round_trip(rounds: int, budget_s: float) -> float:
    """Median unary round trip of a small message to a grpcio server in this process."""
    import grpc

    def echo(request: bytes, _context: Any) -> bytes:
        return request

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=1))
    handlers = {"Echo": grpc.unary_unary_rpc_method_handler(echo)}
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("machine", handlers),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = channel.unary_unary("/machine/Echo")
            for _ in range(10):  # the connection and its first calls
                call(_MESSAGE, timeout=30)
            times: list[float] = []
            end = time.monotonic() + budget_s
            while len(times) < rounds and time.monotonic() < end:
                started = time.perf_counter()
                call(_MESSAGE, timeout=_ROUND_LIMIT_S)
                times.append(time.perf_counter() - started)
    finally:
        server.stop(None)
    return statistics.median(times)


# --- measure -------------------------------------------------------------------------------------


def measure(copy_mib: float = 256.0, repeats: int = 5, rounds: int = 2000, phase_s: float = 1.0) -> Machine:
    """Measures this machine: copies of `copy_mib` MiB (median of `repeats`), and each round trip
    as the median of up to `rounds` round trips within `phase_s` seconds."""
    from gradserver.common.lane import supported

    started = time.monotonic()
    load = os.getloadavg()[0]
    cores = affinity_cores()
    size = max(int(copy_mib * 2**20) // (64 * cores) * (64 * cores), 64 * cores)
    # Written once before timing, so that page faults are not counted as copying.
    source = np.ones(size, np.uint8)
    target = np.zeros(size, np.uint8)
    np.copyto(target, source)
    one = _copy_gbps(source, target, repeats, pieces=max(size // _COPY_PIECE_BYTES, 1))
    every = _copy_all_cores_gbps(source, target, cores, repeats) if cores > 1 else one
    del source, target
    l3 = _l3_bytes()
    cached_size = _cached_copy_bytes(l3)
    source, target = np.ones(cached_size, np.uint8), np.zeros(cached_size, np.uint8)
    np.copyto(target, source)
    # Each copy is short (a fraction of a millisecond), so many more of them for a steady median.
    cached = _copy_gbps(source, target, 20 * repeats)
    del source, target
    futex, spin, tcp = _process_round_trips(rounds, phase_s, futexes=supported())
    grpc_rtt = _grpc_round_trip(rounds, phase_s)
    wake = spin_budget = None
    if supported():
        from gradserver.common.futex import spin_for, wake_latency_s

        wake, spin_budget = wake_latency_s(), spin_for(1).budget_s
    return Machine(
        cores=cores,
        cpu_quota_cores=cpu_quota_cores(),
        cpu_model=_cpu_model(),
        l3_bytes=l3,
        load_average=load,
        copy_bytes=size,
        copy_gbps=one,
        copy_all_cores_gbps=every,
        copy_cached_bytes=cached_size,
        copy_cached_gbps=cached,
        futex_rtt_s=futex,
        spin_rtt_s=spin,
        tcp_rtt_s=tcp,
        grpc_rtt_s=grpc_rtt,
        measured_s=time.monotonic() - started,
        wake_s=wake,
        spin_s=spin_budget,
    )


# bench.collectives' DEFAULT_SIZES, not imported from there: that module imports torch.
COLLECTIVE_SIZES = (4, 256 * 1024, 1024 * 1024, 16 * 1024 * 1024)


# --- output --------------------------------------------------------------------------------------


def _us(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e6:.1f} µs"


def _time(seconds: float) -> str:
    return f"{seconds * 1e3:.3f} ms" if seconds >= 1e-3 else f"{seconds * 1e6:.1f} µs"


def table(machine: Machine) -> str:
    """The machine as a markdown table."""
    quota = f", quota {machine.cpu_quota_cores:g}" if machine.cpu_quota_cores is not None else ""
    l3 = f"{machine.l3_bytes / 2**20:g} MiB" if machine.l3_bytes else "-"
    rows = [
        ("cores available (sched_getaffinity)", f"{machine.cores}{quota}"),
        ("CPU", machine.cpu_model),
        ("L3", l3),
        ("load average (1 min) before", f"{machine.load_average:.2f}"),
        (
            f"copy bandwidth, 1 thread ({machine.copy_bytes / 2**20:g} MiB; bytes copied / s)",
            f"{machine.copy_gbps:.2f} GB/s",
        ),
        (f"copy bandwidth, {machine.cores} threads at once", f"{machine.copy_all_cores_gbps:.2f} GB/s"),
        (
            f"copy bandwidth in cache, 1 thread ({machine.copy_cached_bytes / 2**20:g} MiB)",
            f"{machine.copy_cached_gbps:.2f} GB/s",
        ),
        ("futex wake round trip, 2 processes (common.futex)", _us(machine.futex_rtt_s)),
        ("spin round trip, 2 processes, shared word", _us(machine.spin_rtt_s)),
        ("one-way futex wake, 2 threads (common.futex.wake_latency_s)", _us(machine.wake_s)),
        ("spin before a futex sleep, each process a core (common.futex.spin_for)", _us(machine.spin_s)),
        (f"loopback TCP round trip, {len(_MESSAGE)} B", _us(machine.tcp_rtt_s)),
        (f"loopback gRPC unary round trip, {len(_MESSAGE)} B", _us(machine.grpc_rtt_s)),
    ]
    lines = ["| measure | value |", "| --- | --- |"]
    lines += [f"| {name} | {value} |" for name, value in rows]
    return "\n".join(lines)


def _size_name(nbytes: int) -> str:
    for unit, scale in (("MiB", 2**20), ("KiB", 1024)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale} {unit}"
    return f"{nbytes} B"


def floors(machine: Machine, workers: tuple[int, ...] = (2, 4)) -> list[dict[str, Any]]:
    """The floors of the shapes docs/PERFORMANCE.md quotes, for this machine: bench.exchange's
    default set and bench.collectives' default sizes."""
    from bench import exchange

    set_bytes = 4 * exchange._elements(exchange.SLICE)
    rows: list[dict[str, Any]] = []

    def row(shape: str, n: int, traffic: Traffic, wakes: int, floor: float) -> None:
        rows.append(
            {
                "shape": shape,
                "n": n,
                "read": traffic.read,
                "written": traffic.written,
                "in_cache": fits_in_cache(traffic.footprint, machine),
                "wakes": wakes,
                "floor_s": floor,
            }
        )

    for n in workers:
        for api, zero_copy in (("plain", False), ("tuned", True)):
            shape = f"exchange {set_bytes / 2**20:.0f} MiB, {api}" + (" zero-copy" if zero_copy else "")
            traffic = exchange_traffic(set_bytes, n, api, zero_copy)
            row(shape, n, traffic, 0, exchange_floor_s(set_bytes, n, machine, api, zero_copy))
    for n in workers:
        for nbytes in COLLECTIVE_SIZES:
            traffic = all_reduce_traffic(nbytes, n)
            floor = all_reduce_floor_s(nbytes, n, machine)
            row(f"all_reduce {_size_name(nbytes)}", n, traffic, all_reduce_wakes(nbytes, n), floor)
    return rows


def floors_table(machine: Machine) -> str:
    lines = [
        "| shape | N | bytes read | bytes written | in cache | one-way wakes | floor |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in floors(machine):
        cells = [row["shape"], str(row["n"]), f"{row['read']:,}", f"{row['written']:,}"]
        cells += ["yes" if row["in_cache"] else "no", str(row["wakes"]), _time(row["floor_s"])]
        lines.append(f"| {' | '.join(cells)} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--json", action="store_true", help="print one JSON record instead of the tables")
    parser.add_argument("--quick", action="store_true", help="small sizes: 64 MiB copies, short phases")
    parser.add_argument("--copy-mib", type=float, default=None, help="copy buffer size (default 256)")
    parser.add_argument("--repeats", type=int, default=None, help="copies timed (median; default 5)")
    parser.add_argument("--rounds", type=int, default=None, help="round trips per kind, at most (2000)")
    parser.add_argument(
        "--phase-s", type=float, default=None, help="seconds per round-trip kind, at most (1)"
    )
    parser.add_argument("--role", default="measure", choices=["measure", "peer"], help=argparse.SUPPRESS)
    parser.add_argument("--shm", default="", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--no-futex", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role == "peer":
        _peer(args.shm, args.port, futexes=not args.no_futex)
        return 0
    quick = {"copy_mib": 64.0, "repeats": 3, "rounds": 300, "phase_s": 0.2}
    full = {"copy_mib": 256.0, "repeats": 5, "rounds": 2000, "phase_s": 1.0}
    base = quick if args.quick else full
    sizes = {name: base[name] if getattr(args, name) is None else getattr(args, name) for name in full}
    if min(sizes.values()) <= 0:
        parser.error("--copy-mib, --repeats, --rounds and --phase-s must be positive")
    machine = measure(
        float(sizes["copy_mib"]), int(sizes["repeats"]), int(sizes["rounds"]), float(sizes["phase_s"])
    )
    if args.json:
        print(json.dumps({**dataclasses.asdict(machine), "floors": floors(machine)}))
        return 0
    print(table(machine))
    print()
    print("Floors: bytes copied / one thread's copy bandwidth, plus wakes (`python -m bench.machine -h`)")
    print()
    print(floors_table(machine))
    return 0


if __name__ == "__main__":
    sys.exit(main())
