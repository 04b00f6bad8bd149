"""A job's chunk size, chosen when its world is complete (`--chunk-mib 0`, the default).

Every worker of a job must cut its keys at the same offsets (the reduction table counts chunks by
them), so the size is decided once per job, before any Join returns, from what the coordinator
knows of its members: where each one's Join came from and whether it said it will send through
shared memory. When every member reached it over loopback (or a Unix socket) they are all on this
host, where each chunk costs a control message each way and a reduction call, so chunks are
large: largest when every member uses shared memory (no payload in any message, averages written
in place, nothing to pipeline), smaller over loopback gRPC (whose messages carry the bytes and
pipeline). When any member is remote, small chunks keep both directions of its link busy
(docs/PERFORMANCE.md, "Across machines"). Partitioned coordinators cannot see each other's
members without more protocol, so their size is fixed before anyone joins
(`CoordinatorConfig.fixed_chunk_bytes`). Pure: no I/O.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from gradserver.common.config import MIB
from gradserver.common.security import is_loopback

from .config import LOCAL_CHUNK_MIB, REMOTE_CHUNK_MIB, CoordinatorConfig


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


def choose_chunk(
    config: CoordinatorConfig, hosts: Sequence[str], *, shared_memory: bool = False
) -> ChunkChoice:
    """The chunk size of a job whose members came from `hosts` (one per member); `shared_memory`:
    every member said at Join it sends through shared memory, and this coordinator offers it."""
    fixed = config.fixed_chunk_bytes
    if fixed is not None:
        why = "--chunk-mib" if not config.chunk_auto else "partitioned coordinators (--partition-map)"
        return ChunkChoice(fixed, why)
    remote = sorted({h for h in hosts if not is_local_peer(h)})
    if remote:
        shown = ", ".join(remote[:3]) + (f" and {len(remote) - 3} more" if len(remote) > 3 else "")
        return ChunkChoice(int(REMOTE_CHUNK_MIB * MIB), f"workers on other hosts ({shown})")
    if shared_memory:
        return ChunkChoice(
            config.shm_chunk_bytes, "every worker reached it over loopback and sends through shared memory"
        )
    return ChunkChoice(int(LOCAL_CHUNK_MIB * MIB), "every worker reached it over loopback (this host)")
