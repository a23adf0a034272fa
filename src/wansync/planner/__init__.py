"""The planner (`wansync plan`): predictions from the emulator's cost model and the strategies' own
schedules, for sizes and link settings this machine cannot run. See docs/planner.md.

The names below are imported from their modules on first use (`__getattr__`): those import torch,
and the command line's parser, `plan --help` included, reads only `keys.py`."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .prediction import Prediction, Setting, predict, recommend_h, setting
    from .sizes import ModelSize, flops_step_s, of_name, of_params
    from .choose import TARGET_PCT
    from .scale_table import large_table, print_large_table, table_preamble
    from .tables import plan_command

__all__ = [
    "Prediction",
    "Setting",
    "predict",
    "recommend_h",
    "setting",
    "ModelSize",
    "flops_step_s",
    "of_name",
    "of_params",
    "TARGET_PCT",
    "large_table",
    "print_large_table",
    "plan_command",
    "table_preamble",
]


def __getattr__(name: str) -> Any:
    """A name of `__all__`, from the first of the planner's modules that has it."""
    if name in __all__:
        for module in ("prediction", "sizes", "choose", "scale_table", "tables"):
            found = importlib.import_module(f".{module}", __name__)
            if hasattr(found, name):
                return getattr(found, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
