"""A job's chunk size, chosen when its world is complete (`--chunk-mib 0`, the default).

Every worker of a job must cut its keys at the same offsets (the reduction table counts chunks by
them), so the size is decided once per job, before any Join returns, from what the coordinator
knows of its members: where each one's Join came from and whether it said it will send through
shared memory. When every member reached it over loopback (or a Unix socket) they are all on this
host, where each chunk costs a control message each way and a reduction call, so chunks are
large: largest when every member uses shared memory (no payload in any message, averages written
in place, nothing to pipeline), smaller over loopback gRPC (whose messages carry the bytes and
pipeline). When any member is remote, chunks are what the slowest member's link carries in
about 10 ms, from the rate each measured just before joining (JoinRequest.link_bytes_per_s; a
16-bit wire's chunks hold twice the elements): small on slow links, to keep both directions busy
(a coordinator averages a chunk only once every copy arrived, then sends it whole), larger on
fast ones, where the work per chunk would otherwise cap the rate (docs/PERFORMANCE.md, "Across
machines: chunks sized from measured links"). Partitioned coordinators must cut keys alike:
partition 0 chooses for its members, and each worker brings that choice to the other partitions
in its Join (JoinRequest.job_chunk_bytes), which they adopt. Pure: no I/O.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from gradserver.common.config import MIB
from gradserver.common.security import is_loopback

from .config import (
    LOCAL_CHUNK_MIB,
    MAX_RATE_CHUNK_MIB,
    MIN_RATE_CHUNK_MIB,
    RATE_CHUNK_S,
    REMOTE_CHUNK_MIB,
    CoordinatorConfig,
)


@dataclasses.dataclass(frozen=True)
class ChunkChoice:
    """A job's chunk size in bytes and why (for the log)."""

    chunk_bytes: int
    why: str


def is_local_peer(host: str) -> bool:
    """Whether a member's host (`server.auth.peer_host`: 'ipv4:127.0.0.1', 'ipv6:[::1]', 'unix')
    is this host's loopback. A member in another network namespace reaches the coordinator over
    some other address, so it counts as remote, as it does for shared memory."""
    if host == "unix":
        return True
    _, sep, address = host.partition(":")
    address = (address if sep else host).strip("[]")
    if address.startswith("::ffff:"):  # an IPv4 client of a dual-stack socket
        address = address[len("::ffff:") :]
    return is_loopback(address)


def chunk_for_rate(bytes_per_s: int, item_size: int = 4, largest: int = int(MAX_RATE_CHUNK_MIB * MIB)) -> int:
    """The chunk (in float32 bytes, as chunk sizes are) for a link of `bytes_per_s` carrying
    elements of `item_size` bytes: on the wire, the largest power of two times MIN_RATE_CHUNK_MIB
    the link carries in about RATE_CHUNK_S (at least that floor: below it the work per message
    shows), so a 16-bit wire's chunk holds twice the elements; at most `largest`."""
    wire = int(MIN_RATE_CHUNK_MIB * MIB)
    while wire * 2 * 4 // item_size <= largest and wire * 2 <= bytes_per_s * RATE_CHUNK_S:
        wire *= 2
    return min(largest, wire * 4 // item_size)


def choose_chunk(
    config: CoordinatorConfig,
    hosts: Sequence[str],
    *,
    shared_memory: bool = False,
    link_rates: Sequence[int] = (),
    item_sizes: Sequence[int] = (),
    brought: Sequence[int] = (),
) -> ChunkChoice:
    """The chunk size of a job whose members came from `hosts` (one per member); `shared_memory`:
    every member said at Join it sends through shared memory, and this coordinator offers it;
    `link_rates`: each member's measured bytes per second (0 or missing: unknown), `item_sizes` its
    wire dtype's element size (missing: 4, float32); `brought`
    (partitions 1..K-1): the chunk size each member says partition 0 gave it."""
    fixed = config.fixed_chunk_bytes
    if fixed is not None:
        return ChunkChoice(fixed, "--chunk-mib")
    if config.partitions is not None and config.partition_index > 0:
        told = set(brought)
        if len(told) == 1 and 0 not in told:
            return ChunkChoice(told.pop(), "partition 0's choice, brought by every worker's Join")
        return ChunkChoice(
            int(REMOTE_CHUNK_MIB * MIB),
            "partitioned coordinators: the workers brought no single chunk size from partition 0 "
            f"({sorted(told)})",
        )
    rates = list(link_rates) + [0] * (len(hosts) - len(link_rates))
    sizes = list(item_sizes) + [4] * (len(hosts) - len(item_sizes))
    remote = sorted({(h, r, i) for h, r, i in zip(hosts, rates, sizes, strict=True) if not is_local_peer(h)})
    if remote:
        names = sorted({h for h, _, _ in remote})
        shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
        if all(r > 0 for _, r, _ in remote):
            largest = config.max_rate_chunk_bytes
            size, rate = min((chunk_for_rate(r, i, largest), r) for _, r, i in remote)
            return ChunkChoice(
                size,
                f"workers on other hosts ({shown}), the slowest link measured at {rate * 8 / 1e6:.0f} Mbit/s",
            )
        unmeasured = f"workers on other hosts ({shown}), links not measured"
        return ChunkChoice(int(REMOTE_CHUNK_MIB * MIB), unmeasured)
    if config.partitions is not None:
        return ChunkChoice(int(REMOTE_CHUNK_MIB * MIB), "partitioned coordinators, every worker on this host")
    if shared_memory:
        return ChunkChoice(
            config.shm_chunk_bytes, "every worker reached it over loopback and sends through shared memory"
        )
    return ChunkChoice(int(LOCAL_CHUNK_MIB * MIB), "every worker reached it over loopback (this host)")
