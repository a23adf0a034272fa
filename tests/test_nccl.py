"""The NCCL path (`--backend nccl`, one rank per GPU): CUDA tensors through NCCL, the few CPU ones
through gloo, under the emulator too. Skipped where torch sees no GPU (CI never has one)."""

from __future__ import annotations

import json

import pytest
import torch

from cli_harness import TINY, wansync

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"), pytest.mark.timeout(300)]
GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0


STRATEGIES = {
    "ddp": [],
    "diloco": ["--sync-every", "4"],
    "streaming": ["--sync-every", "4", "--fragments", "2", "--overlap", "1"],
}


@pytest.mark.parametrize("strategy", list(STRATEGIES))
@pytest.mark.parametrize("wan", ["", "cross-region"])
def test_a_run_on_nccl_trains_on_the_gpu_and_finishes(tmp_path, strategy, wan):
    workers = min(2, GPUS)
    if wan and workers == 1:  # one GPU: the emulator's NCCL wrapper at world size 1, one site
        wan = "rtt=10ms,bw=1gbit,sites=1"
    flags = ["--wan", wan] if wan else []
    r = wansync(
        "train",
        "--backend",
        "nccl",
        "--strategy",
        strategy,
        "--workers",
        str(workers),
        "--steps",
        "8",
        *STRATEGIES[strategy],
        "--quiet",
        *TINY,
        *flags,
        "--out",
        str(tmp_path / "run"),
        timeout=280,
    )
    assert r.returncode == 0, r.stderr
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["workers"] == workers and summary["final_val_loss"] < 6


@pytest.mark.skipif(GPUS < 4, reason="needs 4 GPUs: 2 workers of 2 ranks")
def test_workers_of_two_gpus_each_train_on_nccl(tmp_path):
    r = wansync(
        "train",
        "--backend",
        "nccl",
        "--strategy",
        "diloco",
        "--workers",
        "2",
        "--ranks-per-worker",
        "2",
        "--steps",
        "8",
        "--sync-every",
        "4",
        "--quiet",
        *TINY,
        "--out",
        str(tmp_path / "run"),
        timeout=280,
    )
    assert r.returncode == 0, r.stderr
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["ranks_per_worker"] == 2 and summary["bytes_inside_workers"] > 0


@pytest.mark.parametrize("strategy", list(STRATEGIES))
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_sharded_worker_trains_on_nccl(tmp_path, strategy, precision):
    """--inside fsdp on the GPUs there are (one worker of all of them, or 2 of half): FSDP2 on NCCL,
    bf16 through its mixed-precision policy, the outer state in pinned host memory."""
    per_worker = max(1, GPUS // 2)
    workers = 2 if GPUS >= 2 else 1
    extra = ["--outer-state-device", "cpu"] if strategy != "ddp" else []
    r = wansync(
        "train",
        "--backend",
        "nccl",
        "--inside",
        "fsdp",
        "--precision",
        precision,
        "--strategy",
        strategy,
        "--workers",
        str(workers),
        "--ranks-per-worker",
        str(per_worker),
        "--steps",
        "8",
        *STRATEGIES[strategy],
        *extra,
        "--checkpoint-every",
        "4",
        "--quiet",
        *TINY,
        "--out",
        str(tmp_path / "run"),
        timeout=280,
    )
    assert r.returncode == 0, r.stderr
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["inside"] == "fsdp" and summary["precision"] == precision and summary["final_val_loss"] < 6
