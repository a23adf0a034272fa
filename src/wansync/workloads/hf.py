"""A Hugging Face causal LM from a local directory: `--model hf:PATH`.

PATH is a directory with a `config.json`: with weights beside it (`model.safetensors`,
`pytorch_model.bin`, or their sharded index) the model is that checkpoint
(`from_pretrained(..., local_files_only=True)`), else it is built from the config with random
weights (`from_config`, under the run's seed). Nothing is ever downloaded. The model trains on the
built-in text data with the directory's tokenizer when it has one, else with `--tokenizer`; the
tokenizer's ids must fit the model's vocabulary. Its parameters are fp32 (`--precision bf16` is
autocast) and its KV cache is off: a training step has no use for it.

`transformers` (the `hf` extra) is imported here only, when a run names `hf:`; without it the run
is refused in one line.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from ..errors import ConfigError, first_line
from .lm.tokenizer import token_dtype

CONFIG_FILE = "config.json"
WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")
INSTALL = "pip install 'wansync[hf]'"


def model_dir(model: str) -> Path:
    """The directory `hf:PATH` names, or one line that says why it cannot be a model's."""
    raw = model.partition(":")[2]
    if not raw.strip():  # Path("") would be the working directory
        raise ConfigError(f"--model {model}: name a local directory with a {CONFIG_FILE} (hf:PATH)")
    path = Path(raw).expanduser()
    if not path.exists():
        raise ConfigError(f"--model {model}: no such directory {path}")
    if not path.is_dir():
        raise ConfigError(
            f"--model {model}: {path} is not a directory (hf:PATH names a directory with a {CONFIG_FILE})"
        )
    if not (path / CONFIG_FILE).is_file():
        raise ConfigError(
            f"--model {model}: {path} has no {CONFIG_FILE} (a model's config, or a checkpoint "
            f"saved with save_pretrained)"
        )
    return path


def transformers_module() -> Any:
    """`transformers`, quiet (no progress bars, errors only), or one line saying how to install it."""
    try:
        import transformers
    except ImportError:
        raise ConfigError(f"--model hf:PATH needs the transformers package: {INSTALL}") from None
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    return transformers


def model_config(model: str) -> Any:
    """The model's `PretrainedConfig`, its KV cache off."""
    path = model_dir(model)  # before the import: a wrong path is said even without transformers
    transformers = transformers_module()
    try:
        config = transformers.AutoConfig.from_pretrained(str(path), local_files_only=True)
    except Exception as e:  # noqa: BLE001 - a config transformers cannot read: one line
        raise ConfigError(
            f"--model {model}: transformers cannot read {path / CONFIG_FILE}: " f"{type(e).__name__}: {first_line(e)}"
        ) from None
    config.use_cache = False
    return config


def check_seq_len(model: str, seq_len: int) -> None:
    """`seq_len` within the positions the model's config declares (a learned position table has no more)."""
    limit = getattr(model_config(model), "max_position_embeddings", None)
    if isinstance(limit, int) and seq_len > limit:
        raise ConfigError(
            f"seq_len must be at most {limit} for --model {model} (max_position_embeddings in its "
            f"{CONFIG_FILE}), got {seq_len}"
        )


def check_vocab(model: str, model_vocab: int, tokenizer: str, tokenizer_vocab: int) -> None:
    """Every id of the tokenizer is a row of the model's embedding (a larger model vocabulary is fine)."""
    if tokenizer_vocab > model_vocab:
        raise ConfigError(
            f"--model {model} has a vocabulary of {model_vocab} tokens, fewer than the {tokenizer} "
            f"tokenizer's {tokenizer_vocab}: set vocab_size >= {tokenizer_vocab} in its {CONFIG_FILE}, "
            f"or put the model's own tokenizer in its directory"
        )


def build_model(model: str, tokenizer: str, tokenizer_vocab: int) -> nn.Module:
    """The model `hf:PATH` names, in fp32 (random weights drawn from torch's default generator: the
    caller seeds it)."""
    path, config = model_dir(model), model_config(model)
    transformers = transformers_module()
    check_vocab(model, int(config.vocab_size), tokenizer, tokenizer_vocab)
    auto = transformers.AutoModelForCausalLM
    try:
        if any((path / f).is_file() for f in WEIGHT_FILES):
            net = auto.from_pretrained(str(path), config=config, local_files_only=True, dtype=torch.float32)
        else:
            net = auto.from_config(config, dtype=torch.float32)
    except Exception as e:  # noqa: BLE001 - not a causal LM, damaged weights: one line
        raise ConfigError(
            f"--model {model}: cannot build a causal LM from {path}: " f"{type(e).__name__}: {first_line(e)}"
        ) from None
    return net


def meta_model(model: str) -> nn.Module:
    """The model on the meta device: its exact tensors and structure, no memory, no weights read
    (and a config that is not a causal LM's refused in one line)."""
    config = model_config(model)
    auto = transformers_module().AutoModelForCausalLM
    try:
        with torch.device("meta"):
            return auto.from_config(config)
    except Exception as e:  # noqa: BLE001 - a T5 or BERT config: not a causal LM
        raise ConfigError(
            f"--model {model}: transformers builds no causal LM from its {CONFIG_FILE}: "
            f"{type(e).__name__}: {first_line(e)}"
        ) from None


def has_tokenizer(model: str) -> bool:
    path = model_dir(model)
    return any((path / f).is_file() for f in TOKENIZER_FILES)


def tokenizer_of(model: str) -> HFTokenizer | None:
    """The directory's own tokenizer, or None when it has none."""
    if not has_tokenizer(model):
        return None
    path = model_dir(model)
    transformers = transformers_module()
    try:
        tok = transformers.AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except Exception as e:  # noqa: BLE001
        raise ConfigError(
            f"--model {model}: transformers cannot read the tokenizer in {path}: "
            f"{type(e).__name__}: {first_line(e)}"
        ) from None
    return HFTokenizer(tok)


class HFTokenizer:
    """A Hugging Face tokenizer behind wansync's `Tokenizer` protocol (`lm.tokenizer`)."""

    name = "hf"

    def __init__(self, tokenizer: Any) -> None:
        self._tok = tokenizer
        self.vocab_size = len(tokenizer)

    def encode(self, text: str) -> np.ndarray:
        """Line by line in one batch (a fast tokenizer's threads), no special tokens."""
        lines = text.splitlines(keepends=True)
        ids = self._tok(lines, add_special_tokens=False)["input_ids"] if lines else []
        flat = np.fromiter((i for seq in ids for i in seq), dtype=np.int64)
        return flat.astype(token_dtype(self.vocab_size))

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def token_bytes(self) -> np.ndarray:
        """UTF-8 bytes each token decodes to (special tokens: none), for bits per byte. A token that is
        part of a character decodes to a replacement character: bits per byte are then approximate."""
        special = set(self._tok.all_special_ids)
        text = self._tok.batch_decode([[i] for i in range(self.vocab_size)])
        return np.array([0 if i in special else len(t.encode("utf-8")) for i, t in enumerate(text)], dtype=np.int64)
