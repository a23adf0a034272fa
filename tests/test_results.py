"""`make results` (wansync results): every table, cell and seed is listed by the dry run, nothing is
trained; the page's verdicts come from the intervals over seeds."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from wansync import results
from wansync.cli import main
from wansync.analysis.runs import Run, SettingRuns
from wansync.analysis.stats import NO_DIFFERENCE


def dry(capsys, out: Path, *extra: str) -> str:
    with pytest.raises(SystemExit) as e:
        main(["results", "--dry-run", "--out", str(out), *extra])
    assert e.value.code == 0
    return capsys.readouterr().out


def test_the_dry_run_lists_every_table_every_cell_and_every_seed_without_training(capsys, tmp_path):
    runs = tmp_path / "results"
    out = dry(capsys, runs)
    for t in results.TABLES:
        assert f"== {t.name}:" in out
        root = runs / (t.reads or t.name)
        for c in t.cells:
            lab = results.label(c["strategy"], **{k: v for k, v in c.items() if k != "strategy"})
            for seed in range(results.SEEDS):
                assert str(root / lab / f"seed{seed}") in out, (t.name, lab, seed)
    assert "total: 186 runs in 15 tables" in out and "estimated" in out
    assert not runs.exists() or not any(runs.rglob("summary.json"))


def test_the_dry_run_covers_the_tables_the_issue_asks_for():
    names = {t.name for t in results.TABLES}
    assert {
        "cpdp-k-sweep",
        "cpdp-beta",
        "cpdp-lr-protocol",
        "cpdp-ablation",
        "cpdp-profile",
        "cocodc-main",
        "cocodc-matched",
        "cocodc-merge",
        "cocodc-schedule",
        "cocodc-outer-lr",
        "staleness",
        "slow-worker",
    } <= names
    assert all(len(t.cells) >= 2 for t in results.TABLES)


def test_the_staleness_table_differs_only_in_the_merge_at_one_n_and_one_order():
    """Issue 37: α-merge, Taylor, damped and eager at the same N and fragment order, and DiLoCo."""
    (t,) = results.catalog.get(["staleness"])
    overlapped = [c for c in t.cells if c["strategy"] == "cocodc"]
    merges = [c.get("compensation", "eager" if c.get("eager") else None) for c in overlapped]
    assert merges == ["alpha", "taylor", "damped", "eager"] and [c["strategy"] for c in t.cells][-1] == "diloco"
    rest = [{k: v for k, v in c.items() if k not in ("compensation", "eager")} for c in overlapped]
    assert all(r == rest[0] for r in rest) and rest[0]["syncs_per_period"] == 8
    assert rest[0]["schedule"] == "round_robin" and t.values["wan"] == "cross-region"


def test_a_table_trained_alone_takes_its_target_from_its_own_runs(monkeypatch):
    """Before cocodc-main's runs exist, the LM target is the highest final loss over the LM runs on disk."""
    from wansync.results import measures

    def runs(name: str, finals: list[float]) -> list[SettingRuns]:
        done = [Run(Path(name), name, "cocodc", seed, {}, "ok", {"final_val_loss": v}) for seed, v in enumerate(finals)]
        return [SettingRuns(name, "cocodc", {}, done)] if done else []

    monkeypatch.setattr(measures, "load", lambda root, name: runs(name, {"staleness": [3.1, 3.4]}.get(name, [])))
    assert measures.lm_target(Path("root")) == 3.4
    monkeypatch.setattr(
        measures, "load", lambda root, name: runs(name, {"staleness": [3.1, 3.4], "cocodc-main": [2.9]}.get(name, []))
    )
    assert measures.lm_target(Path("root")) == 2.9


def test_every_question_names_cells_of_its_own_table():
    for t in results.TABLES:
        labels = {results.label(c["strategy"], **{k: v for k, v in c.items() if k != "strategy"}) for c in t.cells}
        for q in t.questions:
            assert q.a in labels | {""} and q.b in labels | {""}, (t.name, q.text)
            assert q.metric in results.METRICS


def test_the_cocodc_tables_measure_the_papers_taylor_merge_not_the_default():
    for t, specs, _ in results.table_runs(results.TABLES, Path("runs/results"), 1, None):
        for spec in specs:
            # staleness sets every merge itself; the sparse tables run cocodc at its demo settings (damped)
            if spec.cfg.strategy == "cocodc" and t.name.startswith("cocodc"):
                assert spec.cfg.compensation in ("taylor", "alpha"), (t.name, spec.label)


def test_a_cell_two_tables_share_is_trained_once():
    planned = results.table_runs(results.TABLES, Path("runs/results"), 3, None)
    shared = {t.name: sum(s) for t, _, s in planned}
    assert shared["cpdp-k-sweep"] == 0 and shared["cpdp-beta"] == 3  # beta 0.3 at K = 4 is the sweep's K = 4
    assert shared["cocodc-matched"] == 3  # CoCoDC at N = 8 is cocodc-main's


def test_an_unknown_table_is_one_line_and_a_nonzero_exit(capsys):
    with pytest.raises(SystemExit) as e:
        main(["results", "--dry-run", "--only", "nope"])
    assert e.value.code == 1
    assert "unknown results table 'nope' (available: cpdp-k-sweep" in capsys.readouterr().err


def test_only_one_table_also_lists_the_table_it_reads(capsys, tmp_path):
    out = dry(capsys, tmp_path / "results", "--only", "cpdp-profile")
    assert "== cpdp-k-sweep:" in out and "== cpdp-profile:" in out and "== cocodc-main:" not in out


def _setting(label: str, values: list[float], strategy: str = "cpdp") -> SettingRuns:
    runs = [
        Run(Path(f"/x/{label}/seed{i}"), label, strategy, i, {}, "ok", {"peak_test_acc": v})
        for i, v in enumerate(values)
    ]
    return SettingRuns(label, strategy, {}, runs)


def test_overlapping_intervals_answer_no_difference_at_this_scale():
    q = results.Question("K = 16 against K = 4?", "peak_acc", "a", "b")
    line = results.answer(q, [_setting("a", [85.0, 86.0, 85.5]), _setting("b", [85.4, 86.2, 85.1])], None)
    assert NO_DIFFERENCE.capitalize() in line


def test_separated_intervals_name_the_better_setting():
    q = results.Question("K = 16 against K = 4?", "peak_acc", "a", "b")
    line = results.answer(q, [_setting("a", [80.0, 80.2, 80.1]), _setting("b", [85.0, 85.1, 85.2])], None)
    assert "b is better than a (Welch's t-test p < 0.001; the 95 % intervals do not overlap)" in line


def test_the_best_setting_lists_the_ones_it_cannot_be_told_from():
    q = results.Question("best?", "peak_acc", "")
    line = results.answer(
        q,
        [_setting("a", [80.0, 80.2, 80.1]), _setting("b", [85.0, 85.1, 85.2]), _setting("c", [84.0, 86.0, 85.0])],
        None,
    )
    assert (
        line.startswith("*Best?* b: 85.1 ± 0.25 (peak test acc %). It is")
        and "not distinguishable at this scale from c (Welch p = 0.88)" in line
    )
    alone = results.answer(q, [_setting("a", [80.0, 80.2, 80.1]), _setting("b", [85.0, 85.1, 85.2])], None)
    assert alone.endswith("It is better than every other setting (Welch's t-test against each: p < 0.001).")


def test_a_cell_not_run_yet_is_said_so():
    q = results.Question("q", "peak_acc", "a", "missing")
    assert "Not answerable: missing: not run yet" in results.answer(q, [_setting("a", [1.0, 2.0, 3.0])], None)


def test_the_page_is_rewritten_only_between_its_markers(tmp_path):
    page = tmp_path / "results.md"
    page.write_text(f"# Results\n\nhand-written head\n\n{results.BEGIN}\nold\n{results.END}\n\n## Earlier runs\nkept\n")
    results.write_page(page, f"{results.BEGIN}\nnew\n{results.END}\n")
    text = page.read_text()
    assert "hand-written head" in text and "new" in text and "old" not in text and "## Earlier runs\nkept" in text


def test_the_page_lists_every_table_with_its_command_before_anything_ran(tmp_path):
    text = results.document(results.TABLES, tmp_path / "none")
    for t in results.TABLES:
        assert f"### {t.name}:" in text and f"wansync results --only {t.reads or t.name}" in text
    assert text.count("**The paper**") == text.count("**It cannot show**") == len(results.TABLES)


def test_a_table_with_no_runs_here_keeps_the_section_the_page_recorded(tmp_path):
    """Training one table (`--only`) rewrites that table's section: the others keep what the page had,
    not empty rows (their runs were made elsewhere, or earlier)."""
    recorded = (Path(__file__).resolve().parents[1] / "docs" / "results.md").read_text()
    text = results.document(results.TABLES, tmp_path / "none", old=recorded)
    from wansync.results.page import old_sections

    before, after = old_sections(recorded), old_sections(text)
    assert before and all(after[name] == lines for name, lines in before.items())
    fresh = results.document(results.TABLES, tmp_path / "none")
    assert "Not run yet" in "\n".join(old_sections(fresh)["cpdp-k-sweep"])


def test_the_fragment_sequence_and_its_longest_repeat_come_from_the_sync_events(tmp_path):
    d = tmp_path / "run"
    d.mkdir()
    recs = [
        {"type": "sync", "kind": "fragment", "step": i + 5, "fragment": p, "lam_term_rel": 0.002}
        for i, p in enumerate([0, 0, 0, 1, 2, 3])
    ] + [{"type": "sync", "kind": "final", "step": 99, "fragment": 1}]
    (d / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in recs) + "\n")
    run = Run(d, "cocodc", "cocodc", 0, {}, "ok")
    assert [e["fragment"] for e in results.sync_events(run)] == [0, 0, 0, 1, 2, 3]
    assert results.METRICS["longest_repeat"].value(run, None) == 3
    assert results.METRICS["lam_term_rel"].value(run, None) == pytest.approx(0.002)
    assert results.longest_repeat([]) == 0 and results.longest_repeat([1, 2, 1]) == 1


def test_a_smoke_run_writes_its_page_into_its_own_out_never_the_real_one(tmp_path, monkeypatch):
    """`results --steps 1 --seeds 1` (a smoke test of the pipeline) used to rewrite docs/results.md with empty
    rows; it now writes OUT/results.md, and the full tables' page stays as it was."""
    import wansync.results as R

    monkeypatch.chdir(tmp_path)
    (tmp_path / "docs").mkdir()
    real = tmp_path / "docs" / "results.md"
    real.write_text("# the recorded page\n")
    monkeypatch.setattr(R, "run_tables", lambda *a, **k: [])  # nothing trains: the page's rule alone
    assert R.run_results(["cpdp-k-sweep"], str(tmp_path / "runs"), None, seeds=1, steps=1) == 0
    assert real.read_text() == "# the recorded page\n"
    assert (tmp_path / "runs" / "results.md").read_text().startswith(R.BEGIN)
    assert R.run_results(["cpdp-k-sweep"], str(tmp_path / "runs"), None) == 0  # the full tables: the page
    assert real.read_text().startswith("# the recorded page\n") and R.BEGIN in real.read_text()


@pytest.mark.parametrize("dry", [True, False])
def test_results_refuses_an_out_that_holds_the_users_files(tmp_path, dry):
    from wansync.errors import WansyncError
    import wansync.results as R

    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("mine\n")
    with pytest.raises(WansyncError, match="refusing to write into .*mine: it holds 'notes.txt'"):
        R.run_results(["cpdp-k-sweep"], str(out), str(tmp_path / "p.md"), seeds=1, steps=1, dry=dry)
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]


def test_the_dry_run_counts_finished_runs_out_of_what_is_left_to_train(capsys, tmp_path):
    """A resumed `make results` skips finished runs: the dry run says how many and leaves them out of its estimate."""
    import tomli_w

    from wansync import strategies
    from wansync.config import to_sections
    from wansync.results.runs import table_specs

    runs = tmp_path / "results"
    before = dry(capsys, runs, "--only", "cpdp-k-sweep")
    spec = table_specs(next(t for t in results.TABLES if t.name == "cpdp-k-sweep"), runs)[0]
    spec.run_dir.mkdir(parents=True)
    options = strategies.resolve_options(spec.cfg.strategy, vars(spec.cfg))
    (spec.run_dir / "config.toml").write_text(tomli_w.dumps(to_sections(spec.cfg, options)))
    (spec.run_dir / "summary.json").write_text(json.dumps({"final_val_loss": 1.0}))
    after = dry(capsys, runs, "--only", "cpdp-k-sweep")
    assert "1 finished already" in after and "1 finished already" not in before
    assert "total: 21 runs in 1 tables, 1 finished, 20 to train" in after, after[-400:]
    minutes = [int(text.split("estimated ")[1].split(" min")[0]) for text in (before, after)]
    assert minutes[1] < minutes[0]


def test_the_estimate_counts_the_workers_and_a_padded_slow_worker_they_wait_for(tmp_path):
    """A run's estimate grows with the workers sharing the cores, and where a topology pads steps to an
    emulated time (half-speed: 0.4 s, the slow worker 0.8 s) it never undercuts that: every worker
    waits for the slowest under `wait`; `balanced` lets the others step at full speed."""
    from wansync.results.runs import run_cost, table_specs

    slow = next(t for t in results.TABLES if t.name == "slow-worker")
    cost = {(s.label.rsplit("=", 1)[1], s.cfg.strategy): run_cost(s, "lm") for s in table_specs(slow, tmp_path)}
    steps = table_specs(slow, tmp_path)[0].cfg.steps
    assert cost["wait", "diloco"] >= steps * 0.8 > cost["balanced", "diloco"] >= steps * 0.4
    demo = next(t for t in results.TABLES if t.name == "sparse-demo")
    two = table_specs(demo, tmp_path)[0]
    assert two.cfg.workers == 2 and run_cost(two, "lm") < cost["balanced", "diloco"]
