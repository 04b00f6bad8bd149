"""loss.png from metrics.jsonl: global loss and tokens/s over steps (matplotlib, no display)."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path


def plot_metrics(metrics: Path, target: Path) -> str:
    """Draws the plot; returns a one-line description of what was written."""
    if not metrics.exists():
        return f"no {metrics.name} to plot"
    loss: dict[int, float] = {}
    rate: dict[int, float] = defaultdict(float)
    for line in metrics.read_text().splitlines():
        entry = json.loads(line)
        if "global_loss" not in entry:
            continue
        loss[entry["step"]] = entry["global_loss"]
        rate[entry["step"]] += entry["tokens_per_s"]
    if not loss:
        return "no training steps to plot"
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    steps = sorted(loss)
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
    top.plot(steps, [loss[s] for s in steps], color="tab:blue")
    top.set_ylabel("global loss")
    top.grid(alpha=0.3)
    bottom.plot(steps, [rate[s] for s in steps], color="tab:green")
    bottom.set_ylabel("tokens/s (all workers)")
    bottom.set_xlabel("step")
    bottom.grid(alpha=0.3)
    fig.suptitle("gradserver training")
    fig.tight_layout()
    fig.savefig(target, dpi=100)
    plt.close(fig)
    return f"loss {loss[steps[0]]:.3f} -> {loss[steps[-1]]:.3f}, plot in {target}"
