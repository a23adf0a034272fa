"""The planner (`wansync plan`): predictions from the emulator's cost model and the strategies' own
schedules, for sizes and link settings this machine cannot run. See docs/planner.md."""

from .predict import Prediction, Setting, predict, recommend_h, setting
from .sizes import ModelSize, flops_step_s, of_name, of_params
from .tables import TARGET_PCT, large_table, plan_command, print_large_table, table_preamble

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
