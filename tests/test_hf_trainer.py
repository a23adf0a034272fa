"""A Hugging Face Trainer under a wansync strategy (`wansync.integrations.hf`, run through
examples/hf_trainer.py): one `sync.step()` per optimizer step, the exposed share and bytes in the
Trainer's logs, the same model on every rank at the end, a checkpoint that resumes bit for bit, the
Trainer's own DDP never wrapped around the model under torchrun, conflicting settings refused.

Practitioner's runs under torchrun (2 ranks on the CPU, one launch for all: tests/hf_trainer_checks.py;
the strategies' runs first, then the others under the emulated cross-region link): the Trainer's world
is the process group's, bf16 and torch_compile are honoured, the Trainer's own collectives are exposed
communication, `wansync report` reads the run, the last checkpoint is the final model, and a resume of
another run is refused in one line."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest

import netns
from cli_harness import forked_script

pytestmark = pytest.mark.timeout(150)

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "hf_trainer.py"
CHECKS = ROOT / "tests" / "hf_trainer_checks.py"
STRATEGIES = ("diloco", "streaming", "sparseloco")


def _run(cmd: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
    )
    try:
        stdout, stderr = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)


def _one_process(args: list[str]) -> subprocess.CompletedProcess:
    """What `_run` gives for the example's command line, without an interpreter's start-up and torch's
    import (3 s of its 5)."""
    return forked_script(EXAMPLE, args, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=240)


@pytest.fixture(scope="module")
def launched(tmp_path_factory: Any, forked_python: Any) -> dict[str, Any]:
    """One torchrun launch for every check below (tests/hf_trainer_checks.py: its runs; torchrun and its
    workers forked from tests/forked_python.py's stand-in), then its diloco checkpoint resumed by one
    process, with the example's command line."""
    out = tmp_path_factory.mktemp("hf")
    done = _run(
        [forked_python.executable, str(netns.TORCHRUN), "--standalone", "--nproc-per-node", "2", str(CHECKS), str(out)],
        forked_python.env,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    one = _one_process(
        ["--strategy", "diloco", "--steps", "16", "--out", str(out / "one-process"),
         "--resume", str(out / "logs40" / "checkpoint-12")]
    )  # fmt: skip
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    return {"out": out, "ranks": ranks, "one_process": one}


@pytest.mark.timeout(300)
def test_strategies_log_their_exposed_share_and_bytes_and_resume_bit_for_bit(launched):
    """In the torchrun launch, before its runs under the emulated link (hf_trainer_checks.py: strategies):
    torchrun's variables, as the Trainer reads them, shard the data between the ranks and would wrap the
    model in the Trainer's own DDP."""
    ranks = [r["strategies"] for r in launched["ranks"]]
    for s in STRATEGIES:
        mine = [r[s] for r in ranks]
        steps = [h for h in mine[0]["logs"] if "loss" in h]
        assert [h["step"] for h in steps] == list(range(1, 13)) and mine[0]["t"] == 12
        assert all("wansync/exposed_pct" in h and "wansync/bytes" in h for h in steps), steps[0]
        sent = [h["wansync/bytes"] for h in steps]
        # sync_every 4: nothing sent before the first round's end, more after each round
        assert sent[0] == 0 and sent[-1] > sent[3] > 0 and sorted(sent) == sent, (s, sent)
        assert all(0 <= h["wansync/exposed_pct"] < 100 for h in steps)
        assert steps[-1]["loss"] < steps[0]["loss"]
        assert mine[0]["params"] == mine[1]["params"], f"{s}: ranks differ after finish()"
        # the interrupted run stopped at 8; resumed, it ends where the straight run did, bit for bit
        assert [r["stopped_at"] for r in mine] == [8, 8] and [r["resumed_t"] for r in mine] == [12, 12]
        for r in mine:
            assert r["resumed"] == r["params"], f"{s}: the resumed run's parameters differ"
        checkpoint = launched["out"] / "strategies" / f"{s}-resumed" / "checkpoint-8"
        assert sorted(p.name for p in checkpoint.glob("wansync_rank*.pt")) == ["wansync_rank0.pt", "wansync_rank1.pt"]
    ddp = {n: [h["wansync/bytes"] for h in logs if "loss" in h] for n, logs in ranks[0]["ddp"].items()}
    assert ddp["1"] == ddp["2"] and len(ddp["2"]) == 4 and ddp["2"][0] > 0, ddp
    for refused in ranks[0]["refused"]:
        assert refused.startswith("WansyncTrainer: the strategy owns the communication") and "\n" not in refused
    assert "load_best_model_at_end" in ranks[0]["refused"][0] and "FSDP" in ranks[0]["refused"][1]


@pytest.mark.timeout(300)
def test_the_trainers_world_is_the_process_groups_and_the_ranks_see_disjoint_batches(launched):
    """docs/hf_trainer.md's settings, without use_cpu=True, on the CPU under torchrun: accelerate would
    see one process per rank, each training on every batch. Two micro-batches a step: one sync.step()
    per optimizer step, through StrategyModule, not accelerate's DDP."""
    mine = [r["snippet"] for r in launched["ranks"]]
    for rank, r in enumerate(mine):
        assert (r["world"], r["trainer_world"], r["processes"], r["process_index"]) == (2, 2, 2, rank), r
        assert r["sync_steps"] == 12 and r["trained_module"] == "StrategyModule"
        assert len(r["rows"]) == 12 * 2 * 4 == len(set(r["rows"]))  # steps x micro-batches x batch
    assert not set(mine[0]["rows"]) & set(mine[1]["rows"])


@pytest.mark.timeout(300)
def test_the_final_saved_model_is_the_ranks_final_model_for_streaming(launched):
    """The last checkpoint is saved after the final sync: its model.safetensors hashes as every rank's
    final parameters (streaming's fragment in flight at the last step merged)."""
    mine = [r["snippet"] for r in launched["ranks"]]
    assert mine[0]["final"] == mine[1]["final"] == mine[0]["saved"] and mine[0]["saved_keys"] > 0


@pytest.mark.timeout(300)
def test_bf16_gives_a_bf16_forward_and_torch_compile_a_compiled_graph(launched):
    for r in launched["ranks"]:
        precision = r["precision"]
        assert precision["dtypes"] == ["torch.bfloat16"], precision
        assert precision["graphs"] >= 1 and precision["forward_restored"], precision
        assert len(precision["loss"]) == 4 and precision["loss"][-1] < precision["loss"][0]


@pytest.mark.timeout(300)
def test_under_cross_region_logging_every_step_raises_the_exposed_share(launched):
    """The Trainer's loss and FLOs gathers at each log step cross the emulated link: exposed, not data
    (booked as data, the share fell as the wall clock grew). Over both ranks: on a loaded machine one
    rank's waits for the other move between them from run to run."""
    ranks = launched["ranks"]
    assert all((r["logs1"]["logged"], r["logs40"]["logged"]) == (12, 0) for r in ranks)
    every, once = (sum(r[f"logs{n}"]["exposed_pct"] for r in ranks) / len(ranks) for n in (1, 40))
    assert every > once + 5, [(r["logs1"], r["logs40"]) for r in ranks]


@pytest.mark.timeout(300)
def test_wansync_report_on_a_trainer_run_shows_loss_wall_clock_exposed_share_and_bytes(launched):
    from wansync.analysis.report import report

    run = launched["out"] / "snippet-run"
    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in steps if r["type"] == "step"] == [4, 8, 12]  # logging_steps=4: the training loss
    assert [r["step"] for r in steps if r["type"] == "eval"] == [12]  # the final model's, after the last sync
    rep = report(run, plots=False)  # what `wansync report RUN` does
    row = rep.rows[0]
    assert not rep.failed and row["status"] == "ok", row
    figures = ("final_mean", "wall_clock_s_mean", "exposed_comm_pct_mean", "bytes_sent_mean")  # val loss first
    assert all(isinstance(row.get(k), float) and row[k] > 0 for k in figures), row


@pytest.mark.timeout(300)
def test_a_resume_under_another_strategy_options_or_world_is_refused_in_one_line_with_nothing_trained(launched):
    """The check run_dir= continues a run by (`rundir.claim.differs`), on the checkpoint's own files."""
    expected = {
        "sparseloco": "its strategy is 'diloco', this run's 'sparseloco'",
        "options": "its option sync_every is 4, this run's 8",
        "streaming": "its strategy is 'diloco', this run's 'streaming'",
    }
    for r in launched["ranks"]:
        for case, why in expected.items():
            found = r["resumes"][case]
            assert found["error"].startswith("WansyncTrainer: cannot resume from ") and why in found["error"]
            assert "\n" not in found["error"]
            assert (found["sync_steps"], found["losses"], found["saved"]) == (0, [], []), (case, found)
    one = launched["one_process"]
    assert one.returncode == 1 and "Traceback" not in one.stderr, one.stderr[-3000:]
    line = [x for x in one.stderr.splitlines() if x.startswith("hf_trainer.py: ")]
    assert len(line) == 1 and "its workers is 2, this run's 1" in line[0], one.stderr[-3000:]
    assert not list((launched["out"] / "one-process").glob("checkpoint-*"))
