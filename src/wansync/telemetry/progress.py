"""Progress on the terminal: a one-line bar on a TTY, plain log lines otherwise (or --quiet)."""
from __future__ import annotations

import sys
import time
from typing import TextIO


class Progress:
    def __init__(self, total: int, *, every: int = 10, quiet: bool = False, stream: TextIO | None = None,
                 enabled: bool = True, prefix: str = ""):
        self.total, self.every, self.enabled, self.prefix = total, every, enabled, prefix
        self.stream = stream or sys.stdout
        self.tty = self.stream.isatty() and not quiet
        self._last_draw = 0.0

    def update(self, step: int, text: str) -> None:
        if not self.enabled:
            return
        if self.tty:
            now = time.monotonic()
            if now - self._last_draw < 0.1 and step != self.total:
                return
            self._last_draw = now
            width = 24
            filled = int(width * step / max(1, self.total))
            bar = "#" * filled + "-" * (width - filled)
            self.stream.write(f"\r{self.prefix}[{bar}] {step}/{self.total} {text}\x1b[K")
            self.stream.flush()
        elif step % self.every == 0 or step == self.total:
            self.log(f"step {step}/{self.total} {text}")

    def log(self, text: str) -> None:
        if not self.enabled:
            return
        if self.tty:
            self.stream.write("\r\x1b[K")
        self.stream.write(f"{self.prefix}{text}\n")
        self.stream.flush()

    def close(self) -> None:
        if self.enabled and self.tty:
            self.stream.write("\n")
            self.stream.flush()
