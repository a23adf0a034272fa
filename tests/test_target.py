"""Time to target, computed from the evaluation records of a metrics file."""

import json

import pytest

from wansync.rundir.target import Target, first_reached, given_target, read_evals, target_record


@pytest.fixture
def metrics(tmp_path):
    """A synthetic metrics.jsonl: steps, evaluations (loss falling, not monotonically), a torn last line."""
    records = [
        {"type": "step", "step": 1, "loss": 5.0, "time": 0.1},
        {"type": "eval", "step": 50, "time": 10.0, "val_loss": 3.0, "test_acc": 40.0},
        {"type": "sync", "step": 50, "bytes": 100},
        {"type": "eval", "step": 100, "time": 21.5, "val_loss": 2.4, "test_acc": 61.0},
        {"type": "eval", "step": 150, "time": 30.0, "val_loss": 2.6, "test_acc": 58.0},
        {"type": "eval", "step": 200, "time": 41.0, "val_loss": 2.0, "test_acc": 70.0},
    ]
    path = tmp_path / "metrics.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in records) + '\n{"type": "eval", "ste')
    return path


def test_only_the_evaluation_records_are_read_and_a_torn_line_is_skipped(metrics):
    assert [e["step"] for e in read_evals(metrics)] == [50, 100, 150, 200]
    assert read_evals(metrics.parent / "missing.jsonl") == []


def test_a_loss_target_is_reached_at_the_first_evaluation_at_or_below_it(metrics):
    evals = read_evals(metrics)
    assert first_reached(evals, Target("val_loss", 2.5, False, "")) == (100, 21.5)
    assert first_reached(evals, Target("val_loss", 2.4, False, "")) == (100, 21.5)  # equal counts
    assert first_reached(evals, Target("val_loss", 2.1, False, "")) == (200, 41.0)


def test_an_accuracy_target_is_reached_at_the_first_evaluation_at_or_above_it(metrics):
    assert first_reached(read_evals(metrics), Target("test_acc", 60.0, True, "")) == (100, 21.5)


def test_a_target_never_reached_says_so(metrics):
    record = target_record(read_evals(metrics), Target("val_loss", 1.5, False, "given (--target-loss)"))
    assert record == {
        "metric": "val_loss",
        "value": 1.5,
        "source": "given (--target-loss)",
        "reached": False,
        "step": None,
        "time_s": None,
    }


def test_the_given_target_follows_the_workload_kind():
    assert given_target(2.5, 80.0, "lm") == Target("val_loss", 2.5, False, "given (--target-loss)")
    assert given_target(2.5, 80.0, "vision") == Target("test_acc", 80.0, True, "given (--target-acc)")
    assert given_target(None, 80.0, "lm") is None and given_target(2.5, None, "vision") is None
