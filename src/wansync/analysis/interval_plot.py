"""A table's figure: per setting, the mean and its 95 % interval over seeds, one panel per column.

The results page puts one beside each table, so that a reader sees at a glance which intervals
overlap (the test that decides is Welch's, in the text; the figure shows the spread it works on).
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from ..rundir import files  # noqa: E402
from .stats import Interval  # noqa: E402

Panel = tuple[str, Sequence["Interval | None"]]  # a column's header, and its interval per setting


def interval_figure(path: Path, title: str, labels: Sequence[str], panels: Sequence[Panel]) -> Path:
    """Write the figure to `path` (a link there is replaced, never written through); returns `path`."""
    n = max(1, len(labels))
    fig, axes = plt.subplots(
        1, max(1, len(panels)), figsize=(2.0 + 2.6 * max(1, len(panels)), 0.9 + 0.32 * n), sharey=True, squeeze=False
    )
    ys = list(range(n))[::-1]  # the table's first row on top
    for ax, (header, ivs) in zip(axes[0], panels):
        for y, iv in zip(ys, ivs):
            if iv is None:
                ax.text(0.5, y, "–", transform=ax.get_yaxis_transform(), ha="center", va="center", color="grey")
                continue
            ax.errorbar(
                iv.mean, y, xerr=iv.half or 0.0, fmt="o", color="tab:blue", ecolor="tab:blue", capsize=3, markersize=4
            )
        ax.set_title(header, fontsize=9)
        ax.grid(axis="x", alpha=0.3)
        ax.tick_params(axis="x", labelsize=8)
    axes[0][0].set_yticks(ys, labels, fontsize=8)
    axes[0][0].set_ylim(-0.6, n - 0.4)
    fig.suptitle(f"{title}: mean and 95 % interval over seeds", fontsize=9)
    fig.tight_layout()
    files.save_figure(path, fig, dpi=100)
    plt.close(fig)
    return path
