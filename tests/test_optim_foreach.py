"""The inner optimizers wansync builds step with torch's foreach kernels (`trainer.muon.FOREACH`): on the
CPU torch's default is its per-parameter loop, and the two must give the same bits, or a run would differ
from the same run stepped by torch's defaults (every bitwise identity against torch leans on this)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from wansync.config import Config
from wansync.trainer.muon import FOREACH
from wansync.trainer.optim import build_optimizer
from wansync.workloads.lm.model import LMShape, TransformerLM


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(16, 8), nn.Linear(8, 12), nn.LayerNorm(12), nn.Linear(12, 16))


def loss(m: nn.Module, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(step)
    x = torch.randint(0, 16, (4, 5), generator=g)
    return nn.functional.cross_entropy(m(x).flatten(0, 1), torch.randint(0, 16, (20,), generator=g))


@pytest.mark.parametrize(
    "options",
    [
        {"optimizer": "adamw", "weight_decay": 0.1},
        {"optimizer": "sgd", "momentum": 0.9, "weight_decay": 1e-4},
        {"optimizer": "sgd", "momentum": 0.0, "weight_decay": 0.0},
    ],
    ids=lambda o: o["optimizer"] + ("+momentum" if o.get("momentum") else ""),
)
def test_the_built_optimizer_takes_the_foreach_kernels_and_torchs_default_loop_gives_the_same_bits(options):
    ours_model, theirs_model = model(), model()
    cfg = Config(strategy="diloco", lr=0.01, **options)
    ours = build_optimizer(cfg, ours_model)
    assert FOREACH and all(group["foreach"] is True for group in ours.param_groups)
    same = {k: v for k, v in ours.defaults.items() if k != "decoupled_weight_decay"}  # AdamW's own, not an argument
    theirs = type(ours)(theirs_model.parameters(), **{**same, "foreach": None})  # torch's default on the CPU
    for step in range(6):
        for m, o in ((ours_model, ours), (theirs_model, theirs)):
            o.zero_grad()
            loss(m, step).backward()
            o.step()
    assert all(torch.equal(a, b) for a, b in zip(ours_model.parameters(), theirs_model.parameters()))
    assert ours.state_dict()["state"].keys() == theirs.state_dict()["state"].keys()


def test_muons_adamw_part_takes_them_too():
    torch.manual_seed(0)
    m = TransformerLM(LMShape(dim=16, n_layers=2, n_heads=2, ffn_hidden=32, max_seq_len=8), vocab_size=32)
    opt = build_optimizer(Config(strategy="diloco", optimizer="muon", lr=0.01), m)
    parts = [p for p in (opt._muon, opt._adamw) if p is not None]
    assert any(isinstance(p, torch.optim.AdamW) and p.defaults["foreach"] is True for p in parts)
