"""Tokenizers: raw UTF-8 bytes (default, nothing to train) or a byte-level BPE trained locally.

Both are lossless (`decode(encode(text)) == text`) and return numpy arrays in the smallest
integer type that holds the vocabulary, so a 5M-token corpus costs 5 MB per worker, not 40.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Protocol, Sequence

import numpy as np

from wansync.errors import ConfigError
from wansync.rundir import files

TOKENIZERS = ("byte", "bpe")


def token_dtype(vocab_size: int) -> type[np.integer]:
    """Smallest unsigned/signed dtype that holds ids below `vocab_size`."""
    if vocab_size <= 256:
        return np.uint8
    return np.uint16 if vocab_size <= 65536 else np.int32


class Tokenizer(Protocol):
    name: str
    vocab_size: int

    def encode(self, text: str) -> np.ndarray: ...

    def decode(self, ids: Sequence[int] | np.ndarray) -> str: ...

    def token_bytes(self) -> np.ndarray: ...


class ByteTokenizer:
    """Each UTF-8 byte is a token: vocab 256, no training, no unknown tokens."""

    name = "byte"
    vocab_size = 256

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8)

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        return np.asarray(ids, dtype=np.uint8).tobytes().decode("utf-8", errors="replace")

    def token_bytes(self) -> np.ndarray:
        """UTF-8 bytes each token stands for: one."""
        return np.ones(self.vocab_size, dtype=np.int64)


class BPETokenizer:
    """Byte-level BPE (GPT-2 style pre-tokenization) from the `tokenizers` package."""

    name = "bpe"

    def __init__(self, tokenizer) -> None:
        self._tok = tokenizer
        self.vocab_size = tokenizer.get_vocab_size()

    def encode(self, text: str) -> np.ndarray:
        # Encode line by line in parallel (Rust threads); byte-level BPE keeps the newlines.
        chunks = text.splitlines(keepends=True)
        ids = [e.ids for e in self._tok.encode_batch(chunks, add_special_tokens=False)]
        flat = np.fromiter((i for seq in ids for i in seq), dtype=np.int64)
        return flat.astype(token_dtype(self.vocab_size))

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def token_bytes(self) -> np.ndarray:
        """UTF-8 bytes each token stands for (for bits per byte). Byte-level BPE spells every token in
        its 256-character byte alphabet, one character per byte, so a token's length is its byte count."""
        return np.array([len(self._tok.id_to_token(i) or "") for i in range(self.vocab_size)], dtype=np.int64)

    def to_str(self) -> str:
        return self._tok.to_str()

    @classmethod
    def from_str(cls, json_text: str) -> BPETokenizer:
        tokenizers = _import_tokenizers()
        return cls(tokenizers.Tokenizer.from_str(json_text))

    @classmethod
    def train(cls, text: str, vocab_size: int) -> BPETokenizer:
        tokenizers = _import_tokenizers()
        from tokenizers import decoders, models, pre_tokenizers, trainers

        tok = tokenizers.Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        tok.train_from_iterator(text.splitlines(keepends=True), trainer)
        return cls(tok)


def _import_tokenizers():
    try:
        import tokenizers
    except ImportError:
        raise ConfigError("tokenizer='bpe' needs the tokenizers package: install wansync[bpe]") from None
    return tokenizers


def build_tokenizer(kind: str, text: str, *, bpe_vocab: int = 2048, cache_dir: str | None = None) -> Tokenizer:
    """The tokenizer `kind` for this corpus; a BPE is trained on `text` or read from `cache_dir`."""
    if kind == "byte":
        return ByteTokenizer()
    if kind != "bpe":
        raise ConfigError(f"unknown tokenizer {kind!r}; valid: {', '.join(TOKENIZERS)}")
    if bpe_vocab < 257:
        raise ConfigError(f"bpe_vocab must be at least 257 (256 byte symbols + merges), got {bpe_vocab}")
    _import_tokenizers()
    if cache_dir is None:
        return BPETokenizer.train(text, bpe_vocab)
    path = Path(cache_dir) / f"bpe-{bpe_vocab}-{text_digest(text)}.json"
    if path.exists():
        return BPETokenizer.from_str(path.read_text(encoding="utf-8"))
    tok = BPETokenizer.train(text, bpe_vocab)
    path.parent.mkdir(parents=True, exist_ok=True)
    files.write_bytes(path, tok.to_str().encode("utf-8"))  # whole or not at all: ranks read it concurrently
    return tok


def text_digest(text: str) -> str:
    """Short content hash that keys cache files to the exact corpus."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]
