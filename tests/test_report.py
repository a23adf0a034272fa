"""report.py / plots.py on hand-made run directories (no training): numbers, targets, plots, errors."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import pytest

from wansync.analysis import report as R
from wansync.cli import main
from wansync.analysis.plots import pareto_front, use_log_scale

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def fake_run(
    d: Path,
    strategy: str,
    seed: int,
    curve: list[float],
    *,
    wall: float = 10.0,
    exposed: float = 1.0,
    bytes_sent: int = 1000,
    sync_events: int = 0,
    vision: bool = False,
) -> Path:
    """A finished run directory as `wansync train` writes it; evaluations every 10 steps, 1 s apart."""
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.toml").write_text(f'[run]\nstrategy = "{strategy}"\nseed = {seed}\n')
    key = "test_acc" if vision else "val_loss"
    lines = []
    for i, v in enumerate(curve):
        lines.append(
            json.dumps(
                {"type": "step", "step": 10 * i + 1, "loss": 5.0, "lr": 1e-3, "items_per_s": 1.0, "time": float(i)}
            )
        )
        rec = {"type": "eval", "step": 10 * (i + 1), "time": float(i + 1), key: v}
        rec.update({"test_loss": 1.0} if vision else {"val_ppl": math.exp(v)})
        lines.append(json.dumps(rec))
    (d / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    summary = {
        "strategy": strategy,
        "seed": seed,
        "workers": 4,
        "steps": 10 * len(curve),
        "wall_clock_s": wall,
        "model": "resnet18" if vision else "tiny",
        "data": "x",
        "bytes_sent": bytes_sent,
        "sync_events": sync_events,
    }
    if vision:
        summary.update(final_test_acc=curve[-1], peak_test_acc=max(curve), final_test_loss=1.0)
    else:
        summary.update(
            final_val_loss=curve[-1],
            best_val_loss=min(curve),
            final_val_ppl=math.exp(curve[-1]),
            best_val_ppl=math.exp(min(curve)),
        )
    (d / "summary.json").write_text(json.dumps(summary))
    cats = {
        "compute": wall - exposed - 1.0,
        "exposed_comm": exposed,
        "sync_math": 0.5,
        "data": 0.2,
        "eval": 0.3,
        "checkpoint": 0.0,
        "other": 0.0,
    }
    (d / "profile.json").write_text(
        json.dumps({"wall_clock_s": wall, "categories_s": cats, "sum_s": wall, "residual_s": 0.0, "residual_pct": 0.0})
    )
    return d


def rows(path: Path) -> dict[str, dict[str, str]]:
    with open(path, newline="") as f:
        return {r["setting"]: r for r in csv.DictReader(f)}


@pytest.fixture
def lm_exp(tmp_path):
    root = tmp_path / "exp"
    fake_run(root / "ddp" / "seed0", "ddp", 0, [3.0, 2.5, 2.0], wall=20, exposed=8, bytes_sent=10**9)
    fake_run(root / "ddp" / "seed1", "ddp", 1, [3.0, 2.6, 2.2], wall=22, exposed=8, bytes_sent=10**9)
    fake_run(
        root / "local_sgd" / "seed0",
        "local_sgd",
        0,
        [3.1, 2.05, 2.1],
        wall=10,
        exposed=1,
        bytes_sent=10**6,
        sync_events=4,
    )
    fake_run(
        root / "local_sgd" / "seed1",
        "local_sgd",
        1,
        [3.1, 2.3, 2.12],
        wall=12,
        exposed=1,
        bytes_sent=10**6,
        sync_events=4,
    )
    fake_run(
        root / "diloco" / "seed0", "diloco", 0, [3.5, 3.2, 3.0], wall=9, exposed=0.5, bytes_sent=10**5, sync_events=1
    )
    return root


def test_lm_numbers_and_default_target(lm_exp):
    rep = R.report(lm_exp, plots=False)
    # DDP's final validation loss: mean(2.0, 2.2) = 2.1, target 2.1 x 1.01 = 2.121
    assert rep.target == pytest.approx(2.121)
    assert "DDP's final validation loss" in rep.target_source
    r = rows(lm_exp / "summary.csv")
    assert list(r) == ["ddp", "diloco", "local_sgd"]
    assert float(r["ddp"]["final_mean"]) == pytest.approx(2.1)
    assert float(r["ddp"]["final_std"]) == pytest.approx(math.sqrt(0.02))
    assert float(r["ddp"]["final_ppl_mean"]) == pytest.approx((math.exp(2.0) + math.exp(2.2)) / 2, rel=1e-5)
    # seed 0 reaches 2.121 at step 30, seed 1 (final 2.2) never does
    assert float(r["ddp"]["steps_to_target_mean"]) == 30 and r["ddp"]["reached_target"] == "1"
    assert float(r["local_sgd"]["steps_to_target_mean"]) == 25 and float(r["local_sgd"]["time_to_target_s_mean"]) == 2.5
    assert r["diloco"]["reached_target"] == "0" and r["diloco"]["steps_to_target_mean"] == ""
    assert float(r["ddp"]["exposed_comm_pct_mean"]) == pytest.approx(100 * (8 / 20 + 8 / 22) / 2, rel=1e-5)
    assert float(r["local_sgd"]["sync_events_mean"]) == 4 and float(r["ddp"]["bytes_sent_mean"]) == 1e9
    assert r["diloco"]["final_std"] == ""  # one seed: no std
    assert all(x["status"] == "ok" for x in r.values())
    md = (lm_exp / "report.md").read_text()
    assert "not reached (0/1)" in md and "| 30 (1/2) " in md and "2.1 ± 0.14" in md and "final val ppl" in md
    assert len(list(csv.DictReader(open(lm_exp / "runs.csv")))) == 5


def test_the_runner_records_the_target_in_every_summary(lm_exp):
    R.report(lm_exp, plots=False)
    assert "target" not in json.loads((lm_exp / "ddp" / "seed0" / "summary.json").read_text())  # the report reads
    R.report(lm_exp, plots=False, record_targets=True)
    ddp0, ddp1, sgd0 = (
        json.loads((lm_exp / d / "summary.json").read_text()) for d in ("ddp/seed0", "ddp/seed1", "local_sgd/seed0")
    )
    assert ddp0["target"]["value"] == pytest.approx(2.121) and "DDP's final" in ddp0["target"]["source"]
    assert (ddp0["target"]["step"], ddp0["target"]["time_s"], ddp0["target"]["reached"]) == (30, 3.0, True)
    assert ddp1["target"]["reached"] is False and ddp1["target"]["step"] is None
    assert (sgd0["target"]["step"], sgd0["target"]["time_s"]) == (20, 2.0)


def test_bits_per_byte_are_reported_beside_loss_and_perplexity(tmp_path):
    run = fake_run(tmp_path / "exp" / "ddp" / "seed0", "ddp", 0, [3.0, 2.0])
    summary = json.loads((run / "summary.json").read_text())
    (run / "summary.json").write_text(json.dumps({**summary, "final_val_bpb": 1.25}))
    R.report(tmp_path / "exp", plots=False)
    assert rows(tmp_path / "exp" / "summary.csv")["ddp"]["final_bpb_mean"] == "1.25"
    assert "final val bpb" in (tmp_path / "exp" / "report.md").read_text()


def test_plots_are_valid_pngs(lm_exp):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.image as mpimg

    rep = R.report(lm_exp)
    assert [p.name for p in rep.plots] == [
        "loss_vs_step.png",
        "loss_vs_wallclock.png",
        "pareto.png",
        "time_breakdown.png",
        "bytes.png",
        "exposed_over_time.png",
    ]
    for p in rep.plots:
        assert p.read_bytes()[:8] == PNG_SIGNATURE
        img = mpimg.imread(p)
        assert img.shape[0] > 200 and img.shape[1] > 300
        assert img.std() > 0.05  # not a blank canvas


def test_the_exposed_share_over_time_is_each_windows_exposed_seconds_over_its_time():
    from wansync.analysis.plots import exposed_share

    steps = [{"step": i + 1, "time": float(i + 1), "exposed_s": 0.1 if i < 10 else 0.5} for i in range(20)]
    steps.append({"step": 21, "time": 21.0})  # an older run's record: no exposed_s, passed over
    xs, ys = exposed_share(steps, 2)
    assert xs[0] == 3.0 and ys[0] == pytest.approx(10.0)  # steps 2, 3: 0.2 s of the 2 s between steps 1 and 3
    assert ys[-1] == pytest.approx(50.0) and len(xs) == 18


def test_explicit_target_and_no_ddp(tmp_path):
    root = tmp_path / "exp"
    fake_run(root / "a" / "seed0", "local_sgd", 0, [3.0, 2.0])
    fake_run(root / "b" / "seed0", "diloco", 0, [3.0, 2.5])
    rep = R.report(root, plots=False)
    assert rep.target == pytest.approx(2.0 * 1.01) and "best setting" in rep.target_source
    rep = R.report(root, target_loss=2.6, plots=False)
    assert rep.target == 2.6
    r = rows(root / "summary.csv")
    assert r["a"]["steps_to_target_mean"] == "20" and r["b"]["steps_to_target_mean"] == "20"


def test_vision_reports_accuracy(tmp_path):
    root = tmp_path / "exp"
    fake_run(root / "ddp" / "seed0", "ddp", 0, [40.0, 60.0, 70.0], vision=True)
    fake_run(root / "cpdp" / "seed0", "cpdp", 0, [45.0, 69.5, 69.0], vision=True)
    rep = R.report(root)
    assert rep.quality.kind == "vision" and rep.target == pytest.approx(70.0 * 0.99)
    r = rows(root / "summary.csv")
    assert float(r["cpdp"]["best_mean"]) == 69.5 and float(r["cpdp"]["final_mean"]) == 69.0
    assert r["cpdp"]["steps_to_target_mean"] == "20" and r["ddp"]["steps_to_target_mean"] == "30"
    assert "peak test acc %" in rep.table and "final val ppl" not in rep.table
    assert [p.name for p in rep.plots][:2] == ["accuracy_vs_step.png", "accuracy_vs_wallclock.png"]


def test_failed_and_incomplete_runs_are_rows(tmp_path):
    root = tmp_path / "exp"
    fake_run(root / "ddp" / "seed0", "ddp", 0, [3.0, 2.0])
    fake_run(root / "cpdp" / "seed0", "cpdp", 0, [3.0, 2.1])
    (root / "cpdp" / "seed1").mkdir(parents=True)
    (root / "cpdp" / "seed1" / "failed.json").write_text(json.dumps({"message": "rank 1 was killed by SIGKILL"}))
    (root / "bad" / "seed0").mkdir(parents=True)
    (root / "bad" / "seed0" / "failed.json").write_text(
        json.dumps({"strategy": "x", "message": "data path not found: /d"})
    )
    (root / "cut" / "seed0").mkdir(parents=True)
    (root / "cut" / "seed0" / "config.toml").write_text('[run]\nstrategy = "ddp"\n')
    (root / "cut" / "seed0" / "metrics.jsonl").write_text('{"type": "step", "step": 1}\n{"type": "ev')
    rep = R.report(root, plots=False)
    r = rows(root / "summary.csv")
    assert r["bad"]["status"] == "failed: data path not found: /d"
    assert r["cpdp"]["status"] == "partial: 1/2 seeds failed: rank 1 was killed by SIGKILL"
    assert r["cpdp"]["seeds_ok"] == "1" and float(r["cpdp"]["final_mean"]) == 2.1
    assert r["cut"]["status"].startswith("failed: incomplete")
    assert len(rep.failed) == 3 and "## Failed runs" in rep.path.read_text()


def test_a_single_run_directory(tmp_path):
    d = fake_run(tmp_path / "run", "local_sgd", 0, [3.0, 2.0])
    rep = R.report(d, plots=False)
    assert list(rows(d / "summary.csv")) == ["run"] and rep.path == d / "report.md"


def test_pareto_front_and_log_scale():
    pts = [(10, 2.0), (5, 2.5), (20, 1.9), (12, 2.6), (5, 3.0)]  # (time, loss)
    assert pareto_front(pts, higher_is_better=False) == [1, 0, 2]
    assert pareto_front([(10, 70.0), (5, 60.0), (12, 65.0)], higher_is_better=True) == [1, 0]
    assert use_log_scale([1e9, 1e6]) and not use_log_scale([10, 50]) and not use_log_scale([0, 1e9])


def _cli(capsys, *argv):
    with pytest.raises(SystemExit) as e:
        main(list(argv))
    return e.value.code, capsys.readouterr()


def test_report_cli(lm_exp, capsys):
    code, out = _cli(capsys, "report", str(lm_exp), "--target-loss", "2.4")
    assert code == 0, out.err
    assert "| ddp " in out.out and f"report: {lm_exp / 'report.md'}" in out.out and "plot: " in out.out
    assert "validation loss ≤ 2.4" in (lm_exp / "report.md").read_text()


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda p: p.mkdir(), "report: no runs found under"),
        (lambda p: (p.mkdir(), (p / "notes.txt").write_text("hi"), (p / "sub").mkdir()), "report: no runs found under"),
        (lambda p: None, "report: directory not found:"),
        (lambda p: p.write_text("x"), "is not a directory"),
    ],
)
def test_report_on_nothing_is_one_line(tmp_path, capsys, make, message):
    target = tmp_path / "d"
    make(target)
    code, out = _cli(capsys, "report", str(target))
    assert code != 0 and out.err.startswith("wansync: error: ") and message in out.err
    assert len(out.err.strip().splitlines()) == 1


def test_report_on_nothing_from_the_shell(tmp_path):
    from cli_harness import wansync

    r = wansync("report", str(tmp_path), timeout=150)
    assert r.returncode == 1 and r.stderr.startswith("wansync: error: report: no runs found under")
    assert len(r.stderr.strip().splitlines()) == 1


def test_the_loss_curve_marks_the_exchanges_a_fault_tolerant_run_had_a_worker_missing(tmp_path):
    import matplotlib.image as mpimg

    images = []
    for name, short in (("whole", []), ("short", [10, 20])):
        d = fake_run(tmp_path / name / "diloco" / "seed0", "diloco", 0, [3.0, 2.5, 2.0])
        summary = json.loads((d / "summary.json").read_text())
        (d / "summary.json").write_text(json.dumps({**summary, "short_exchanges": short}))
        images.append(mpimg.imread(next(p for p in R.report(tmp_path / name).plots if p.name == "loss_vs_step.png")))
    assert images[0].shape != images[1].shape or (images[0] != images[1]).any()
