"""In-flight bytes: what each worker's contributions held by the reduction table cost this process.

The streams hold a worker back while its count is over the in-flight budget (server/streams.py
reads `InFlightBytes.of` through the table's `buffered_bytes`). This module is the one account of
those bytes: every pending key charges what it holds through its own `Charges` and gives it back
through them, so the counts balance however a key ends (averaged, routed on, dropped with a lost
worker, failed with its step). A chunk lent from its sender's shared memory is charged 0: holding
it costs this process nothing, and counting it would hold back for good a worker whose keys come
in another order than the others'.
"""

from __future__ import annotations


class InFlightBytes:
    """Per worker, the bytes of its contributions held while waiting for other workers."""

    def __init__(self, world_size: int) -> None:
        self._per_worker = [0] * world_size

    def of(self, worker: int) -> int:
        return self._per_worker[worker]

    def charges(self) -> Charges:
        """A fresh record of what one pending key charges, against this account."""
        return Charges(self._per_worker)


class Charges:
    """What one pending key charged each worker: per chunk index it holds (or hands out to be
    averaged), and outside any chunk what a router holds of each worker (`follow`)."""

    def __init__(self, account: list[int]) -> None:
        self._account = account
        self._by_chunk: dict[int, list[int]] = {}
        self._followed = [0] * len(account)

    def hold(self, index: int, worker: int, nbytes: int) -> None:
        """`worker`'s part of chunk `index` is held here and costs `nbytes`."""
        charged = self._by_chunk.setdefault(index, [0] * len(self._account))
        self._account[worker] += nbytes - charged[worker]
        charged[worker] = nbytes

    def follow(self, worker: int, held: int) -> None:
        """A router now holds `held` bytes of `worker`'s contribution (it frees them piece by piece)."""
        self._account[worker] += held - self._followed[worker]
        self._followed[worker] = held

    def release_chunk(self, index: int) -> None:
        """Chunk `index` was averaged and sent: nothing of it is held any more."""
        for worker, nbytes in enumerate(self._by_chunk.pop(index, ())):
            self._account[worker] -= nbytes

    def release_worker(self, worker: int) -> None:
        """`worker`'s parts were dropped (the key completes without it)."""
        for charged in self._by_chunk.values():
            self._account[worker] -= charged[worker]
            charged[worker] = 0
        self.follow(worker, 0)

    def release_all(self) -> None:
        """The key is dropped (its step failed)."""
        for index in list(self._by_chunk):
            self.release_chunk(index)
        for worker in range(len(self._account)):
            self.follow(worker, 0)
