"""The coordinator's lifecycle registry (server/lifecycle.py) and the seam it makes: features
hear events in the order they subscribed, and `GradientServer` names no feature."""

from __future__ import annotations

import ast
import asyncio
from collections.abc import Sequence

from gradserver.common.messages import PeerPiece
from gradserver.server.features import FEATURES
from gradserver.server.lifecycle import ChunkInputs, Departure, Lifecycle
from gradserver.server.membership import Member

from .helpers.processes import ROOT

# The modules of the features: the coordinator's shell imports none of them.
FEATURE_MODULES = {"peers", "relay", "host_groups", "recovery", "shm", "shm_transport", "lane", "digests"}


def _member(worker_id: int) -> Member:
    return Member(worker_id, f"node-{worker_id}", "cpu", 0, 0, 0.0)


def test_handlers_of_one_event_run_in_the_order_they_subscribed() -> None:
    lifecycle = Lifecycle()
    heard: list[str] = []
    lifecycle.on_departed(lambda d: heard.append(f"first {d.worker_id} {d.lost}"))
    lifecycle.on_departed(lambda d: heard.append(f"second {d.reason}"))
    lifecycle.on_reset(lambda: heard.append("reset"))
    lifecycle.departed(Departure(3, "disconnected", lost=True))
    lifecycle.reset()
    assert heard == ["first 3 True", "second disconnected", "reset"]


def test_offers_merge_and_chunk_inputs_pass_through_every_adjustment_in_order() -> None:
    lifecycle = Lifecycle()
    lifecycle.on_joined(lambda member, members: {"a": member.worker_id})
    lifecycle.on_joined(lambda member, members: {"b": len(members)})

    def doubled(inputs: ChunkInputs, members: Sequence[Member]) -> ChunkInputs:
        return ChunkInputs({w: 2 * r for w, r in inputs.link_rates.items()}, inputs.shared_memory)

    def shared(inputs: ChunkInputs, members: Sequence[Member]) -> ChunkInputs:
        return ChunkInputs({w: r + 1 for w, r in inputs.link_rates.items()}, shared_memory=True)

    lifecycle.on_chunk_inputs(doubled)
    lifecycle.on_chunk_inputs(shared)
    members = [_member(0), _member(1)]
    assert lifecycle.joined(members[1], members) == {"a": 1, "b": 2}
    assert lifecycle.chunk_inputs({0: 10, 1: 0}, members) == ChunkInputs({0: 21, 1: 1}, shared_memory=True)
    assert Lifecycle().chunk_inputs({0: 10}, members) == ChunkInputs({0: 10}, shared_memory=False)


def test_questions_have_their_answer_when_no_feature_subscribed() -> None:
    lifecycle = Lifecycle()
    assert not lifecycle.holding_back(0) and not lifecycle.average_on_loop()
    assert lifecycle.step_in_flight() is None and lifecycle.message_handler(PeerPiece) is None
    lifecycle.on_step_in_flight(lambda: None)
    lifecycle.on_step_in_flight(lambda: 7)
    lifecycle.on_hold_back(lambda w: w == 2)
    assert lifecycle.step_in_flight() == 7 and lifecycle.holding_back(2) and not lifecycle.holding_back(1)


def test_start_and_close_are_awaited_in_order() -> None:
    lifecycle = Lifecycle()
    heard: list[str] = []

    async def opened(name: str) -> None:
        heard.append(name)

    lifecycle.on_start(lambda: opened("a"))
    lifecycle.on_start(lambda: opened("b"))
    lifecycle.on_close(lambda: opened("closed"))
    asyncio.run(lifecycle.start())
    asyncio.run(lifecycle.close())
    assert heard == ["a", "b", "closed"]


def test_the_coordinator_names_no_feature() -> None:
    tree = ast.parse((ROOT / "server" / "coordinator.py").read_text())
    imported = {
        (node.module or "").rpartition(".")[2]
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.level == 1
    } | {alias.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) for alias in node.names}
    assert imported & FEATURE_MODULES == set()
    assert {"partition", "relay", "host_groups", "recovery", "shm"} <= set(FEATURES)
