"""Progress on the console: a tqdm bar (rate, ETA; a widget in a notebook) where a person watches,
plain log lines otherwise (a log file, CI, a pipe) or under --quiet.

On a terminal or in a Jupyter notebook the bar shows the step, the rate in steps per second, the
time left and the loss and throughput as its postfix; every other line (the link, evaluations)
is written above it. Elsewhere nothing is redrawn: one line every `every` steps and at the last
(`step 20/300 loss 2.345 51234 tok/s`), exactly as before tqdm. tqdm costs about 1 µs per update
between two redraws (at most ten a second), nothing next to a training step.
"""

from __future__ import annotations

import io
import os
import sys
from types import MappingProxyType
from typing import Any, TextIO


def in_notebook() -> bool:
    """Is this process a Jupyter kernel (whose output is not a TTY, yet a person watches it)?"""
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None and hasattr(ipython, "get_ipython") else None
    return shell is not None and "IPKernelApp" in getattr(shell, "config", {})


class Progress:
    def __init__(
        self,
        total: int | None,
        *,
        every: int = 10,
        quiet: bool = False,
        stream: TextIO | None = None,
        enabled: bool = True,
        prefix: str = "",
    ):
        """`total`: the last step (None: unknown, no ETA); `every`: the step interval of the plain
        lines; `enabled`: False on every rank but the first, which alone prints."""
        self.total, self.every, self.enabled, self.prefix = total, every, enabled, prefix
        self.stream = stream or sys.stdout
        self.notebook = not quiet and self.stream is sys.stdout and in_notebook()
        self.tty = not quiet and (self.stream.isatty() or self.notebook)
        self._bar: Any = None

    def _sized(self) -> bool:
        """Does the terminal tell its size? (A pseudo-terminal of 0 x 0, as `script` or a container
        gives, would have tqdm draw nothing: then 100 x 20 is assumed.)"""
        try:
            size = os.get_terminal_size(self.stream.fileno())
        except (OSError, ValueError, AttributeError, io.UnsupportedOperation):
            return False
        return size.columns > 0 and size.lines > 0

    def _open(self, step: int) -> Any:
        from tqdm import tqdm

        sized = self._sized()
        kwargs = dict(
            total=self.total,
            initial=max(0, step - 1),
            desc=self.prefix.strip() or None,
            unit="step",
            file=self.stream,
            dynamic_ncols=sized,
            ncols=None if sized else 100,
            nrows=None if sized else 20,
            mininterval=0.1,
        )
        if self.notebook:
            try:
                from tqdm.notebook import tqdm as widget

                return widget(**{k: v for k, v in kwargs.items() if k != "file"})
            except ImportError:  # no ipywidgets: the text bar in the cell's output
                pass
        return tqdm(**kwargs)

    def update(self, step: int, text: str) -> None:
        if not self.enabled:
            return
        if self.tty:
            if self._bar is None:
                self._bar = self._open(step)
            self._bar.set_postfix_str(text, refresh=False)
            self._bar.update(step - self._bar.n)
        elif step % self.every == 0 or step == self.total:
            self.log(f"step {step}/{self.total} {text}" if self.total else f"step {step} {text}")

    def log(self, text: str) -> None:
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.write(f"{self.prefix}{text}", file=self.stream)
            return
        self.stream.write(f"{self.prefix}{text}\n")
        self.stream.flush()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


# how evaluation lines print their metrics (any other number: 4 significant digits)
EVAL_FORMATS = MappingProxyType(
    {"val_loss": ".4f", "val_ppl": ".2f", "val_bpb": ".4f", "test_loss": ".4f", "test_acc": ".2f"}
)
NOT_METRICS = ("type", "step", "time", "epoch")


def eval_line(record: dict[str, Any]) -> str:
    """`step 50: val_loss 2.3456 val_ppl 10.44 val_bpb 3.3840` (the known metrics first)."""
    keys = [k for k in EVAL_FORMATS if k in record] + [
        k for k in record if k not in EVAL_FORMATS and k not in NOT_METRICS
    ]
    parts = [f"{k} {record[k]:{EVAL_FORMATS.get(k, '.4g')}}{'%' if k == 'test_acc' else ''}" for k in keys]
    return f"step {record['step']}: " + " ".join(parts)
