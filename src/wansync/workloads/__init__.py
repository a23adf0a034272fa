"""Pick the workload from the model name: LM sizes or vision architectures."""
from __future__ import annotations

import dataclasses
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Callable, TypeVar

from ..errors import ConfigError

if TYPE_CHECKING:               # importing this package stays torch-free (config.py uses the names below)
    from .base import Workload

VISION_MODELS = ("cnn", "resnet18", "resnet50", "vit_s")
# The dataset a run gets when none is given: it follows the model kind (config.build_config applies it).
DEFAULT_DATA = MappingProxyType({"lm": "shakespeare", "vision": "fashion-mnist"})
VISION_DATA_PREFIXES = ("fashion-mnist", "cifar100", "cifar10", "imagefolder")
VISION_DATA_FORMS = "fashion-mnist | fashion-mnist:PATH | cifar100:PATH | cifar10:PATH | imagefolder:PATH"
# Rank 0 sets this store key once its one-off preparation (a BPE, its token files) is on disk.
LEADER_DONE_KEY = "wansync/workload-prepared"
# How long the other ranks wait for it: training a BPE on a large corpus takes minutes, far beyond
# the peer timeout that guards the collectives.
LEADER_WAIT_S = 3600.0
T = TypeVar("T")


def model_kind(model: str) -> str:
    """'vision' for the vision architectures, else 'lm' (unknown names are rejected elsewhere)."""
    return "vision" if model in VISION_MODELS else "lm"


def is_vision_data(data: str) -> bool:
    name, sep, path = data.partition(":")
    name = name.strip().lower()
    return name == "fashion-mnist" or (bool(sep) and bool(path) and name in VISION_DATA_PREFIXES)


def check_data_kind(model: str, data: str) -> None:
    """One-line ConfigError when the dataset does not fit the model kind (LM text vs images)."""
    from pathlib import Path
    if model_kind(model) == "lm":
        if is_vision_data(data):
            raise ConfigError(f"model '{model}' is a language model and cannot train on the image dataset "
                              f"{data!r}; use a vision model (--model {' | '.join(VISION_MODELS)}) or a text "
                              f"corpus (--data shakespeare | PATH | hf:NAME)")
        return
    if is_vision_data(data):
        return
    name = data.partition(":")[0].strip().lower()
    if data == DEFAULT_DATA["lm"] or data.startswith("hf:") or Path(data).exists():
        raise ConfigError(f"vision model '{model}' needs an image dataset, got {data!r}, a text corpus "
                          f"(image directories are named with a prefix; --data {VISION_DATA_FORMS})")
    if name in VISION_DATA_PREFIXES:
        raise ConfigError(f"--data {data!r} needs a path: {name}:PATH (--data {VISION_DATA_FORMS})")
    raise ConfigError(f"unknown vision dataset {data!r} (--data {VISION_DATA_FORMS})")


def lm_model_names() -> tuple[str, ...]:
    from .lm import LM_MODELS
    return tuple(LM_MODELS)


def meta_model(name: str, vocab_size: int = 256) -> Any:
    """The named model on the meta device: its exact tensors and stages, no memory (LM: with
    `vocab_size`; vision: Fashion-MNIST's shape, which changes no stage)."""
    import torch
    with torch.device("meta"):
        if name in lm_model_names():
            from .lm.model import TransformerLM, lm_shape
            return TransformerLM(lm_shape(name), vocab_size)
        if name in VISION_MODELS:
            from .vision.models import build_model
            return build_model(name, in_channels=1, num_classes=10, image_size=28)
    raise ConfigError(f"unknown model {name!r} (LM: {', '.join(lm_model_names())}; "
                      f"vision: {', '.join(VISION_MODELS)})")


def build_workload(cfg: Any, rank: int, world_size: int, local_rank: int = 0, ranks_per_worker: int = 1) -> Workload:
    """The workload a Config asks for, sharded for worker `rank` of `world_size`; in a worker of
    several ranks, this local rank's slice of the worker's batch (`base.RankSlice`)."""
    if ranks_per_worker > 1:
        from .base import RankSlice
        worker_cfg = dataclasses.replace(cfg, batch_size=cfg.batch_size * ranks_per_worker)
        return RankSlice(build_workload(worker_cfg, rank, world_size), local_rank, ranks_per_worker)
    if cfg.model in VISION_MODELS:
        from .vision import build_vision_workload
        # build_config gives a vision model DEFAULT_DATA["vision"] when no data is named; this fallback
        # covers Config objects made directly (Config(model="cnn") keeps the LM default "shakespeare").
        data = DEFAULT_DATA["vision"] if cfg.data == DEFAULT_DATA["lm"] else cfg.data
        return build_vision_workload(cfg.model, data, rank=rank, world_size=world_size, seed=cfg.seed,
                                     batch_size=cfg.batch_size, eval_batches=cfg.eval_batches,
                                     augment=cfg.augment, width=cfg.width)
    if cfg.model in lm_model_names():
        from .lm import build_lm_workload
        return build_lm_workload(cfg.model, cfg.data, rank=rank, world_size=world_size, seed=cfg.seed,
                                 batch_size=cfg.batch_size, seq_len=cfg.seq_len, tokenizer=cfg.tokenizer,
                                 eval_batches=cfg.eval_batches, val_fraction=cfg.val_fraction,
                                 bpe_vocab=cfg.bpe_vocab, cache_dir=str(cfg.out), leader_first=leader_first)
    raise ConfigError(f"unknown model '{cfg.model}' (LM: {', '.join(lm_model_names())}; "
                      f"vision: {', '.join(VISION_MODELS)})")


def leader_first(build: Callable[[], T]) -> T:
    """`build()` on global rank 0 first, then on the other ranks, which find the files it cached: a
    one-off preparation (a BPE) is done once per run, not once per rank. The others wait on the
    process group's store (the local launcher's and torchrun's alike). A rank that cannot see rank 0's
    files (another host without a shared run directory) just builds them itself."""
    import datetime

    import torch.distributed as dist
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return build()
    store = dist.distributed_c10d._get_default_store()
    if dist.get_rank() == 0:
        try:
            return build()
        finally:                      # also on failure: the others then meet the same error themselves
            store.set(LEADER_DONE_KEY, "1")
    store.wait([LEADER_DONE_KEY], datetime.timedelta(seconds=LEADER_WAIT_S))
    return build()
