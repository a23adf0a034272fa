"""A Hugging Face Trainer under a wansync strategy (`wansync.integrations.hf`, run through
examples/hf_trainer.py): one `sync.step()` per optimizer step, the exposed share and bytes in the
Trainer's logs, the same model on every rank at the end, a checkpoint that resumes bit for bit, the
Trainer's own DDP never wrapped around the model under torchrun, conflicting settings refused."""

from __future__ import annotations

import gc
import importlib.util
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from wansync.runner.localgroup import run_ranks

pytestmark = pytest.mark.timeout(150)

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "hf_trainer.py"
STRATEGIES = ("diloco", "streaming", "sparseloco")


def example() -> Any:
    spec = importlib.util.spec_from_file_location("hf_trainer_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def params(model: Any) -> dict[str, Any]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _refused(ex: Any, root: str, **settings: Any) -> str:
    import transformers

    from wansync.errors import ConfigError

    args = transformers.TrainingArguments(output_dir=root, use_cpu=True, report_to=[], max_steps=1, **settings)
    try:
        ex.WansyncTrainer(model=ex.tiny_llama(), args=args, train_dataset=ex.Bytes("abcd" * 5000), strategy="diloco")
    except ConfigError as e:
        return str(e)
    return "accepted"


def _runs(rank: int, world: int, root: str) -> dict[str, Any]:
    """Every strategy 12 steps straight, then 8 steps with a checkpoint and a new Trainer resumed from it
    to 12; then two settings the adapter refuses. torchrun's variables, as the Trainer reads them: it
    shards the data between the ranks and would wrap the model in its own DDP."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    ex = example()
    # every Trainer's train() ends in accelerate's gc.collect(): over the millions of objects torch and
    # transformers made at import, about a second each, eleven times; frozen, the collections pass over them
    gc.freeze()
    out: dict[str, Any] = {}
    for s in STRATEGIES:
        straight = ex.train(s, f"{root}/{s}")
        out[s] = {"logs": straight.state.log_history, "params": params(straight.model), "t": straight.sync.t}
        stopped = ex.train(s, f"{root}/{s}-resumed", stop_at=8)
        out[s]["stopped_at"] = stopped.sync.t
        resumed = ex.train(s, f"{root}/{s}-resumed", resume=f"{root}/{s}-resumed/checkpoint-8")
        out[s]["resumed"] = params(resumed.model)
        out[s]["resumed_t"] = resumed.sync.t
    # ddp, 2 micro-batches a step: the first under no_sync(), so the link carries what one batch's step does
    out["ddp"] = {n: ex.train("ddp", f"{root}/ddp{n}", steps=4, accumulation=n).state.log_history for n in (1, 2)}
    out["refused"] = [
        _refused(ex, f"{root}/refused", load_best_model_at_end=True, eval_strategy="steps", save_strategy="steps"),
        _refused(ex, f"{root}/refused", fsdp="full_shard"),
    ]
    return out


def equal(a: dict[str, Any], b: dict[str, Any]) -> bool:
    import torch

    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_strategies_log_their_exposed_share_and_bytes_and_resume_bit_for_bit(tmp_path):
    ranks = run_ranks(_runs, 2, str(tmp_path), timeout=120)
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
        assert equal(mine[0]["params"], mine[1]["params"]), f"{s}: ranks differ after finish()"
        # the interrupted run stopped at 8; resumed, it ends where the straight run did, bit for bit
        assert [r["stopped_at"] for r in mine] == [8, 8] and [r["resumed_t"] for r in mine] == [12, 12]
        for r in mine:
            assert equal(r["resumed"], r["params"]), f"{s}: the resumed run's parameters differ"
        assert sorted(p.name for p in (tmp_path / f"{s}-resumed" / "checkpoint-8").glob("wansync_rank*.pt")) == [
            "wansync_rank0.pt",
            "wansync_rank1.pt",
        ]
    ddp = {n: [h["wansync/bytes"] for h in logs if "loss" in h] for n, logs in ranks[0]["ddp"].items()}
    assert ddp[1] == ddp[2] and len(ddp[2]) == 4 and ddp[2][0] > 0, ddp
    for refused in ranks[0]["refused"]:
        assert refused.startswith("WansyncTrainer: the strategy owns the communication") and "\n" not in refused
    assert "load_best_model_at_end" in ranks[0]["refused"][0] and "FSDP" in ranks[0]["refused"][1]


def test_under_torchrun_with_accumulation_the_strategy_steps_once_per_optimizer_step(tmp_path):
    """torchrun's environment: accelerate sees two processes, shards the data, and would wrap the model
    in its own DDP; the adapter hands it the strategy's module instead."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        str(EXAMPLE),
        "--strategy",
        "diloco",
        "--accumulation",
        "2",
        "--out",
        str(tmp_path / "run"),
        "--params-out",
        str(tmp_path / "params"),
    ]
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    try:
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, stderr[-3000:]
    result = json.loads([line for line in stdout.splitlines() if line.startswith("{")][-1])
    assert result["world"] == 2 and result["step"] == 12 and result["sync_steps"] == 12  # 24 micro-batches
    assert result["trained_module"] == "StrategyModule"  # not accelerate's DDP
    steps = [h for h in result["log_history"] if "loss" in h]
    assert len(steps) == 12 and steps[-1]["wansync/bytes"] > steps[3]["wansync/bytes"] > 0
    import torch

    assert equal(torch.load(tmp_path / "params.rank0"), torch.load(tmp_path / "params.rank1"))
