"""Paper presets: the settings of the papers' main experiments (spec/ALGORITHMS.md §7b and §9).

A preset is a set of config values plus the strategies and seeds to compare. It sits between the
defaults and the config file / flags (`defaults < preset < --config < flags`), so any value can be
overridden, e.g. `--preset cpdp-wan --data cifar100:/data/cifar-100-python`.
Values the spec does not give are marked "assumed" in `notes`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .errors import ConfigError


@dataclass(frozen=True)
class Preset:
    name: str
    source: str
    strategies: tuple[str, ...]
    seeds: int
    values: dict[str, Any]
    notes: tuple[str, ...] = field(default=())


PRESETS: dict[str, Preset] = {
    "cocodc-paper": Preset(
        name="cocodc-paper",
        source="CoCoDC (spec §7b, §9): 4 workers, 150M LLaMA-style LM on C4, H=100, tau=5, P=4, "
               "lambda=0.5, gamma=0.4; DiLoCo vs Streaming DiLoCo vs CoCoDC",
        strategies=("diloco", "streaming", "cocodc"),
        seeds=1,
        values={
            "workers": 4, "model": "150m", "data": "hf:allenai/c4", "tokenizer": "bpe", "bpe_vocab": 32000,
            "seq_len": 1024, "batch_size": 32, "optimizer": "adamw", "lr": 4e-4, "warmup_steps": 1000,
            "lr_schedule": "cosine", "weight_decay": 0.1, "steps": 15000, "eval_every": 500, "eval_batches": 64,
            "sync_every": 100, "overlap": 5, "fragments": 4, "lam": 0.5, "gamma": 0.4,
            "outer_lr": 0.7, "outer_momentum": 0.9, "checkpoint_every": 1000, "wan": "",
        },
        notes=("the paper simulates the delay in steps (tau=5), not a network: no --wan link by default",
               "assumed (not in the spec): seq_len 1024, batch 32 per worker, AdamW lr 4e-4 with 1000 warmup "
               "steps and cosine decay, weight decay 0.1, 15000 steps (the paper's runs reach ppl 20 "
               "after 10-13k steps), a 32k BPE trained locally",
               "C4 must be on this machine (`hf:allenai/c4` from the HF cache or a save_to_disk directory "
               "given with --data hf:PATH); wansync never downloads it"),
    ),
    "cpdp-wan": Preset(
        name="cpdp-wan",
        source="CPDP (spec §4, §9): ResNet-50 on CIFAR-100, 8 workers on two sites (16.6 ms RTT), global "
               "batch 1024, SGD lr 0.1, K=4, beta=0.3; DDP vs LocalSGD vs CPDP, 3 seeds",
        strategies=("ddp", "local_sgd", "cpdp"),
        seeds=3,
        values={
            "workers": 8, "wan": "two-site", "model": "resnet50", "data": "cifar100:data/cifar-100-python",
            "batch_size": 128, "optimizer": "sgd", "lr": 0.1, "momentum": 0.9, "weight_decay": 5e-4,
            "lr_schedule": "cosine", "warmup_steps": 0, "steps": 4900, "eval_every": 49, "eval_batches": 20,
            "augment": True, "sync_every": 4, "slowmo_beta": 0.3, "slowmo_lr": 1.0, "checkpoint_every": 490,
        },
        notes=("100 epochs of CIFAR-100 at global batch 1024 = 49 steps per epoch, 4900 steps; evaluation "
               "once per epoch",
               "assumed (not in the spec): SGD momentum 0.9, weight decay 5e-4, cosine schedule",
               "CIFAR-100 in its standard python format (cifar-100-python/ with train, test, meta) at "
               "data/cifar-100-python, or pass --data cifar100:PATH"),
    ),
}


def get(name: str) -> Preset:
    try:
        return PRESETS[name]
    except KeyError:
        raise ConfigError(f"unknown preset '{name}' (available: {', '.join(PRESETS)})") from None


def check_available(preset: Preset, strategies: list[str]) -> None:
    """A one-line error naming the preset's strategies that this build does not have (yet)."""
    from .strategies import STRATEGIES
    missing = [s for s in strategies if s not in STRATEGIES]
    if missing:
        raise ConfigError(f"preset {preset.name} needs strateg{'y' if len(missing) == 1 else 'ies'} "
                          f"{', '.join(missing)}, not available in this build (available: {', '.join(STRATEGIES)}); "
                          f"pick others with --strategies")
