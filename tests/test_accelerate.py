"""A loop written with `accelerate` under a strategy (examples/accelerate_loop.py, through
`wansync.integrations.accelerate.prepare`): 2 ranks with torchrun's variables, diloco, bf16. accelerate
shards the data and nothing else: no DDP wrapper of its own, every rank the same model at the end, a bf16
forward; what it must not prepare, and a world it miscounts, refused in one line."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any

import pytest

from wansync.runner.localgroup import run_ranks

pytest.importorskip("accelerate")
pytestmark = pytest.mark.timeout(180)

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "accelerate_loop.py"


def example() -> Any:
    spec = importlib.util.spec_from_file_location("accelerate_loop", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _refused(ex: Any, **settings: Any) -> str:
    """What prepare says of one setting: `cpu` for the Accelerator, `give` what is handed to prepare."""
    import torch
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    import wansync as ws
    from wansync.errors import ConfigError
    from wansync.integrations.accelerate import prepare

    AcceleratorState._reset_state(True)  # one Accelerator per process, as accelerate expects: a fresh one
    accelerator = Accelerator(mixed_precision=settings.get("mixed_precision", "bf16"), cpu=settings.get("cpu", True))
    model = ex.tiny_llama()
    optimizer = torch.optim.AdamW(model.parameters())
    sync = ws.strategy("diloco", model, optimizer, sync_every=4)
    given = {
        "data": torch.utils.data.DataLoader(range(8)),
        "model": model,
        "optimizer": optimizer,
        "scheduler": torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0),
    }[settings.get("give", "data")]
    try:
        prepare(accelerator, sync, given)
    except ConfigError as e:
        return str(e)
    return "accepted"


def _runs(rank: int, world: int) -> dict[str, Any]:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    ex = example()
    out = {"run": ex.train("diloco", steps=8)}
    out["refused"] = {
        name: _refused(ex, **settings)
        for name, settings in {
            "cpu=False": {"cpu": False},
            "fp16": {"mixed_precision": "fp16"},
            "model": {"give": "model"},
            "optimizer": {"give": "optimizer"},
            "scheduler": {"give": "scheduler"},
            "data": {},
        }.items()
    }
    return out


def test_an_accelerate_loop_in_bf16_trains_under_diloco_with_no_ddp_of_its_own_and_refuses_what_it_must():
    ranks = run_ranks(_runs, 2, timeout=150)
    runs = [r["run"] for r in ranks]
    for run in runs:
        assert run["processes"] == 2 and run["wrapped"] == "LlamaForCausalLM", run  # diloco's model: the user's
        assert run["forward_dtypes"] == ["torch.bfloat16"], run["forward_dtypes"]
        assert run["alike"] and run["bytes"] > 0 and run["losses"][-1] < run["losses"][0], run
    assert not set(runs[0]["seen"]) & set(runs[1]["seen"])  # each rank its own shard
    refused = ranks[0]["refused"]
    assert refused.pop("data") == "accepted"
    for name, message in refused.items():
        assert message.startswith("wansync.integrations.accelerate.prepare: ") and "\n" not in message, (name, message)
    assert "Accelerator(cpu=True)" in refused["cpu=False"] and "bf16" in refused["fp16"]
    assert "DDP" in refused["model"] and "sync.step()" in refused["optimizer"]
    assert "yourself" in refused["scheduler"]
