"""TensorBoard scalars of a run (`--tensorboard`, `ws.Run(..., tensorboard=True)`), written by rank 0
with torch's own `SummaryWriter` into the run directory's `tensorboard/` (`rundir.layout`).

Tags, each against the training step:

- `train/loss`, and `train/lr`, `train/items_per_s` when the step record has them;
- `eval/<metric>` for every number an evaluation reports (`eval/val_loss`, `eval/test_acc`, ...);
- `comm/exposed_s` (the step's exposed communication: blocked on the network), `comm/exposed_pct`
  (exposed share of the wall clock so far), `comm/bytes_sent` (this rank's bytes between workers so far);
- `sync/events` (sync events so far), `sync/bytes` and `sync/drift` (the worker drift) at each sync event.

`tensorboard` is an optional extra (`pip install 'wansync[tensorboard]'`): without it, asking for the
scalars fails in one line before anything runs (`check_available`).
"""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path
from typing import Any

from ..errors import ConfigError

INSTALL = "TensorBoard scalars need the tensorboard package: pip install 'wansync[tensorboard]'"
NOT_METRICS = ("type", "step", "time", "epoch", "strategy")


def check_available() -> None:
    """A one-line ConfigError when the tensorboard package is not installed."""
    if importlib.util.find_spec("tensorboard") is None:
        raise ConfigError(INSTALL)


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


class Scalars:
    """One run's scalars: `step`, `evaluation` and `sync` take the records metrics.jsonl holds."""

    def __init__(self, log_dir: str | Path, purge_step: int | None = None):
        """`purge_step`: a resumed run's first new step (TensorBoard hides the earlier run's events
        from there on, which the resumed run writes again)."""
        check_available()
        from torch.utils.tensorboard import SummaryWriter

        self._w = SummaryWriter(log_dir=str(log_dir), purge_step=purge_step)

    def _add(self, tag: str, value: Any, step: int) -> None:
        v = _number(value)
        if v is not None:
            self._w.add_scalar(tag, v, step)

    def step(self, record: dict[str, Any], exposed_s: float, exposed_pct: float, bytes_sent: int) -> None:
        step = int(record["step"])
        self._add("train/loss", record.get("loss"), step)
        self._add("train/lr", record.get("lr"), step)
        self._add("train/items_per_s", record.get("items_per_s"), step)
        self._add("comm/exposed_s", exposed_s, step)
        self._add("comm/exposed_pct", exposed_pct, step)
        self._add("comm/bytes_sent", bytes_sent, step)

    def evaluation(self, record: dict[str, Any]) -> None:
        for key, value in record.items():
            if key not in NOT_METRICS:
                self._add(f"eval/{key}", value, int(record["step"]))

    def sync(self, record: dict[str, Any], events: int) -> None:
        """A sync event, the `events`-th of the run."""
        step = int(record["step"])
        self._add("sync/events", events, step)
        self._add("sync/bytes", record.get("bytes"), step)
        self._add("sync/drift", record.get("drift"), step)

    def close(self) -> None:
        self._w.close()
