"""bench.wan's variants and the arithmetic of its report (pure: no torch, no network).

Each rank of a run writes one result (bench/_wan_rank.py): its training time without the
evaluations (`wall_s`), its time computing (forward, backward up to its last gradient, inner
optimizer: `compute_s`), its tokens, its held-out evaluations `[step, time_s, loss_sum, count]`
(each rank evaluates its own share of the held-out windows, so a point's loss is the sum over
the ranks' sums over the sum of their counts), the wall-clock window of its training loop and a
digest of its final weights. `summarize` turns the ranks' results and the links' byte counts
into one `Summary` per variant; `compare` adds what needs DDP's run (the loss at equal wall time,
the ratios).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any


@dataclasses.dataclass(frozen=True)
class Variant:
    """One way of training: plain DDP (optionally with a 16-bit wire, or on gloo) or DiLoCo outer
    steps."""

    name: str
    label: str
    ddp: bool
    wire_dtype: str = "float32"  # DDP's: what the backend's client sends gradients as
    # DDP's process group: "gradserver" (through the relay, so with its delay) or "gloo" (the
    # ranks connect to each other over their shaped links; the relay's delay is not on its path).
    backend: str = "gradserver"
    fragments: int = 1  # DiLoCo's
    delay: int = 0
    quantize: str | None = None
    keep_local: float = 0.0  # streaming's mixing (the paper's alpha)
    ft: bool = False  # DiLoCo over ft.Replica: each exchange a fault-tolerant step
    kill: bool = False  # ft: one rank SIGKILLed mid-inner-phase and started again (`kill_step`)
    # The built-in trainer's outer steps (train/outer_steps.py) instead of the torch wrapper: its
    # exchange leaves H / (2F) inner steps before the end of each trainer step (`--outer-delay`).
    trainer: bool = False
    flush: str = "mean"  # the trainer's flush rule (`--outer-flush`); the wrapper's rows use "outer"


def _streaming(name: str, quantize: str = "int8", *, also: str = "", **options: bool) -> Variant:
    """Streaming DiLoCo as the paper runs it with a delay: 4 fragments, tau = 5, and alpha = 0.5,
    which keeps half of the local progress made while a fragment's exchange was on its way.
    `also`: the rest of the label; `options`: ft, kill."""
    label = f"streaming DiLoCo H={{H}}, F=4, tau=5, alpha=0.5, {quantize}{also}"
    return Variant(name, label, ddp=False, fragments=4, delay=5, quantize=quantize, keep_local=0.5, **options)


def _trainer(name: str, fragments: int, flush: str = "mean") -> Variant:
    """The trainer's streaming outer steps: F fragments, the exchange sent H/(2F) inner steps
    before its trainer step ends, alpha 0.5, int8 with error feedback, then the flush by `flush`."""
    label = f"the trainer's streaming DiLoCo H={{H}}, F={fragments}, tau=H/{2 * fragments}, alpha=0.5, int8"
    if flush != "mean":
        label += f", flush {flush}"
    options = {"fragments": fragments, "quantize": "int8", "keep_local": 0.5}
    return Variant(name, label, ddp=False, trainer=True, flush=flush, **options)


VARIANTS = {
    v.name: v
    for v in (
        Variant("ddp", "DDP", ddp=True),
        Variant("ddp-bf16", "DDP, bf16 wire", ddp=True, wire_dtype="bfloat16"),
        Variant("ddp-gloo", "DDP on gloo (no added delay)", ddp=True, backend="gloo"),
        Variant("diloco", "DiLoCo H={H}", ddp=False),
        Variant("diloco-int8", "DiLoCo H={H}, int8", ddp=False, quantize="int8"),
        Variant("diloco-ft", "DiLoCo H={H} over ft", ddp=False, ft=True),
        Variant("diloco-ft-kill", "DiLoCo H={H} over ft, a rank killed", ddp=False, ft=True, kill=True),
        _streaming("streaming"),
        # Over ft the exchange runs beside the next tau inner steps as over the process group.
        _streaming("streaming-ft", also=", over ft", ft=True),
        _streaming("streaming-ft-kill", also=", over ft, a rank killed", ft=True, kill=True),
        _streaming("streaming-int4", "int4"),
        _trainer("trainer-streaming", 2),
        # tau = 5 at H = 50, as the wrapper's streaming rows (whose F = 4 does not divide 50).
        _trainer("trainer-streaming-f5", 5),
        _trainer("trainer-streaming-outer-flush", 2, "outer"),
    )
}


def kill_step(steps: int, sync_every: int) -> int:
    """The inner step a killed rank dies in: the middle of the period a third into the run, so
    that its replacement (a fresh process: seconds to start) is up before the job's last exchange:
    one that comes later finds the job finished."""
    return (steps // 3) // sync_every * sync_every + sync_every // 2


def variant_label(variant: Variant, sync_every: int) -> str:
    return variant.label.format(H=sync_every)


@dataclasses.dataclass
class Summary:
    """One variant's figures."""

    variant: str
    label: str
    ranks: int
    tokens: int
    wall_s: float
    tokens_per_s: float
    wire_bytes: int
    wire_bytes_per_token: float
    busiest_link_mbit: float  # the busiest link direction's mean rate over the run
    compute_share: float
    final_loss: float
    curve: list[tuple[float, float]]  # (seconds of training, held-out loss)
    identical: bool  # every rank's final weights the same bytes
    digest: str  # rank 0's final weights (sha256): equal across variants that train alike
    loss_at_ddp_time: float | None = None
    ddp_loss_at_this_time: float | None = None
    speedup_vs_ddp: float | None = None
    bytes_reduction_vs_ddp: float | None = None
    loss_vs_ddp: float | None = None  # final loss / DDP's - 1
    # Outer steps only (None otherwise): the share of wall time the ranks' training threads spent
    # sending exchanges and waiting for them (the mean over ranks), the exchanges waited for (all
    # ranks), and of those, the share of their time the next inner steps hid (diloco's
    # ExchangeTimes; the trainer's steps give only the first).
    exposed_share: float | None = None
    waited_exchanges: str | None = None  # "waited/exchanges"
    hidden_share: float | None = None
    # The wrapper's rows: how far apart the ranks sent one exchange (the last rank's send less the
    # first's, the mean over the exchanges of the inner steps): a wait this long is a replica's
    # lateness, not the link's.
    send_spread_s: float | None = None
    note: str = ""

    def as_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def curve(results: Sequence[dict[str, Any]]) -> list[tuple[float, float]]:
    """(time, held-out loss) at each evaluated step: the ranks' loss sums over their counts, at
    the latest of their times (the point is reached when the slowest rank got there)."""
    by_step: dict[int, list[list[float]]] = {}
    for result in results:
        for step, at, loss_sum, count in result["evals"]:
            by_step.setdefault(int(step), []).append([at, loss_sum, count])
    points = []
    for step in sorted(by_step):
        rows = by_step[step]
        if len(rows) != len(results):
            continue  # a step not every rank evaluated (a rank that failed) is no point
        points.append((max(r[0] for r in rows), sum(r[1] for r in rows) / sum(r[2] for r in rows)))
    return points


def loss_at(points: Sequence[tuple[float, float]], when: float) -> float | None:
    """The loss at time `when` along `points`, linear between them; a run that ended before
    `when` holds its last loss; None before the first point."""
    if not points or when < points[0][0]:
        return None
    for (t0, l0), (t1, l1) in itertools.pairwise(points):
        if t0 <= when <= t1:
            return l0 if t1 == t0 else l0 + (l1 - l0) * (when - t0) / (t1 - t0)
    return points[-1][1]


def summarize(
    variant: Variant, sync_every: int, results: Sequence[dict[str, Any]], wire_bytes: int, busiest_bytes: int
) -> Summary:
    """One variant's figures from its ranks' results and the bytes its hosts' links carried
    during training (both directions of every host's link, summed; `busiest_bytes`: the most
    one direction of one link carried)."""
    tokens = sum(int(r["tokens"]) for r in results)
    wall = max(float(r["wall_s"]) for r in results)
    points = curve(results)
    summary = Summary(
        variant=variant.name,
        label=variant_label(variant, sync_every),
        ranks=len(results),
        tokens=tokens,
        wall_s=wall,
        tokens_per_s=tokens / wall if wall > 0 else math.nan,
        wire_bytes=wire_bytes,
        wire_bytes_per_token=wire_bytes / tokens if tokens else math.nan,
        busiest_link_mbit=busiest_bytes * 8 / 1e6 / wall if wall > 0 else math.nan,
        compute_share=sum(float(r["compute_s"]) / float(r["wall_s"]) for r in results) / len(results),
        final_loss=points[-1][1] if points else math.nan,
        curve=points,
        identical=len({r["digest"] for r in results}) == 1,
        digest=str(results[0]["digest"]),
    )
    exchange_times(summary, results)
    summary.send_spread_s = send_spread(results)
    return summary


def send_spread(results: Sequence[dict[str, Any]]) -> float | None:
    """The mean over exchanges of the last rank's send time less the first's (the ranks' clock is
    this machine's); None without sends, or where the ranks sent different numbers of them (a
    replacement that joined part-way)."""
    sends = [r.get("sends") or [] for r in results]
    if not sends[0] or any(len(s) != len(sends[0]) for s in sends):
        return None
    spreads = [max(times) - min(times) for times in zip(*sends, strict=True)]
    return sum(spreads) / len(spreads)


def exchange_times(summary: Summary, results: Sequence[dict[str, Any]]) -> None:
    """Fills in the summary's exchange figures from its ranks' `exchange_times` (outer steps)."""
    times = [r["exchange_times"] for r in results if r.get("exchange_times")]
    if len(times) != len(results):
        return
    shares = [t["exposed_s"] / float(r["wall_s"]) for t, r in zip(times, results, strict=True)]
    summary.exposed_share = sum(shares) / len(shares)
    if all("waited" in t for t in times):
        summary.waited_exchanges = f"{sum(t['waited'] for t in times)}/{sum(t['exchanges'] for t in times)}"
        hidden = sum(t["waited_in_flight_s"] for t in times)
        total = hidden + sum(t["waited_waiting_s"] for t in times)
        summary.hidden_share = hidden / total if total > 0 else None


def compare(summaries: list[Summary]) -> None:
    """Fills in each summary's figures against the DDP run (when there is one): the loss this
    variant had at DDP's wall time (its last loss if it finished sooner), DDP's loss at this
    variant's wall time, and the ratios of tokens/s, bytes per token and final loss."""
    ddp = next((s for s in summaries if s.variant == "ddp"), None)
    if ddp is None:
        return
    for s in summaries:
        s.loss_at_ddp_time = loss_at(s.curve, ddp.wall_s)
        s.ddp_loss_at_this_time = loss_at(ddp.curve, s.wall_s)
        s.speedup_vs_ddp = s.tokens_per_s / ddp.tokens_per_s
        if s.wire_bytes_per_token > 0:
            s.bytes_reduction_vs_ddp = ddp.wire_bytes_per_token / s.wire_bytes_per_token
        s.loss_vs_ddp = s.final_loss / ddp.final_loss - 1.0


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, spec)


def table(summaries: Sequence[Summary]) -> list[str]:
    """The report as Markdown table lines."""
    lines = [
        "| variant | tokens/s | x DDP | wire B/token | DDP / this | busiest link Mbit/s | computing "
        "| held-out loss | vs DDP | loss at DDP's time | DDP's loss at this time | identical "
        "| exchanges exposed | waited for | of those hidden | ranks' send spread, s |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for s in summaries:
        lines.append(
            f"| {s.label} | {s.tokens_per_s:.0f} | {_fmt(s.speedup_vs_ddp, '.2f')} "
            f"| {s.wire_bytes_per_token:.1f} | {_fmt(s.bytes_reduction_vs_ddp, '.1f')} "
            f"| {s.busiest_link_mbit:.1f} | {s.compute_share:.0%} | {s.final_loss:.4f} "
            f"| {_fmt(None if s.loss_vs_ddp is None else s.loss_vs_ddp * 100, '+.1f')}% "
            f"| {_fmt(s.loss_at_ddp_time, '.4f')} | {_fmt(s.ddp_loss_at_this_time, '.4f')} "
            f"| {'yes' if s.identical else 'NO'} | {_fmt(s.exposed_share, '.1%')} "
            f"| {s.waited_exchanges or '-'} | {_fmt(s.hidden_share, '.0%')} "
            f"| {_fmt(s.send_spread_s, '.2f')} |"
        )
    return lines


def as_json(summaries: Sequence[Summary], setup: dict[str, Any]) -> str:
    return json.dumps({"setup": setup, "variants": [s.as_json() for s in summaries]})


def plot(summaries: Sequence[Summary], target: Path, title: str) -> str:
    """A loss-vs-wall-time PNG (matplotlib, no display); returns what it did."""
    try:
        import matplotlib
    except ImportError:
        return f"matplotlib is not installed: no plot written to {target}"
    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for s in summaries:
        if s.curve:
            ax.plot([t for t, _ in s.curve], [loss for _, loss in s.curve], marker=".", label=s.label)
    ax.set_xlabel("wall time of training, s (evaluations excluded)")
    ax.set_ylabel("held-out loss (nats/byte)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(target, dpi=110)
    plt.close(fig)
    return f"wrote {target}"
