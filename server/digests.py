"""The vote on replicated state: which workers hold the state most of them hold (pure).

Workers that keep replicas of one model (data parallelism) send a digest of their weights and
optimizer state with a barrier (`Barrier.digest`) every few steps. Replicas that apply the same
averages from the same state stay bit-identical, so any difference means one diverged: a worker
resumed from a stale checkpoint, loaded another state, or computed differently. The barrier
releases the workers whose digest a strict majority of the arrivals holds; every other worker is
named with both digests and evicted, so it is never averaged with again. Without a strict majority
(two workers that differ, or a tie) no side can be trusted and the step fails for everyone.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Mapping


@dataclasses.dataclass(frozen=True)
class DigestVerdict:
    """`agreed`: the workers holding the majority's digest; `diverged`: every other worker and
    why; `undecided`: why no majority exists (then nobody is released)."""

    agreed: frozenset[int]
    diverged: dict[int, str]
    undecided: str | None = None


def vote(step: int, name: str, digests: Mapping[int, int]) -> DigestVerdict:
    """The verdict on the digests that arrived at barrier `name` of `step`, one per worker."""
    counts = collections.Counter(digests.values())
    ranked = counts.most_common()
    if not ranked:
        return DigestVerdict(frozenset(), {})
    value, count = ranked[0]
    if count * 2 <= len(digests):
        shown = ", ".join(f"worker {w} {d:#018x}" for w, d in sorted(digests.items()))
        return DigestVerdict(
            frozenset(),
            {},
            f"step {step} barrier {name!r}: the replicas differ and no majority holds one state "
            f"({shown}); nothing can be trusted to go on",
        )
    agreed = frozenset(w for w, d in digests.items() if d == value)
    holders = ", ".join(str(w) for w in sorted(agreed))
    diverged = {
        w: (
            f"its state at step {step} (digest {d:#018x}) differs from that of workers {holders} "
            f"({value:#018x}): its replica diverged and is not averaged with again"
        )
        for w, d in sorted(digests.items())
        if d != value
    }
    return DigestVerdict(agreed, diverged)
