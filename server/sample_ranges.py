"""Sample-range assignment: which samples each worker trains on at a step.

The coordinator answers a worker's SampleRangeRequest with `step_sample_ranges`
(gradserver.common.sample_ranges), the same deterministic split every worker could compute; the
first request fixes the job's data set size and batch size, and a worker that describes another
data set is refused.
"""

from __future__ import annotations

from gradserver.common.errors import GradServerError, Status
from gradserver.common.messages import ErrorOut, SampleRangeAssignmentOut, SampleRangeRequestIn
from gradserver.common.sample_ranges import step_sample_ranges

from .outgoing import Outgoing


class SampleRangeAssigner:
    """Answers sample-range requests for a job of `world_size` workers."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self._shape: tuple[int, int] | None = None

    def answer(self, request: SampleRangeRequestIn) -> list[Outgoing]:
        """The sender's sample ranges of the requested step, or an INVALID_ARGUMENT error to it."""
        w = request.worker_id
        shape = (request.dataset_size, request.batch_size)
        if self._shape is None:
            self._shape = shape
        try:
            if shape != self._shape:
                raise GradServerError(
                    f"worker {w} asked for the step {request.step} sample ranges of a data set of "
                    f"{shape[0]} samples with batch {shape[1]}, but this job uses "
                    f"{self._shape[0]} samples with batch {self._shape[1]}"
                )
            ranges = step_sample_ranges(request.step, w, self.world_size, *shape)
        except GradServerError as exc:
            return [
                Outgoing(
                    (w,),
                    ErrorOut(
                        int(Status.INVALID_ARGUMENT),
                        exc.message,
                        request.step,
                        sample_range_step=request.step,
                    ),
                )
            ]
        return [Outgoing((w,), SampleRangeAssignmentOut(request.step, w, ranges))]
