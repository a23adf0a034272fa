"""benchmarks/planner_validation.py's split of a run's exposed time into the host's part and the link's."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "planner_validation.py"


@pytest.fixture(scope="module")
def validation():
    spec = importlib.util.spec_from_file_location("planner_validation", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def coll(measured, modelled, exposed):
    return {"measured_s": measured, "modelled_s": modelled, "exposed_s": exposed, "bytes": 4_000_000}


def test_the_host_owns_a_collectives_lateness_up_to_the_time_it_was_exposed(validation):
    prof = {"events": [{"per_collective": [coll(0.5, 0.2, 0.4),      # 0.3 late, 0.4 exposed: 0.3
                                           coll(0.5, 0.2, 0.1)]},    # 0.3 late, 0.1 exposed: 0.1
                       {"per_collective": [coll(0.2, 0.2, 0.2),      # on time (the link model's): 0
                                           coll(0.1, 0.3, 0.0),      # hidden, earlier than modelled: 0
                                           coll(None, 0.2, 0.2)]}]}  # not completed in the step: 0
    assert validation.host_exposed_s(prof) == pytest.approx(0.4)


def test_a_run_that_followed_its_link_model_has_no_host_part(validation):
    prof = {"events": [{"per_collective": [coll(0.3, 0.3, 0.3), coll(0.8, 0.8, 0.1)]}]}
    assert validation.host_exposed_s(prof) == 0.0
    assert validation.host_rate(prof) == float("inf")
