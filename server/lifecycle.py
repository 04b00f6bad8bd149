"""The coordinator's lifecycle events, and the registry through which features hear them.

`GradientServer` (server/coordinator.py) names no feature: each one (the partitions, the peer
relay, host groups, live recovery, the shared-memory transport and its lane) subscribes here,
for only the events it needs, when `server/features.py` assembles them, and borrows from the
shell only what `Shell` lends it. Handlers of one event run in the order they subscribed.

The order guarantees the features rely on:

- `check_join`: every Join, after the protocol version and the job's own refusal were checked,
  before the request waits for the world; a check refuses by raising.
- `world_complete`: once per job, in the first Join to return (before any returns), before the
  job's chunk size is chosen; `chunk_chosen` follows once the table and the streams are sized.
- `joined`: every Join, after the table and the job heard of the member; its fields go into the
  member's JoinAccepted.
- `start`: once, after the gRPC port serves and before the "serving" event is written.
- `stream_opened`: a member's stream is registered (what is queued for it from now on reaches
  it) and nothing of it was read yet.
- `sent`: every batch of messages, before any of it is routed or queued.
- `departed`: after the job recorded the departure (the events file names it first) and before
  the table hears of it: the table still holds the departed worker's contributions and its steps.
- `reset`: a fresh job (every worker left), before its table is built.
- `stopping`: a graceful shutdown began and the workers were told, before the drain.
- `close`: last, after the gRPC server stopped.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable, Collection, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol, TypedDict

from gradserver.common.averaging import Averager
from gradserver.common.errors import Status
from gradserver.common.messages import JoinRequestIn

from .config import CoordinatorConfig
from .membership import Member
from .metrics import CoordinatorMetrics
from .outbox import Outbox
from .outgoing import Outgoing

if TYPE_CHECKING:  # the features' own types, which import this module
    from gradserver.common.partition_map import PartitionMap

    from .host_groups import HostGroups


class TableAccess(Protocol):
    """What a feature may ask of the job's reduction table, or tell it: a narrow view (the table
    is replaced by a fresh job, so features reach it through `Shell.table` each time)."""

    def first_step(self, worker_id: int) -> int: ...

    def unsettled_steps(self) -> set[int]: ...

    def fail_step(
        self, step: int, message: str, code: Status, culprit: int | None = None
    ) -> list[Outgoing]: ...

    def copy_held_data(self, worker_id: int) -> None: ...


class TableParts(TypedDict, total=False):
    """What features put into each job's `ReductionTable` (its keyword arguments)."""

    partition: tuple[PartitionMap, int]
    host_groups: HostGroups


@dataclasses.dataclass(frozen=True)
class ChunkInputs:
    """What the job's chunk size is chosen from besides where its members joined from: each
    member's link rate as the chunk size should see it, and whether every member will use
    shared memory."""

    link_rates: Mapping[int, int]
    shared_memory: bool = False


@dataclasses.dataclass(frozen=True)
class Departure:
    """A member left (`lost`: without a goodbye, or evicted) for `reason`."""

    worker_id: int
    reason: str
    lost: bool


@dataclasses.dataclass(frozen=True)
class Shell:
    """What the coordinator lends its features: its settings and counters, and callbacks into
    its streams, membership and current table (read when called: a reset replaces them)."""

    config: CoordinatorConfig
    metrics: CoordinatorMetrics
    averager: Averager
    authenticate: Callable[[int, int, int], Member]
    deliver: Callable[[list[Outgoing]], None]
    add_outbox: Callable[[Outbox], None]
    after_written: Callable[[int, Callable[[], None]], None]
    streaming_workers: Callable[[], Collection[int]]
    table: Callable[[], TableAccess]
    chunk_bytes: Callable[[], int]
    resume_step: Callable[[], int | None]
    cores: int


Offer = Callable[[Member, Sequence[Member]], Mapping[str, Any]]
AdjustChunkInputs = Callable[[ChunkInputs, Sequence[Member]], ChunkInputs]


class Lifecycle:
    """The subscriptions of one coordinator, by event (`on_*` subscribes; the plain names are
    what the coordinator calls)."""

    def __init__(self) -> None:
        self._join_checks: list[Callable[[JoinRequestIn], None]] = []
        self._world_complete: list[Callable[[Sequence[Member]], None]] = []
        self._chunk_inputs: list[AdjustChunkInputs] = []
        self._chunk_chosen: list[Callable[[int], None]] = []
        self._offers: list[Offer] = []
        self._table_parts: list[Callable[[], TableParts]] = []
        self._starts: list[Callable[[], Awaitable[None]]] = []
        self._stream_opened: list[Callable[[int], None]] = []
        self._sent: list[Callable[[Sequence[Outgoing]], None]] = []
        self._departed: list[Callable[[Departure], None]] = []
        self._resets: list[Callable[[], None]] = []
        self._stopping: list[Callable[[str], None]] = []
        self._closes: list[Callable[[], Awaitable[None]]] = []
        self._hold_back: list[Callable[[int], bool]] = []
        self._step_in_flight: list[Callable[[], int | None]] = []
        self._counting: list[Callable[[], None]] = []
        self._on_loop: list[Callable[[], bool]] = []
        self._messages: dict[type[Any], Callable[[Member, Any], None]] = {}
        self._calls: dict[str, Callable[[bytes], list[Outgoing]]] = {}

    # --- subscribing ----------------------------------------------------------------------------

    def on_join_request(self, check: Callable[[JoinRequestIn], None]) -> None:
        self._join_checks.append(check)

    def on_world_complete(self, handler: Callable[[Sequence[Member]], None]) -> None:
        self._world_complete.append(handler)

    def on_chunk_inputs(self, adjust: AdjustChunkInputs) -> None:
        self._chunk_inputs.append(adjust)

    def on_chunk_chosen(self, handler: Callable[[int], None]) -> None:
        self._chunk_chosen.append(handler)

    def on_joined(self, offer: Offer) -> None:
        """`offer(member, members)`: JoinAccepted fields for `member`."""
        self._offers.append(offer)

    def on_table(self, parts: Callable[[], TableParts]) -> None:
        """`parts()`: what goes into each job's table, read whenever one is built."""
        self._table_parts.append(parts)

    def on_start(self, handler: Callable[[], Awaitable[None]]) -> None:
        self._starts.append(handler)

    def on_stream_opened(self, handler: Callable[[int], None]) -> None:
        self._stream_opened.append(handler)

    def on_sent(self, handler: Callable[[Sequence[Outgoing]], None]) -> None:
        self._sent.append(handler)

    def on_departed(self, handler: Callable[[Departure], None]) -> None:
        self._departed.append(handler)

    def on_reset(self, handler: Callable[[], None]) -> None:
        self._resets.append(handler)

    def on_stopping(self, handler: Callable[[str], None]) -> None:
        self._stopping.append(handler)

    def on_close(self, handler: Callable[[], Awaitable[None]]) -> None:
        self._closes.append(handler)

    def on_hold_back(self, query: Callable[[int], bool]) -> None:
        """`query(w)`: whether worker w's stream is to wait, whatever its budget."""
        self._hold_back.append(query)

    def on_step_in_flight(self, query: Callable[[], int | None]) -> None:
        """`query()`: a step under way outside the table (named when a worker is lost)."""
        self._step_in_flight.append(query)

    def on_counting(self, handler: Callable[[], None]) -> None:
        """`handler()`: runs before the traffic counters are read (to bring them up to date)."""
        self._counting.append(handler)

    def on_average_on_loop(self, query: Callable[[], bool]) -> None:
        """`query()`: whether large averages are to run on the event loop for now."""
        self._on_loop.append(query)

    def handle_message(self, kind: type[Any], handler: Callable[[Member, Any], None]) -> None:
        """`handler(sender, event)` takes every stream event of `kind` the table does not."""
        self._messages[kind] = handler

    def handle_call(self, method: str, handler: Callable[[bytes], list[Outgoing]]) -> None:
        """`handler(request)`: a unary RPC of the service, answered empty once its messages went out."""
        self._calls[method] = handler

    # --- the events -------------------------------------------------------------------------------

    def check_join(self, request: JoinRequestIn) -> None:
        for check in self._join_checks:
            check(request)

    def world_complete(self, members: Sequence[Member]) -> None:
        for handler in self._world_complete:
            handler(members)

    def chunk_inputs(self, measured: Mapping[int, int], members: Sequence[Member]) -> ChunkInputs:
        inputs = ChunkInputs(dict(measured))
        for adjust in self._chunk_inputs:
            inputs = adjust(inputs, members)
        return inputs

    def chunk_chosen(self, chunk_bytes: int) -> None:
        for handler in self._chunk_chosen:
            handler(chunk_bytes)

    def joined(self, member: Member, members: Sequence[Member]) -> dict[str, Any]:
        fields: dict[str, Any] = {}
        for offer in self._offers:
            fields.update(offer(member, members))
        return fields

    def table_parts(self) -> TableParts:
        merged = TableParts()
        for parts in self._table_parts:
            merged.update(parts())
        return merged

    async def start(self) -> None:
        for handler in self._starts:
            await handler()

    def stream_opened(self, worker_id: int) -> None:
        for handler in self._stream_opened:
            handler(worker_id)

    def sent(self, outgoing: Sequence[Outgoing]) -> None:
        for handler in self._sent:
            handler(outgoing)

    def departed(self, departure: Departure) -> None:
        for handler in self._departed:
            handler(departure)

    def reset(self) -> None:
        for handler in self._resets:
            handler()

    def stopping(self, reason: str) -> None:
        for handler in self._stopping:
            handler(reason)

    async def close(self) -> None:
        for handler in self._closes:
            await handler()

    def holding_back(self, worker_id: int) -> bool:
        return any(query(worker_id) for query in self._hold_back)

    def step_in_flight(self) -> int | None:
        return next((s for query in self._step_in_flight if (s := query()) is not None), None)

    def counting(self) -> None:
        for handler in self._counting:
            handler()

    def average_on_loop(self) -> bool:
        return any(query() for query in self._on_loop)

    def message_handler(self, kind: type[Any]) -> Callable[[Member, Any], None] | None:
        return self._messages.get(kind)

    @property
    def calls(self) -> Mapping[str, Callable[[bytes], list[Outgoing]]]:
        return self._calls
