"""What becomes of a chunk that every expected worker's part completed: averaged here at once, or
queued as a `Reduce` request that the coordinator's `Reducer` (server/reducer.py) averages off
the event loop and hands back through `ReductionTable.reduced`; and the step failure an averaging
error is (a sum beyond its dtype, a non-finite value where none is allowed).
"""

from __future__ import annotations

from gradserver.common.averaging import Averager, NonFiniteContribution, SumOverflow
from gradserver.common.errors import Status
from gradserver.common.messages import ReduceOp

from .slots import Data, Reduce
from .step_ledger import StepFailure

AveragingError = SumOverflow | NonFiniteContribution
Result = tuple[Data | None, AveragingError | None]


class ChunkAverages:
    """The table's complete chunks: averaged at once, or (`defer`) queued for `take`."""

    def __init__(self, averager: Averager, *, defer: bool) -> None:
        self._averager = averager
        self._defer = defer
        self._queued: list[Reduce] = []

    def submit(self, request: Reduce) -> Result | None:
        """The average of `request` (or why it has none); None when it was queued."""
        if self._defer:
            self._queued.append(request)
            return None
        # A reduce-scatter's chunks are copied into its result, never sent as they are: no
        # output buffer (the shared-memory arena) is worth taking for them.
        average = self._averager.average if request.scattered else self._averager.reduce
        try:
            averaged = average(
                request.data,
                divide=request.divide,
                dtype=request.dtype,
                finite_only=request.finite_only,
                count=request.count,
            )
        except (SumOverflow, NonFiniteContribution) as exc:
            return None, exc
        return averaged, None

    def take(self) -> list[Reduce]:
        """The requests queued since the last call."""
        taken, self._queued = self._queued, []
        return taken


def averaging_failure(request: Reduce, error: AveragingError, chunk_elements: int) -> StepFailure:
    """The failure of `request`'s step that `error` is, naming the element (and for a
    non-finite value the worker that sent it: a partial sum's sender)."""
    key = request.key
    element = request.index * chunk_elements + error.element
    if isinstance(error, SumOverflow):
        what = "sum" if key.op is ReduceOp.SUM else "average"
        message = (
            f"the {what} of {key} overflows {error.dtype.name.lower()} at element {element}; "
            "the step is halted"
        )
        return StepFailure(Status.ABORTED, message, None, Status.ABORTED)
    culprit = (request.senders or request.contributors)[error.position]
    message = f"worker {culprit} sent {error.what} in {key} at element {element}; the step is halted"
    return StepFailure(Status.ABORTED, message, culprit, Status.INVALID_ARGUMENT)
