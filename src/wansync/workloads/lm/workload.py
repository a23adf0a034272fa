"""The LM workload: model + tokenized corpus + this rank's shard, behind the `Workload` protocol.

The model is any module that maps tokens (B, T) to logits (B, T, V) with V at least the tokenizer's
vocabulary (or returns them as `.logits`, as a Hugging Face causal LM does): the built-in
`TransformerLM` by name, a Hugging Face one (`workloads.hf`) or the user's (`--model pkg.module:factory`).

Evaluation reports bits per byte beside the per-token loss: the loss summed over the evaluated
targets, in bits, over the UTF-8 bytes those targets stand for. Per-token losses of a byte and a
BPE tokenizer are not comparable; bits per byte are.
"""

from __future__ import annotations

import io
import math
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from wansync.errors import ConfigError, DataError
from wansync.rundir import files
from wansync.workloads.base import logits_of
from wansync.workloads.lm.corpus import load_documents
from wansync.workloads.lm.dataset import (
    Batch,
    ShardSampler,
    eval_window_ids,
    shard_windows,
    split_documents,
    window_batch,
)
from wansync.workloads.lm.model import TransformerLM, check_seq_len
from wansync.workloads.lm.tokenizer import (
    BPETokenizer,
    Tokenizer,
    build_tokenizer,
    text_digest,
)


def check_vocabulary(model: nn.Module, model_name: str, tokenizer: Tokenizer) -> None:
    """The model's input embedding has a row for every token id the data holds (a smaller one fails
    inside the first forward with torch's `index out of range in self`)."""
    get = getattr(model, "get_input_embeddings", None)
    emb = get() if callable(get) else next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)
    rows = getattr(emb, "num_embeddings", None)
    if isinstance(rows, int) and rows < tokenizer.vocab_size:
        raise ConfigError(
            f"--model {model_name}: its input embedding has {rows} rows, fewer than the {tokenizer.name} "
            f"tokenizer's {tokenizer.vocab_size} token ids: build it with the vocab_size it is given"
        )


class LMWorkload:
    """Next-token prediction on one rank's disjoint shard of token windows."""

    kind = "lm"

    def __init__(
        self,
        model: nn.Module,
        tokenizer: Tokenizer,
        train_tokens: np.ndarray,
        val_tokens: np.ndarray,
        *,
        model_name: str,
        data: str,
        rank: int,
        world_size: int,
        seed: int,
        batch_size: int,
        seq_len: int,
        eval_batches: int,
    ) -> None:
        self.model, self.tokenizer, self.model_name, self.data = model, tokenizer, model_name, data
        check_vocabulary(model, model_name, tokenizer)
        self.seq_len, self.batch_size = seq_len, batch_size
        self.train_tokens, self.val_tokens = train_tokens, val_tokens
        self._token_bytes = torch.from_numpy(tokenizer.token_bytes())
        self.n_windows = len(self.train_tokens) // (seq_len + 1)
        self.shard_indices = shard_windows(self.n_windows, seed=seed, rank=rank, world_size=world_size)
        if len(self.shard_indices) < batch_size:
            raise DataError(
                f"corpus {data!r} is too small: {self.n_windows} training windows of {seq_len + 1} tokens "
                f"give {len(self.shard_indices)} per rank over {world_size} ranks, fewer than batch_size {batch_size}"
            )
        self._sampler = ShardSampler(self.shard_indices, batch_size, seed=seed, rank=rank)
        n_val_windows = len(self.val_tokens) // (seq_len + 1)
        if n_val_windows == 0:
            raise DataError(
                f"corpus {data!r}: validation split ({len(self.val_tokens)} tokens) is shorter than "
                f"one window of {seq_len + 1}; raise val_fraction or lower seq_len"
            )
        self._eval_ids = eval_window_ids(n_val_windows, eval_batches, batch_size)

    def next_batch(self) -> Batch:
        return window_batch(self.train_tokens, self._sampler.next_window_ids(), self.seq_len)

    def loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        inputs, targets = _to_model_device(model, batch)
        logits = self.logits(model(inputs), targets)
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())

    def logits(self, output: object, targets: torch.Tensor) -> torch.Tensor:
        """The model's logits, checked: (B, T, V), one row of V for every token id."""
        logits = logits_of(output)
        if logits.dim() != 3 or logits.shape[:2] != targets.shape or logits.shape[-1] < self.tokenizer.vocab_size:
            raise ConfigError(
                f"model {self.model_name!r} returned logits of shape {tuple(logits.shape)} for tokens "
                f"of shape {tuple(targets.shape)}: an LM must return (batch, seq_len, vocab >= "
                f"{self.tokenizer.vocab_size}), the {self.tokenizer.name} tokenizer's vocabulary"
            )
        return logits

    def batch_size_items(self, batch: Batch) -> int:
        return batch[0].numel()

    def evaluate(self, model: nn.Module) -> dict[str, float]:
        """Mean token loss, its perplexity and bits per byte over the fixed validation batches, on the
        unwrapped module (no DDP hooks)."""
        net = _unwrap(model)
        was_training = net.training
        net.eval()
        total, count, nbytes = 0.0, 0, 0
        try:
            with torch.no_grad():
                for ids in self._eval_ids:
                    batch = window_batch(self.val_tokens, ids, self.seq_len)
                    nbytes += int(self._token_bytes[batch[1]].sum())
                    inputs, targets = _to_model_device(net, batch)
                    logits = self.logits(net(inputs), targets).flatten(0, 1).float()
                    total += F.cross_entropy(logits, targets.flatten(), reduction="sum").item()
                    count += targets.numel()
        finally:
            net.train(was_training)
        mean = total / count
        return {"val_loss": mean, "val_ppl": math.exp(min(mean, 80.0)), "val_bpb": bits_per_byte(total, nbytes)}

    def epoch_progress(self) -> float:
        return self._sampler.epoch_progress()

    def state_dict(self) -> dict[str, Any]:
        return self._sampler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._sampler.load_state_dict(state)

    def skip_to(self, steps: int) -> None:
        self._sampler.skip_to(steps)

    def describe(self) -> dict[str, Any]:
        return {
            "workload": "lm",
            "model": self.model_name,
            "params": sum(p.numel() for p in self.model.parameters()),
            **(
                {"shape": asdict(self.model.shape)}
                if isinstance(self.model, TransformerLM)
                else {"architecture": type(self.model).__name__}
            ),
            "data": self.data,
            "tokenizer": self.tokenizer.name,
            "vocab": self.tokenizer.vocab_size,
            "train_tokens": len(self.train_tokens),
            "val_tokens": len(self.val_tokens),
            "val_bytes_per_token": float(self._token_bytes[torch.from_numpy(self.val_tokens.astype(np.int64))].sum())
            / max(1, len(self.val_tokens)),
            "seq_len": self.seq_len,
            "batch_size": self.batch_size,
            "windows": self.n_windows,
            "windows_per_rank": len(self.shard_indices),
            "batches_per_epoch": self._sampler.batches_per_epoch,
            "eval_batches": len(self._eval_ids),
        }


def build_lm_workload(
    model: str = "tiny",
    data: str = "shakespeare",
    *,
    rank: int = 0,
    world_size: int = 1,
    seed: int = 0,
    batch_size: int = 16,
    seq_len: int = 128,
    tokenizer: str | Tokenizer = "byte",
    eval_batches: int = 8,
    val_fraction: float = 0.05,
    bpe_vocab: int = 2048,
    cache_dir: str | None = None,
    leader_first: Callable[[Callable[[], Any]], Any] | None = None,
    build_model: Callable[[Tokenizer], nn.Module] | None = None,
) -> LMWorkload:
    """Build the LM workload for one rank. The model depends only on (model, vocabulary, seed), so all
    ranks agree: `build_model(tokenizer)` runs under `torch.manual_seed(seed)` (default: the
    `TransformerLM` of the size `model` names). `tokenizer` is "byte", "bpe" or a tokenizer itself.

    `leader_first(build)` runs `build` on one rank before the others (which then read the files it
    cached in `cache_dir`), so a BPE is trained once per run, not once per rank; without it every
    caller tokenizes for itself."""
    if build_model is None:
        shape = check_seq_len(model, seq_len)

        def build_model(tok: Tokenizer) -> nn.Module:
            return TransformerLM(shape, tok.vocab_size)

    if eval_batches < 1:
        raise ConfigError(f"eval_batches must be positive, got {eval_batches}")
    train_text, val_text = split_documents(
        load_documents(data), val_fraction, sep="\n\n" if data.startswith("hf:") else "\n"
    )

    def tokenize() -> tuple[Tokenizer, np.ndarray, np.ndarray]:
        # the BPE learns from the training text only: the held-out text stays unseen
        tok = (
            tokenizer
            if not isinstance(tokenizer, str)
            else build_tokenizer(tokenizer, train_text, bpe_vocab=bpe_vocab, cache_dir=cache_dir)
        )
        return tok, _encode_cached(tok, train_text, cache_dir), _encode_cached(tok, val_text, cache_dir)

    once = leader_first if leader_first is not None and tokenizer == "bpe" and cache_dir is not None else _call
    tok, train_tokens, val_tokens = once(tokenize)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        net = build_model(tok)
    return LMWorkload(
        net,
        tok,
        train_tokens,
        val_tokens,
        model_name=model,
        data=data,
        rank=rank,
        world_size=world_size,
        seed=seed,
        batch_size=batch_size,
        seq_len=seq_len,
        eval_batches=eval_batches,
    )


def bits_per_byte(loss_nats: float, nbytes: int) -> float:
    """A summed cross-entropy in nats as bits per byte of the text it was measured on."""
    return loss_nats / math.log(2) / max(1, nbytes)


def _call(build: Callable[[], Any]) -> Any:
    return build()


def _encode_cached(tok: Tokenizer, text: str, cache_dir: str | None) -> np.ndarray:
    """Token ids of the corpus; BPE ids (seconds to compute) are cached next to the tokenizer."""
    if not isinstance(tok, BPETokenizer) or cache_dir is None:
        return tok.encode(text)
    path = Path(cache_dir) / f"tokens-{text_digest(tok.to_str())}-{text_digest(text)}.npy"
    if path.exists():
        return np.load(path)
    ids = tok.encode(text)
    buf = io.BytesIO()
    np.save(buf, ids)
    path.parent.mkdir(parents=True, exist_ok=True)
    files.write_bytes(path, buf.getvalue())
    return ids


def _unwrap(model: nn.Module) -> nn.Module:
    """The plain module inside a DistributedDataParallel (or similar `.module`) wrapper."""
    inner = getattr(model, "module", None)
    return inner if isinstance(inner, nn.Module) else model


def _to_model_device(model: nn.Module, batch: Batch) -> Batch:
    device = next(model.parameters()).device
    return batch[0].to(device, non_blocking=True), batch[1].to(device, non_blocking=True)
