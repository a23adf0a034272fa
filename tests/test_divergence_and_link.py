"""A model that became NaN is a failure, files stay valid JSON, and the emulated link cannot hang
a run (issue 16, items 5 and 6)."""

from __future__ import annotations

import json
import math
import time

import pytest

from cli_harness import TINY, wansync

pytestmark = pytest.mark.timeout(180)


def test_an_outer_step_that_overflows_ends_the_run_non_zero_under_abort(tmp_path):
    """The last boundary's outer step leaves no later loss to catch the divergence: the anchor
    check must (an outer learning rate beyond float32 overflows the step itself)."""
    out = tmp_path / "run"
    r = wansync(
        "train",
        *TINY,
        "--workers",
        "2",
        "--steps",
        "2",
        "--strategy",
        "diloco",
        "--sync-every",
        "2",
        "--outer-lr",
        "1e300",
        "--outer-momentum",
        "0",
        "--out",
        str(out),
    )
    assert r.returncode != 0
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "non-finite" in lines[0], r.stderr
    assert not (out / "summary.json").exists()
    for line in (out / "metrics.jsonl").read_text().splitlines():
        json.loads(line, parse_constant=lambda c: pytest.fail(f"bare {c} in metrics.jsonl"))


def test_json_files_hold_null_where_a_value_is_not_finite():
    from wansync.rundir import jsonout

    text = jsonout.dumps({"loss": math.nan, "nested": [math.inf, {"x": -math.inf}], "ok": 1.5})
    assert json.loads(text, parse_constant=lambda c: pytest.fail(c)) == {
        "loss": None,
        "nested": [None, {"x": None}],
        "ok": 1.5,
    }


def test_metrics_lines_write_null_for_nan(tmp_path):
    from wansync.telemetry.metrics import MetricsWriter

    w = MetricsWriter(tmp_path / "m.jsonl")
    w.write({"type": "step", "loss": math.nan, "extra": {"x": math.inf}})
    w.close()
    assert json.loads((tmp_path / "m.jsonl").read_text()) == {"type": "step", "loss": None, "extra": {"x": None}}


def test_a_link_whose_exchange_outlasts_the_peer_timeout_is_refused_at_start(tmp_path):
    t0 = time.monotonic()
    try:
        r = wansync(
            "train",
            *TINY,
            "--workers",
            "2",
            "--steps",
            "2",
            "--wan",
            "rtt=10ms,bw=1kbit",
            "--peer-timeout",
            "30",
            "--out",
            str(tmp_path / "run"),
            timeout=90,
        )
    except Exception as e:  # the run hung
        pytest.fail(f"the run did not end: {type(e).__name__}")
    assert r.returncode != 0
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "beyond --peer-timeout 30 s" in lines[0] and "one exchange of" in lines[0], r.stderr
    assert time.monotonic() - t0 < 60


def test_the_start_says_what_one_exchange_costs_on_the_link(tmp_path):
    r = wansync(
        "train", *TINY, "--workers", "2", "--steps", "1", "--wan", "two-site", "--quiet", "--out", str(tmp_path / "run")
    )
    assert r.returncode == 0, r.stderr
    line = next(x for x in r.stdout.splitlines() if "one exchange of" in x)
    assert "link two-site: one exchange of" in line and "MB takes ~" in line and "(modelled)" in line


def test_every_emulated_wait_is_bounded_by_the_timeout():
    """A collective whose modelled end lies beyond the timeout fails at once instead of sleeping."""
    from torch.futures import Future
    from wansync.net import Emulator, parse_wan
    from wansync.net.records import CollectiveRecord

    emu = Emulator(parse_wan("lan"), timeout=0.5)
    now = time.perf_counter()
    rec = CollectiveRecord(
        op="allreduce", nbytes=8, group="0", seq=0, issue=now, start=now, modelled_s=3600.0, modelled_end=now + 3600.0
    )
    fut: Future = Future()
    t0 = time.monotonic()
    emu.schedule([], rec, fut, None, False)
    with pytest.raises(Exception, match="beyond the peer timeout of 0.5 s"):
        fut.wait()
    assert time.monotonic() - t0 < 5
