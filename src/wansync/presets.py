"""Paper presets: the settings of the papers' main experiments (CPDP, Ettifouri et al. 2026,
arXiv:2607.21224; CoCoDC, Zhu et al. 2025, arXiv:2504.17672).

A preset is a set of config values plus the strategies and seeds to compare. It sits between the
defaults and the config file / flags (`defaults < preset < --config < flags`), so any value can be
overridden, e.g. `--preset cpdp-wan --data cifar100:/data/cifar-100-python`.
Values the papers do not give are marked "assumed" in `notes`.

A preset may also list its `runs`: explicit cells (config values with a "strategy"), each one setting
of the experiment, e.g. `{"strategy": "cpdp", "sync_every": 8}`. `compare/sweep --preset` then runs
those cells instead of strategies x grid; the runner treats them as plain config values (it knows no
strategy). Keys a cell sets cannot also be given as flags (use `--grid KEY=...`, which replaces them).
Every preset's notes state its LR rule.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from .config import Config, build_config, load_toml
from .errors import ConfigError


@dataclass(frozen=True)
class Preset:
    name: str
    source: str
    strategies: tuple[str, ...]
    seeds: int
    values: Mapping[str, Any]
    notes: tuple[str, ...] = field(default=())
    runs: tuple[dict[str, Any], ...] = field(default=())  # explicit cells; empty = strategies x grid

    def swept_keys(self) -> list[str]:
        """Config keys the cells set (strategy excluded)."""
        return list(dict.fromkeys(k for c in self.runs for k in c if k != "strategy"))


# CPDP at small scale: the small CNN on Fashion-MNIST, 4 workers on the two-site
# link (16.6 ms RTT), per-worker batch 64 = global batch 256 (234.4 steps per epoch), 3 epochs, SGD
# lr 0.1 (the paper's), cosine decay; evaluation on the full test set at every epoch end.
CPDP_SMALL: Mapping[str, Any] = MappingProxyType(
    {
        "workers": 4,
        "wan": "two-site",
        "model": "cnn",
        "width": 1.0,
        "data": "fashion-mnist",
        "batch_size": 64,
        "augment": False,
        "optimizer": "sgd",
        "lr": 0.1,
        "lr_scaling": "none",
        "momentum": 0.9,
        "weight_decay": 5e-4,
        "lr_schedule": "cosine",
        "warmup_steps": 0,
        "steps": 704,
        "eval_every": 1_000_000,
        "eval_batches": 157,
        "sync_every": 4,
        "slowmo_beta": 0.3,
        "slowmo_lr": 1.0,
    }
)
_SMALL_NOTES = (
    "small scale (assumed, not the paper's): small CNN (--model cnn; or --model resnet18 --width 0.25) on "
    "Fashion-MNIST, 4 workers, --wan two-site, 3 epochs = 704 steps of per-worker batch 64, no augmentation; "
    "SGD momentum 0.9, weight decay 5e-4, cosine schedule without warmup",
    "evaluation: the full 10k test set at every epoch end (eval_every is only a cap); the report's peak test "
    "accuracy is the paper's metric",
    "1 seed by default (--seeds 3 for the paper's protocol)",
)
_FIXED_256 = (
    "LR rule: fixed lr 0.1 (--lr-scaling none); at global batch 256 linear scaling "
    "(lr = 0.1 x global batch / 256) gives the same 0.1, so both protocols coincide here"
)


def _cells(strategy: str, key: str, values: tuple[Any, ...]) -> tuple[dict[str, Any], ...]:
    return tuple({"strategy": strategy, key: v} for v in values)


def _strategies(runs: tuple[dict[str, Any], ...]) -> tuple[str, ...]:
    return tuple(dict.fromkeys(c["strategy"] for c in runs))


_PAPER_PRESETS = (
    Preset(
        name="cocodc-paper",
        source="CoCoDC (Zhu et al. 2025, arXiv:2504.17672): 4 workers, 150M LLaMA-style LM on C4, H=100, tau=5, P=4, "
        "lambda=0.5, gamma=0.4; DiLoCo vs Streaming DiLoCo vs CoCoDC",
        strategies=("diloco", "streaming", "cocodc"),
        seeds=1,
        values={
            "workers": 4,
            "model": "150m",
            "data": "hf:allenai/c4",
            "tokenizer": "bpe",
            "bpe_vocab": 32000,
            "seq_len": 1024,
            "batch_size": 32,
            "optimizer": "adamw",
            "lr": 4e-4,
            "warmup_steps": 1000,
            "lr_schedule": "cosine",
            "weight_decay": 0.1,
            "steps": 15000,
            "eval_every": 500,
            "eval_batches": 64,
            "sync_every": 100,
            "overlap": 5,
            "fragments": 4,
            "lam": 0.5,
            "gamma": 0.4,
            "outer_lr": 0.7,
            "outer_momentum": 0.9,
            "checkpoint_every": 1000,
            "wan": "",
            # the paper's algorithm, pinned: argmax-R_p choice, the Taylor merge, one full outer step per
            # merge, N <= 2P = 8
            "schedule": "adaptive",
            "compensation": "taylor",
            "outer_scaling": "none",
            "max_syncs_per_fragment": 2,
        },
        notes=(
            "the paper simulates the delay in steps (tau=5), not a network: no --wan link by default",
            "N from gamma is capped at 2P = 8, the paper's N (its rule alone reaches H on a fast link)",
            "assumed (not in the spec): seq_len 1024, batch 32 per worker, AdamW lr 4e-4 with 1000 warmup "
            "steps and cosine decay, weight decay 0.1, 15000 steps (the paper's runs reach ppl 20 "
            "after 10-13k steps), a 32k BPE trained locally",
            "C4 must be on this machine (`hf:allenai/c4` from the HF cache or a save_to_disk directory "
            "given with --data hf:PATH); wansync never downloads it",
        ),
    ),
    Preset(
        name="cpdp-wan",
        source="CPDP (Ettifouri et al. 2026, arXiv:2607.21224): ResNet-50 on CIFAR-100, 8 workers on two sites (16.6 ms RTT), global "
        "batch 1024, SGD lr 0.1, K=4, beta=0.3; DDP vs LocalSGD vs CPDP, 3 seeds",
        strategies=("ddp", "local_sgd", "cpdp"),
        seeds=3,
        values={
            "workers": 8,
            "wan": "two-site",
            "model": "resnet50",
            "data": "cifar100:data/cifar-100-python",
            "batch_size": 128,
            "optimizer": "sgd",
            "lr": 0.1,
            "momentum": 0.9,
            "weight_decay": 5e-4,
            "lr_schedule": "cosine",
            "warmup_steps": 0,
            "steps": 4900,
            "eval_every": 49,
            "eval_batches": 20,
            "augment": True,
            "sync_every": 4,
            "slowmo_beta": 0.3,
            "slowmo_lr": 1.0,
            "checkpoint_every": 490,
        },
        notes=(
            "100 epochs of CIFAR-100 at global batch 1024 = 49 steps per epoch, 4900 steps; evaluation "
            "once per epoch",
            "assumed (not in the spec): SGD momentum 0.9, weight decay 5e-4, cosine schedule",
            "CIFAR-100 in its standard python format (cifar-100-python/ with train, test, meta) at "
            "data/cifar-100-python, or pass --data cifar100:PATH",
        ),
    ),
)

_K_RUNS = ({"strategy": "ddp"},) + _cells("cpdp", "sync_every", (1, 2, 4, 8, 16, 32))
_BETA_RUNS = _cells("cpdp", "slowmo_beta", (0.0, 0.3, 0.9))
_LR_RUNS = tuple({"strategy": s, "lr_scaling": r} for s in ("ddp", "local_sgd", "cpdp") for r in ("none", "linear"))
_ABLATION_RUNS = (
    {"strategy": "ddp"},
    {"strategy": "local_sgd"},
    {"strategy": "slowmo"},
    {"strategy": "cpdp", "slowmo_beta": 0.0},
    {"strategy": "cpdp", "slowmo_beta": 0.3},
)

_SMALL_PRESETS = (
    Preset(
        name="cpdp-k-sweep",
        source="CPDP's K sweep (arXiv:2607.21224) at small scale: CPDP with K = 1, 2, 4, 8, 16, 32 (beta 0.3), DDP "
        "as the reference for accuracy and wall clock; the paper sees K = 4 best and K >= 16 collapse",
        strategies=_strategies(_K_RUNS),
        seeds=1,
        values=CPDP_SMALL,
        runs=_K_RUNS,
        notes=(
            _FIXED_256,
            *_SMALL_NOTES,
            "K = 1 with beta 0.3 is not DDP (the SlowMo filter still acts); K = 1, beta 0 would be",
        ),
    ),
    Preset(
        name="cpdp-beta",
        source="CPDP's SlowMo coefficient (arXiv:2607.21224) at small scale: CPDP K = 4 with beta = 0, 0.3, 0.9; "
        "the paper finds 0.3 best and 0.9 collapsing (gain alpha/(1-beta) = 10x at 0.9)",
        strategies=_strategies(_BETA_RUNS),
        seeds=1,
        values=CPDP_SMALL,
        runs=_BETA_RUNS,
        notes=(_FIXED_256, *_SMALL_NOTES),
    ),
    Preset(
        name="cpdp-lr-protocol",
        source="the CPDP review's falsifier (fixed vs linearly scaled LR) at small scale: DDP, LocalSGD and CPDP (K = 4, "
        "beta 0.3) at global batch 1024 under a fixed lr 0.1 and under linear scaling, lr = 0.1 x "
        "1024 / 256 = 0.4, including the K = 4 cell under linear scaling the paper does not report",
        strategies=_strategies(_LR_RUNS),
        seeds=1,
        values={**CPDP_SMALL, "batch_size": 256, "steps": 176},
        runs=_LR_RUNS,
        notes=(
            "LR rule, per cell: lr_scaling=none is the paper's fixed lr 0.1; lr_scaling=linear is lr = 0.1 x "
            "global batch / 256 = 0.4 at 4 workers x 256 (the review's 'LR=0.4' protocol)",
            "per-worker batch 256 (global 1024, as the paper's WAN runs): 58.6 steps per epoch, 3 epochs = "
            "176 steps; otherwise as the other small-scale presets",
            *_SMALL_NOTES[1:],
            "the claim fails if ddp__lr_scaling=linear reaches CPDP's peak accuracy under linear scaling",
        ),
    ),
    Preset(
        name="cpdp-ablation",
        source="the CPDP review's attribution question at small scale, all at K = 4: DDP, LocalSGD, "
        "LocalSGD+SlowMo (slowmo, beta 0.3, alpha 1), CPDP beta = 0 (gradient all-reduce + plain "
        "averaging), CPDP beta = 0.3; does phase 1 or the SlowMo filter carry CPDP's gain?",
        strategies=_strategies(_ABLATION_RUNS),
        seeds=1,
        values=CPDP_SMALL,
        runs=_ABLATION_RUNS,
        notes=(
            _FIXED_256,
            *_SMALL_NOTES,
            "slowmo takes the preset's slowmo_beta 0.3 and slowmo_lr 1.0, i.e. CPDP beta 0.3 without "
            "phase 1 (the same as cpdp --no-grad-phase)",
        ),
    ),
)

PRESETS: Mapping[str, Preset] = MappingProxyType({p.name: p for p in (*_PAPER_PRESETS, *_SMALL_PRESETS)})


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
        raise ConfigError(
            f"preset {preset.name} needs strateg{'y' if len(missing) == 1 else 'ies'} "
            f"{', '.join(missing)}, not available in this build (available: {', '.join(STRATEGIES)}); "
            f"pick others with --strategies"
        )


def layered_config(lowest: Mapping[str, Any], config_file: str | None, flags: Mapping[str, Any]) -> Config:
    """defaults < lowest (a default out, a preset) < the --config file < flags."""
    values = dict(lowest)
    if config_file is not None:  # --config '' is refused, not ignored
        values.update(load_toml(config_file))
    values.update(flags)
    return build_config(None, values)


def preset_cells(
    preset: Preset | None, grid: Mapping[str, Any], flags: Mapping[str, Any], strategies: list[str] | None
) -> list[dict[str, Any]] | None:
    """The preset's run cells (None when it has none or `--grid strategy=` replaces them);
    `strategies` (--strategies) keeps the cells of those strategies (a strategy without a cell runs
    the preset's values)."""
    if preset is None or not preset.runs or "strategy" in grid:
        return None
    clash = [k for k in preset.swept_keys() if k in flags and k not in grid]
    if clash:
        values = ", ".join(dict.fromkeys(str(c[clash[0]]) for c in preset.runs if clash[0] in c))
        raise ConfigError(
            f"--{clash[0].replace('_', '-')} is swept by preset {preset.name} ({values}); "
            f"change its values with --grid {clash[0]}=V1,V2"
        )
    cells = [dict(c) for c in preset.runs]
    if strategies is not None:
        cells = [c for c in cells if c["strategy"] in strategies]
        cells += [{"strategy": s} for s in strategies if not any(c["strategy"] == s for c in cells)]
    return cells
