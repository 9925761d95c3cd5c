"""Draws docs/figures/profile/trace.png: the named step ranges of every rank's trace in a profile folder, one row
per rank, as Perfetto shows them on each rank's main thread.

    python docs/figures/profile/draw.py RUN/profile docs/figures/profile/trace.png
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

RANGES = ("data_wait", "forward", "backward", "loss_all_reduce", "optimizer_step", "checkpoint")


def main(folder: Path, output: Path) -> None:
    traces = sorted(folder.glob("rank*.pt.trace.json"), key=lambda p: int(p.name[4:].split(".")[0]))
    spans = {p.name.split(".")[0]: [e for e in json.loads(p.read_text())["traceEvents"]
                                    if e.get("ph") == "X" and e.get("name") in RANGES] for p in traces}
    t0 = min(e["ts"] for events in spans.values() for e in events)  # microseconds; the ranks share the clock
    colours = dict(zip(RANGES, plt.get_cmap("tab10").colors))
    fig, ax = plt.subplots(figsize=(10, 1 + 0.6 * len(spans)))
    for row, (rank, events) in enumerate(spans.items()):
        for name in RANGES:
            bars = [((e["ts"] - t0) / 1000, e["dur"] / 1000) for e in events if e["name"] == name]
            ax.broken_barh(bars, (row - 0.35, 0.7), color=colours[name], label=name if row == 0 else None)
    ax.set_yticks(range(len(spans)), list(spans))
    ax.invert_yaxis()
    ax.set_xlabel("ms since the first traced range")
    ax.legend(ncol=len(RANGES), loc="upper center", bbox_to_anchor=(0.5, -0.35), frameon=False)
    fig.tight_layout()
    fig.savefig(output, dpi=110)


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
