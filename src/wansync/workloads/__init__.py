"""Pick the workload from the model name: LM sizes or vision architectures."""
from __future__ import annotations

from typing import Any

from ..errors import ConfigError
from .base import Workload

VISION_MODELS = ("cnn", "resnet18", "resnet50", "vit_s")


def lm_model_names() -> tuple[str, ...]:
    from .lm import LM_MODELS
    return tuple(LM_MODELS)


def build_workload(cfg: Any, rank: int, world_size: int) -> Workload:
    """The workload a Config asks for, sharded for this rank."""
    if cfg.model in VISION_MODELS:
        from .vision import build_vision_workload
        data = "fashion-mnist" if cfg.data == "shakespeare" else cfg.data
        return build_vision_workload(cfg.model, data, rank=rank, world_size=world_size, seed=cfg.seed,
                                     batch_size=cfg.batch_size, eval_batches=cfg.eval_batches,
                                     augment=cfg.augment, width=cfg.width)
    if cfg.model in lm_model_names():
        from .lm import build_lm_workload
        return build_lm_workload(cfg.model, cfg.data, rank=rank, world_size=world_size, seed=cfg.seed,
                                 batch_size=cfg.batch_size, seq_len=cfg.seq_len, tokenizer=cfg.tokenizer,
                                 eval_batches=cfg.eval_batches, val_fraction=cfg.val_fraction,
                                 bpe_vocab=cfg.bpe_vocab, cache_dir=str(cfg.out))
    raise ConfigError(f"unknown model '{cfg.model}' (LM: {', '.join(lm_model_names())}; "
                      f"vision: {', '.join(VISION_MODELS)})")
