"""Pick the workload from the model and data: LM sizes or vision architectures on the built-in data,
a Hugging Face causal LM (`hf:PATH`, `hf.py`), a model of the user's (`pkg.module:factory`) on the
built-in data, or the user's whole workload (`--data pkg.module:factory`, `user.py`)."""

from __future__ import annotations

import dataclasses
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Callable, TypeVar

from ..errors import ConfigError
from .factory import FACTORY_FORMS, is_factory

if TYPE_CHECKING:  # importing this package stays torch-free (config.py uses the names below)
    from torch import nn

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
HF_PREFIX = "hf:"  # --model hf:PATH: a Hugging Face causal LM (workloads.hf)
T = TypeVar("T")


def model_kind(model: str, data: str = "") -> str:
    """'vision' for the vision architectures and for a model of the user's on image data, else 'lm'
    (unknown names are rejected elsewhere; a workload of the user's has the LM's defaults)."""
    if model in VISION_MODELS:
        return "vision"
    return "vision" if is_factory(model) and is_vision_data(data) else "lm"


def model_forms() -> str:
    """Every form --model takes, for an error message."""
    return (
        f"LM: {', '.join(lm_model_names())}; vision: {', '.join(VISION_MODELS)}; yours: {FACTORY_FORMS}; "
        f"Hugging Face: {HF_PREFIX}PATH"
    )


def is_vision_data(data: str) -> bool:
    name, sep, path = data.partition(":")
    name = name.strip().lower()
    return name == "fashion-mnist" or (bool(sep) and bool(path) and name in VISION_DATA_PREFIXES)


def check_data_kind(model: str, data: str) -> None:
    """One-line ConfigError when the dataset does not fit the model kind (LM text vs images). A
    model of the user's takes either (its kind follows the data); a workload of the user's any model."""
    from pathlib import Path

    if is_factory(data):
        return
    name = data.partition(":")[0].strip().lower()
    if model_kind(model, data) == "lm":
        if is_factory(model) and name in VISION_DATA_PREFIXES:  # images, but no path to them
            raise ConfigError(f"--data {data!r} needs a path: {name}:PATH (--data {VISION_DATA_FORMS})")
        if is_vision_data(data):
            raise ConfigError(
                f"model '{model}' is a language model and cannot train on the image dataset "
                f"{data!r}; use a vision model (--model {' | '.join(VISION_MODELS)}) or a text "
                f"corpus (--data shakespeare | PATH | hf:NAME)"
            )
        return
    if is_vision_data(data):
        return
    if data == DEFAULT_DATA["lm"] or data.startswith("hf:") or Path(data).exists():
        raise ConfigError(
            f"vision model '{model}' needs an image dataset, got {data!r}, a text corpus "
            f"(image directories are named with a prefix; --data {VISION_DATA_FORMS})"
        )
    if name in VISION_DATA_PREFIXES:
        raise ConfigError(f"--data {data!r} needs a path: {name}:PATH (--data {VISION_DATA_FORMS})")
    raise ConfigError(f"unknown vision dataset {data!r} (--data {VISION_DATA_FORMS})")


def lm_model_names() -> tuple[str, ...]:
    from .lm import LM_MODELS

    return tuple(LM_MODELS)


def check_model(cfg: Any) -> None:
    """What can be known of `--model` (and of a `--data` factory) before any worker starts, each
    failure one line: a name that is none of the forms, a factory that does not import, an `hf:`
    directory without its config.json, `transformers` not installed, a vocabulary the tokenizer
    does not fit, a `seq_len` beyond the model's positions. The factories themselves run in the workers."""
    from .factory import load_factory

    if is_factory(cfg.data):
        load_factory(cfg.data, "--data")
    elif cfg.model in lm_model_names():
        from .lm import check_seq_len

        check_seq_len(cfg.model, cfg.seq_len)
    elif cfg.model.startswith(HF_PREFIX):
        from . import hf

        if not hf.has_tokenizer(cfg.model):  # the built-in tokenizer: its size is known
            hf.check_vocab(
                cfg.model,
                int(hf.model_config(cfg.model).vocab_size),
                cfg.tokenizer,
                256 if cfg.tokenizer == "byte" else cfg.bpe_vocab,
            )
        hf.check_seq_len(cfg.model, cfg.seq_len)
        hf.meta_model(cfg.model)  # a causal LM, built on the meta device: no memory
    elif is_factory(cfg.model):
        load_factory(cfg.model, "--model")
    elif cfg.model not in VISION_MODELS:
        raise ConfigError(f"unknown model '{cfg.model}' ({model_forms()})")


def meta_model(name: str, vocab_size: int = 256) -> nn.Module | None:
    """The named model on the meta device: its exact tensors and stages, no memory (LM: with
    `vocab_size`; vision: Fashion-MNIST's shape, which changes no stage; hf:PATH: its config's).
    None for a model of the user's: only its factory knows it, and that runs in the workers."""
    import torch

    if name.startswith(HF_PREFIX):
        from .hf import meta_model as hf_meta_model

        return hf_meta_model(name)
    if is_factory(name):
        return None
    with torch.device("meta"):
        if name in lm_model_names():
            from .lm.model import TransformerLM, lm_shape

            return TransformerLM(lm_shape(name), vocab_size)
        if name in VISION_MODELS:
            from .vision.models import build_model

            return build_model(name, in_channels=1, num_classes=10, image_size=28)
    raise ConfigError(f"unknown model {name!r} ({model_forms()})")


def build_workload(cfg: Any, rank: int, world_size: int, local_rank: int = 0, ranks_per_worker: int = 1) -> Workload:
    """The workload a Config asks for, sharded for worker `rank` of `world_size`; in a worker of
    several ranks, this local rank's slice of the worker's batch (`base.RankSlice`)."""
    if ranks_per_worker > 1:
        from .base import RankSlice

        worker_cfg = dataclasses.replace(cfg, batch_size=cfg.batch_size * ranks_per_worker)
        return RankSlice(build_workload(worker_cfg, rank, world_size), local_rank, ranks_per_worker)
    if is_factory(cfg.data):
        from .base import WorkloadSpec
        from .user import build_user_workload

        return build_user_workload(
            cfg.data,
            WorkloadSpec(
                model=cfg.model,
                rank=rank,
                world_size=world_size,
                seed=cfg.seed,
                batch_size=cfg.batch_size,
                seq_len=cfg.seq_len,
                eval_batches=cfg.eval_batches,
                config=cfg,
            ),
        )
    if model_kind(cfg.model, cfg.data) == "vision" and is_factory(cfg.model):
        from .vision import build_vision_workload

        return build_vision_workload(
            cfg.model,
            cfg.data,
            rank=rank,
            world_size=world_size,
            seed=cfg.seed,
            batch_size=cfg.batch_size,
            eval_batches=cfg.eval_batches,
            augment=cfg.augment,
            model_factory=_user_vision_model(cfg),
        )
    if cfg.model in VISION_MODELS:
        from .vision import build_vision_workload

        # build_config gives a vision model DEFAULT_DATA["vision"] when no data is named; this fallback
        # covers Config objects made directly (Config(model="cnn") keeps the LM default "shakespeare").
        data = DEFAULT_DATA["vision"] if cfg.data == DEFAULT_DATA["lm"] else cfg.data
        return build_vision_workload(
            cfg.model,
            data,
            rank=rank,
            world_size=world_size,
            seed=cfg.seed,
            batch_size=cfg.batch_size,
            eval_batches=cfg.eval_batches,
            augment=cfg.augment,
            width=cfg.width,
        )
    if cfg.model in lm_model_names() or cfg.model.startswith(HF_PREFIX) or is_factory(cfg.model):
        from .lm import build_lm_workload

        tokenizer, build_model = _lm_model(cfg)
        return build_lm_workload(
            cfg.model,
            cfg.data,
            rank=rank,
            world_size=world_size,
            seed=cfg.seed,
            batch_size=cfg.batch_size,
            seq_len=cfg.seq_len,
            tokenizer=tokenizer,
            eval_batches=cfg.eval_batches,
            val_fraction=cfg.val_fraction,
            bpe_vocab=cfg.bpe_vocab,
            cache_dir=str(cfg.out),
            leader_first=leader_first,
            build_model=build_model,
        )
    raise ConfigError(f"unknown model '{cfg.model}' ({model_forms()})")


def _lm_model(cfg: Any) -> tuple[Any, Callable[[Any], nn.Module] | None]:
    """(tokenizer, model builder from the tokenizer) of an LM run: the built-in LM's (None: by its
    name), a Hugging Face model's (its directory's tokenizer when it has one), or the user's factory's."""
    if cfg.model.startswith(HF_PREFIX):
        from . import hf

        own = hf.tokenizer_of(cfg.model)
        return (own or cfg.tokenizer), lambda tok: hf.build_model(cfg.model, tok.name, tok.vocab_size)
    if not is_factory(cfg.model):
        return cfg.tokenizer, None
    from .base import ModelSpec
    from .factory import call_factory, load_factory

    factory = load_factory(cfg.model, "--model")

    def build(tok: Any) -> nn.Module:
        spec = ModelSpec(kind="lm", seed=cfg.seed, config=cfg, vocab_size=tok.vocab_size, seq_len=cfg.seq_len)
        return _module(call_factory(factory, spec, cfg.model, "--model"), cfg.model)

    return cfg.tokenizer, build


def _user_vision_model(cfg: Any) -> Callable[[int, int, int], nn.Module]:
    """The user's factory as the vision workload's model builder (channels, classes, image side)."""
    from .base import ModelSpec
    from .factory import call_factory, load_factory

    factory = load_factory(cfg.model, "--model")

    def build(in_channels: int, num_classes: int, image_size: int) -> nn.Module:
        spec = ModelSpec(
            kind="vision",
            seed=cfg.seed,
            config=cfg,
            in_channels=in_channels,
            num_classes=num_classes,
            image_size=image_size,
        )
        return _module(call_factory(factory, spec, cfg.model, "--model"), cfg.model)

    return build


def _module(built: Any, source: str) -> nn.Module:
    from torch import nn

    if not isinstance(built, nn.Module):
        raise ConfigError(f"--model {source} returned an object of type {type(built).__name__}, not a torch.nn.Module")
    return built


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
        finally:  # also on failure: the others then meet the same error themselves
            store.set(LEADER_DONE_KEY, "1")
    store.wait([LEADER_DONE_KEY], datetime.timedelta(seconds=LEADER_WAIT_S))
    return build()
