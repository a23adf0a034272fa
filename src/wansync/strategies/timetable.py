"""A strategy's timetable: when it communicates, from its options alone.

Every strategy follows its own (`Strategy.timetable`), and the planner predicts from the same object
built without a model or a process group (`strategies.timetable(name, options)`), so each rule of a
schedule is written once. This base class is the timetable of a strategy that exchanges after every
step and never all-reduces gradients over every rank; the periodic strategies' (`periodic.py` and
their subclasses) add boundaries, the fragment strategies' (`fragment_timetable.py`) the ordered
work of every step.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .options import Options


class Timetable:
    """Which steps communicate how; a strategy's `Timetable` class builds it from its options."""

    if TYPE_CHECKING:  # a strategy calls its own subclass's methods through `self.timetable: Timetable`

        def __getattr__(self, name: str) -> Any: ...

    def __init__(self, options: Options) -> None:
        self.opts = options

    def ddp_step(self, t: int) -> bool:
        """Does step t's backward all-reduce the gradients over every rank (DDP's phase)?"""
        return False

    def inside_step(self, t: int) -> bool:
        """Does step t all-reduce gradients inside a worker of several ranks only? (Not when it
        all-reduces them over every rank.)"""
        return not self.ddp_step(t)

    def is_boundary(self, t: int) -> bool:
        """Does step t end by averaging the workers' parameters (a periodic strategy's boundary)?"""
        return False

    def exchanges_at(self, t: int) -> bool:
        """Does step t (after its inner step) exchange between workers?"""
        return True

    def final_sync(self, t: int) -> bool:
        """Does `finish()` after step t exchange once more (a periodic strategy's last average)?"""
        return False
