"""bench.wan: the delaying relay (each direction delayed, order and half-closes kept, bounded
buffering), the report's arithmetic, the settings it refuses, and one tiny run on emulated hosts
(2 hosts, DDP and streaming DiLoCo, a few steps; needs root and iproute2, skipped otherwise)."""

from __future__ import annotations

import asyncio
import json
import math
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest

from bench import _netns, wan
from bench._wan_relay import DelayLine, bound_port, split_address, start_relay
from bench._wan_report import VARIANTS, compare, curve, loss_at, send_spread, summarize, table

REPO = Path(__file__).resolve().parent.parent
DELAY = 0.03  # one way, s: long enough to measure, short enough for a quick test


# --- the relay ----------------------------------------------------------------------------------


async def _echo_through_relay(payload: bytes, pieces: int) -> tuple[bytes, float, float]:
    """Sends `payload` in `pieces` writes through a relay to an echoing server, half-closes, and
    reads the echo to its end: what came back, when the server got its first byte and when the
    client got its first byte back (both after the first write)."""
    loop = asyncio.get_running_loop()
    first_upstream: list[float] = []

    async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while data := await reader.read(65536):
            if not first_upstream:
                first_upstream.append(loop.time())
            writer.write(data)
            await writer.drain()
        writer.close()  # the relay forwards the client's half-close; this ends the echo

    upstream = await asyncio.start_server(echo, "127.0.0.1", 0)
    relay = await start_relay(("127.0.0.1", 0), ("127.0.0.1", bound_port(upstream)), DELAY)
    async with upstream, relay:
        reader, writer = await asyncio.open_connection("127.0.0.1", bound_port(relay))
        size = -(-len(payload) // pieces)
        sent_at = loop.time()
        for start in range(0, len(payload), size):
            writer.write(payload[start : start + size])
            await writer.drain()
        writer.write_eof()
        first = await reader.readexactly(1)
        back_at = loop.time()
        rest = await reader.read()  # to the end: the echo server closed after the half-close
        writer.close()
        return first + rest, first_upstream[0] - sent_at, back_at - sent_at


def test_the_relay_delays_each_direction_and_keeps_the_bytes_in_order() -> None:
    payload = bytes(range(256)) * 8192  # 2 MiB, so chunks are cut and queued
    echoed, one_way, round_trip = asyncio.run(asyncio.wait_for(_echo_through_relay(payload, 37), 20))
    assert echoed == payload
    assert one_way >= DELAY * 0.95  # the loop's clock rounds to about a millisecond
    assert round_trip >= 2 * DELAY * 0.95
    assert round_trip < 2 * DELAY + 2.0  # and no more than a bounded extra


def test_a_delay_line_holds_at_most_its_limit_and_gives_chunks_back_in_order() -> None:
    async def scenario() -> None:
        line = DelayLine(DELAY, limit=10)
        loop = asyncio.get_running_loop()
        put_at = loop.time()
        await line.put(b"0123456789")
        blocked = asyncio.ensure_future(line.put(b"a"))
        for _ in range(5):  # let it run as far as it can: it must wait for room
            await asyncio.sleep(0)
        assert not blocked.done()
        assert await line.get() == b"0123456789"
        assert loop.time() - put_at >= DELAY * 0.95
        await asyncio.wait_for(blocked, 5)
        await line.put(None)
        assert await line.get() == b"a"
        assert await line.get() is None

    asyncio.run(scenario())


def test_addresses_are_host_and_port() -> None:
    assert split_address("10.77.0.200:0") == ("10.77.0.200", 0)
    with pytest.raises(ValueError, match="HOST:PORT"):
        split_address("10.77.0.200")


# --- the report ---------------------------------------------------------------------------------


def _result(rank: int, evals: list[list[float]], wall: float, compute: float, digest: str = "d") -> dict:
    return {
        "rank": rank,
        "tokens": 1000,
        "wall_s": wall,
        "compute_s": compute,
        "evals": evals,
        "digest": digest,
    }


def test_the_curve_sums_the_ranks_shares_at_the_slowest_ranks_time() -> None:
    results = [
        _result(0, [[0, 0.0, 10.0, 2], [5, 1.0, 6.0, 2]], 1.0, 0.5),
        _result(1, [[0, 0.1, 14.0, 2], [5, 1.2, 2.0, 2]], 1.2, 0.6),
    ]
    assert curve(results) == [(0.1, 6.0), (1.2, 2.0)]
    # A step only one rank evaluated is left out.
    results[0]["evals"].append([9, 2.0, 1.0, 1])
    assert len(curve(results)) == 2


def test_loss_at_interpolates_and_holds_the_last_value() -> None:
    points = [(0.0, 5.0), (10.0, 3.0), (20.0, 2.0)]
    assert loss_at(points, 5.0) == pytest.approx(4.0)
    assert loss_at(points, 10.0) == pytest.approx(3.0)
    assert loss_at(points, 25.0) == 2.0
    assert loss_at(points, -1.0) is None
    assert loss_at([], 1.0) is None


def test_summaries_and_their_comparison_with_ddp() -> None:
    ddp = summarize(
        VARIANTS["ddp"],
        50,
        [_result(0, [[0, 0.0, 8.0, 2], [10, 40.0, 4.0, 2]], 40.0, 10.0)] * 2,
        wire_bytes=2_000_000,
        busiest_bytes=500_000,
    )
    assert ddp.tokens == 2000
    assert ddp.tokens_per_s == pytest.approx(50.0)
    assert ddp.wire_bytes_per_token == pytest.approx(1000.0)
    assert ddp.busiest_link_mbit == pytest.approx(500_000 * 8 / 1e6 / 40.0)
    assert ddp.compute_share == pytest.approx(0.25)
    assert ddp.final_loss == pytest.approx(2.0)
    assert ddp.identical
    outer = summarize(
        VARIANTS["diloco"],
        50,
        [
            _result(0, [[0, 0.0, 8.0, 2], [10, 10.0, 4.2, 2]], 10.0, 9.0, "a"),
            _result(1, [[0, 0.0, 8.0, 2], [10, 10.0, 4.2, 2]], 10.0, 8.0, "b"),
        ],
        wire_bytes=20_000,
        busiest_bytes=5_000,
    )
    assert not outer.identical
    assert outer.label == "DiLoCo H=50"
    compare([ddp, outer])
    assert outer.speedup_vs_ddp == pytest.approx(4.0)
    assert outer.bytes_reduction_vs_ddp == pytest.approx(100.0)
    assert outer.loss_vs_ddp == pytest.approx(0.05)
    assert outer.loss_at_ddp_time == pytest.approx(2.1)  # it had finished: its last loss
    assert outer.ddp_loss_at_this_time == pytest.approx(4.0 - 2.0 * 10 / 40)  # DDP's at 10 s
    lines = table([ddp, outer])
    assert (
        len(lines) == 4
        and "| DiLoCo H=50 | 200 | 4.00 |" in lines[3]
        and "| NO | - | - | - | - |" in lines[3]
    )
    assert all(not math.isnan(x) for x in (outer.tokens_per_s, outer.compute_share))


def test_the_exchange_figures_are_the_ranks_exposed_share_and_the_hidden_share_of_the_waits() -> None:
    def ranked(rank: int, exposed: float, **waits: float) -> dict[str, Any]:
        times = {"exposed_s": exposed, "hidden_share": None, **waits}
        return {**_result(rank, [[0, 0.0, 8.0, 2], [10, 10.0, 4.2, 2]], 10.0, 9.0), "exchange_times": times}

    waits = [
        {"exchanges": 4, "waited": 1, "waited_in_flight_s": 3.0, "waited_waiting_s": 1.0},
        {"exchanges": 4, "waited": 2, "waited_in_flight_s": 1.0, "waited_waiting_s": 3.0},
    ]
    ranks = [ranked(0, 1.0, **waits[0]), ranked(1, 3.0, **waits[1])]
    outer = summarize(VARIANTS["streaming"], 50, ranks, 1, 1)
    assert outer.exposed_share == pytest.approx(0.2)  # (1/10 + 3/10) / 2
    assert outer.waited_exchanges == "3/8"
    assert outer.hidden_share == pytest.approx(0.5)  # (3 + 1) of (3 + 1 + 1 + 3) s
    assert "| 20.0% | 3/8 | 50% | - |" in table([outer])[2]
    # Without the waits' breakdown, only the exposed share.
    exposed = summarize(VARIANTS["trainer-streaming"], 50, [ranked(0, 2.0), ranked(1, 2.0)], 1, 1)
    assert exposed.exposed_share == pytest.approx(0.2)
    assert exposed.waited_exchanges is None and exposed.hidden_share is None
    # A rank without the figures (a killed one's) leaves them out.
    ranks = [ranked(0, 1.0, **waits[0]), _result(1, [], 10.0, 9.0)]
    partial = summarize(VARIANTS["streaming"], 50, ranks, 1, 1)
    assert partial.exposed_share is None


def test_the_send_spread_is_the_mean_of_the_last_ranks_send_less_the_firsts() -> None:
    results = [_result(r, [], 10.0, 9.0) for r in range(3)]
    for result, sends in zip(results, ([10.0, 20.0], [10.5, 20.1], [11.0, 20.0]), strict=True):
        result["sends"] = sends
    assert send_spread(results) == pytest.approx((1.0 + 0.1) / 2)
    results[2]["sends"] = [11.0]  # a replacement that joined part-way
    assert send_spread(results) is None
    assert send_spread([_result(0, [], 10.0, 9.0)]) is None  # DDP's rows send none


def test_the_bench_refuses_settings_it_cannot_run() -> None:
    def why(*argv: str) -> str | None:
        return wan.check(wan.parser().parse_args(list(argv)))

    assert why() is None
    assert "multiple of --sync-every" in (why("--steps", "120") or "")
    assert why("--steps", "120", "--variants", "ddp,ddp-bf16") is None
    assert "unknown" in (why("--variants", "ddp,fast") or "")
    assert "must exceed" in (why("--steps", "8", "--sync-every", "4") or "")
    trainer = why("--variants", "trainer-streaming", "--sync-every", "25")
    assert "trainer-streaming: --sync-every 25 must be a multiple of its 2 fragments" in (trainer or "")
    assert why("--variants", "trainer-streaming", "--sync-every", "10", "--eval-every", "10") is None
    assert "at least 2 inner steps" in (why("--variants", "trainer-streaming-f5", "--sync-every", "5") or "")


# --- end to end ---------------------------------------------------------------------------------

OK, WHY = _netns.available()


@pytest.mark.processes
@pytest.mark.timeout(300)
@pytest.mark.skipif(not OK, reason=f"emulated cluster unavailable: {WHY}")
def test_a_tiny_run_on_two_emulated_hosts_reports_every_figure_and_leaves_nothing() -> None:
    prefix = f"gw{uuid.uuid4().hex[:5]}"
    tiny = ["--hidden", "32", "--layers", "1", "--heads", "2", "--kv-heads", "1", "--intermediate", "64"]
    argv = [sys.executable, "-m", "bench.wan", "--hosts", "2", "--rtt-ms", "10", "--steps", "16"]
    argv += ["--sync-every", "8", "--batch", "2", "--seq-len", "16", "--eval-every", "8", "--eval-seqs", "8"]
    variants = "ddp,ddp-bf16,ddp-gloo,streaming,diloco-ft,trainer-streaming,trainer-streaming-outer-flush"
    argv += ["--variants", variants, "--json"]
    argv += ["--prefix", prefix]
    argv += ["--timeout", "90"]
    argv += tiny
    try:
        done = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=280, check=False)
    finally:
        left = _netns.leftovers(prefix)
    assert done.returncode == 0, done.stderr[-3000:]
    assert left == []
    report = json.loads(done.stdout.strip().splitlines()[-1])
    ddp, bf16, gloo, streaming, over_ft, in_trainer, outer_flush = report["variants"]
    assert {row["tokens"] for row in report["variants"]} == {2 * 16 * 2 * 16}
    for row in report["variants"]:
        assert row["identical"]
        assert row["tokens_per_s"] > 0 and 0 < row["compute_share"] <= 1
        assert math.isfinite(row["final_loss"]) and len(row["curve"]) == 3  # steps 0, 8, 16
    # Streaming exchanges twice per fragment in 16 steps, DDP all of it every step.
    assert ddp["wire_bytes_per_token"] > 2 * streaming["wire_bytes_per_token"] > 0
    assert streaming["bytes_reduction_vs_ddp"] > 2
    # DDP on gloo and on gradserver average alike (2 ranks: (a + b) / 2 rounded once): the same weights.
    assert gloo["digest"] == ddp["digest"] != bf16["digest"]
    # DiLoCo over ft: each exchange a fault-tolerant step, both taken, none discarded.
    assert "2 fragment outer steps" in over_ft["note"] and "0 exchanges discarded" in over_ft["note"]
    # The trainer's: 4 trainer steps of H/F = 4 inner steps, each one exchange, and 1 flush step.
    assert "parameters; 5 fragment outer steps" in in_trainer["note"], in_trainer["note"]
    assert ddp["wire_bytes_per_token"] > 2 * in_trainer["wire_bytes_per_token"] > 0
    # Its flush rule is the variant's: the same steps until the flush, other weights after it.
    assert "5 fragment outer steps" in outer_flush["note"] and outer_flush["digest"] != in_trainer["digest"]
    # How long the exchanges held the ranks: figures of outer steps only. On each rank streaming
    # has 11 exchanges (2 per fragment, and the flush's 3: every fragment but the last), over ft
    # 2 (and its start check, not an outer step's), the trainer 5 (4 steps and 1 flush step).
    assert ddp["exposed_share"] is None and ddp["waited_exchanges"] is None
    # The ranks' send spread: of the wrapper's exchanges sent in inner steps (not the trainer's).
    assert streaming["send_spread_s"] >= 0 and over_ft["send_spread_s"] >= 0
    assert in_trainer["send_spread_s"] is None and ddp["send_spread_s"] is None
    for row, each in ((streaming, 2 * 4 + 3), (over_ft, 2), (in_trainer, 5)):
        assert 0 < row["exposed_share"] < 1
        waited, exchanges = map(int, row["waited_exchanges"].split("/"))
        assert exchanges == 2 * each and 0 <= waited <= exchanges, row["waited_exchanges"]
    # GRADSERVER_WIRE_DTYPE=bfloat16 (set by bench.wan for ddp-bf16): half the gradient bytes.
    assert 0.4 < bf16["wire_bytes_per_token"] / ddp["wire_bytes_per_token"] < 0.65
