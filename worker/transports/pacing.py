"""`Pacer`: how many chunks to be reduced one stream may have on the way without their answers.

A coordinator averages a chunk only once every worker's copy is in, so without pacing a worker
whose TCP flow runs ahead on a shared link fills the queues with chunks that cannot be averaged
yet while the averages' direction idles; with it every worker's flow moves at the pace of the
averages, and the links' queues stay short, so a step ends soon after its last chunk is sent
(docs/PERFORMANCE.md, "Across machines: pacing"). Only keys answered chunk for chunk (gradients,
REDUCE collectives) are paced; the other collective kinds are answered in pieces of their own.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from gradserver.common.messages import TensorKey

# Chunks to be reduced a worker may have on one stream without their answers. Four keep a remote
# link busy across the pipeline (bench.cluster: 2 left the partitions on their own hosts short of
# data, 8 let the links' queues and the skew between workers grow); how long a sender waits with
# no answer at all before it sends anyway.
WINDOW_CHUNKS = 4
PATIENCE_S = 0.25


class Pacer:
    """One stream's window of unanswered elements (0: unpaced), under the link's condition."""

    def __init__(
        self, cond: threading.Condition, chunk_elements: int, window_chunks: int = WINDOW_CHUNKS
    ) -> None:
        self._cond = cond
        self._chunk = chunk_elements
        self._full_window = window_chunks * chunk_elements
        self.window = self._full_window
        self._unanswered: dict[TensorKey, int] = {}
        self._answers = 0
        self._unpaced_at = -1

    def share_with(self, members: int) -> None:
        """This stream is one of `members` that share one host's link and send a share each (a
        host group's): the window is shared too, so the host keeps as many chunks unanswered
        as one stream would (2 hosts x 4 ranks, 200 Mbit/s: 0.68x gloo's time with a window
        each, 0.60x with the window shared)."""
        if self._full_window:
            self.window = max(self._chunk, self._full_window // max(1, members) // self._chunk * self._chunk)

    def pace(self, key: TensorKey, elements: int, broken: Callable[[], bool]) -> None:
        """Waits while a window of chunks is unanswered, so every worker's share of a shared
        link stays even and the links' queues stay short; gives up waiting (until the next
        answer) when no answer came for a while, so workers sending keys in different orders
        never wait on each other, or when `broken()` says the stream broke."""
        if not self.window:
            return
        with self._cond:
            seen = self._answers
            if self._unpaced_at != seen:
                patience_ends = time.monotonic() + PATIENCE_S
                while self.unanswered_elements() >= self.window and not broken():
                    now = time.monotonic()
                    if self._answers != seen:
                        seen, patience_ends = self._answers, now + PATIENCE_S
                    if now >= patience_ends:
                        self._unpaced_at = seen
                        break
                    self._cond.wait(patience_ends - now)
            self._unanswered[key] = self._unanswered.get(key, 0) + elements

    def unanswered_elements(self) -> int:
        """Elements of paced chunks on this stream still without their answers (a few keys in
        flight at most)."""
        with self._cond:  # reentrant: `pace` asks with it held
            return sum(self._unanswered.values())

    def answered(self, key: TensorKey, elements: int | None) -> bool:
        """`elements` of `key`'s chunks were answered (None: all of them); whether `key` was
        paced here. Lock held."""
        held = self._unanswered.get(key)
        if held is None:
            return False
        done = held if elements is None else min(held, elements)
        if done == held:
            del self._unanswered[key]
        else:
            self._unanswered[key] = held - done
        self._answers += 1
        return True
