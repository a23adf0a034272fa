"""A LLaMA-style decoder: RMSNorm, rotary embeddings, SwiGLU, tied embedding/head, no biases.

The module tree is deliberately flat and ordered (`embed`, `blocks[i]`, `norm`) so that
fragment-based strategies (Streaming DiLoCo, CoCoDC) can partition parameters by block
through `TransformerLM.stages()`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

import torch
import torch.nn.functional as F
from torch import nn

from wansync.errors import ConfigError


@dataclass(frozen=True)
class LMShape:
    """Architecture of one named size; the vocabulary comes from the tokenizer."""

    dim: int
    n_layers: int
    n_heads: int
    ffn_hidden: int
    max_seq_len: int

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    def param_count(self, vocab_size: int) -> int:
        """Exact parameter count of `TransformerLM(self, vocab_size)` (tied head counted once)."""
        d, f = self.dim, self.ffn_hidden
        block = 4 * d * d + 3 * d * f + 2 * d  # qkv+out, gate/up/down, two RMSNorms
        return vocab_size * d + self.n_layers * block + d


LM_MODELS: Mapping[str, LMShape] = MappingProxyType(
    {
        # 205,376 parameters: a smoke test of the whole pipeline (a step in milliseconds; it learns little).
        # The test suite trains it wherever the property under test does not depend on the model's size.
        "micro": LMShape(dim=64, n_layers=4, n_heads=4, ffn_hidden=160, max_seq_len=256),
        # 1,820,352 parameters with the 256-byte vocabulary: learns Shakespeare's spelling in minutes on 2 CPU cores.
        "tiny": LMShape(dim=192, n_layers=4, n_heads=4, ffn_hidden=512, max_seq_len=512),
        # 19,405,312 parameters with the byte vocabulary.
        "small": LMShape(dim=512, n_layers=6, n_heads=8, ffn_hidden=1408, max_seq_len=1024),
        # The CoCoDC setting ("150M LLaMA-style model on C4"), shaped like DiLoCo's 150M model
        # (12 layers, hidden 896, 16 heads) with a SwiGLU width of 2560. With a 32,000-token vocabulary
        # and the tied head: 32000*896 + 12*(4*896^2 + 3*896*2560 + 2*896) + 896 = 149,804,928 parameters.
        "150m": LMShape(dim=896, n_layers=12, n_heads=16, ffn_hidden=2560, max_seq_len=1024),
    }
)


def lm_shape(name: str) -> LMShape:
    """The named shape, or a ConfigError listing the valid names."""
    try:
        return LM_MODELS[name]
    except KeyError:
        raise ConfigError(f"unknown LM model {name!r}; valid: {', '.join(LM_MODELS)}") from None


def check_seq_len(name: str, seq_len: int) -> LMShape:
    """The named shape, or a ConfigError when `seq_len` exceeds its rotary tables (or is not positive)."""
    shape = lm_shape(name)
    if not 1 <= seq_len <= shape.max_seq_len:
        raise ConfigError(f"seq_len must be in [1, {shape.max_seq_len}] for model {name!r}, got {seq_len}")
    return shape


class RMSNorm(nn.Module):
    """Root-mean-square norm with a learned gain, computed in float32 for stability."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


class Rotary(nn.Module):
    """Rotary position embedding (rotate-half form); cos/sin tables are non-persistent buffers."""

    def __init__(self, head_dim: int, max_seq_len: int, base: float = 10000.0) -> None:
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float32), inv_freq)
        angles = torch.cat([angles, angles], dim=-1)  # (T, head_dim)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (B, H, T, head_dim)."""
        t = x.shape[-2]
        cos, sin = self.cos[:t].to(x.dtype), self.sin[:t].to(x.dtype)
        x1, x2 = x.chunk(2, dim=-1)
        return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class Attention(nn.Module):
    """Causal multi-head self-attention through scaled_dot_product_attention."""

    def __init__(self, shape: LMShape, rotary: Rotary) -> None:
        super().__init__()
        self.n_heads, self.head_dim = shape.n_heads, shape.head_dim
        self.qkv = nn.Linear(shape.dim, 3 * shape.dim, bias=False)
        self.out = nn.Linear(shape.dim, shape.dim, bias=False)
        self.rotary = rotary

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.n_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k = self.rotary(q), self.rotary(k)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, t, d))


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)); gate and up share one matmul."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.gate_up = nn.Linear(dim, 2 * hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, shape: LMShape, rotary: Rotary) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(shape.dim)
        self.attn = Attention(shape, rotary)
        self.mlp_norm = RMSNorm(shape.dim)
        self.mlp = SwiGLU(shape.dim, shape.ffn_hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class TransformerLM(nn.Module):
    """Decoder-only LM: tokens (B, T) -> logits (B, T, vocab). The output head is `embed.weight`.

    Initialisation draws only from torch's default generator in a fixed order, so the caller's
    `torch.manual_seed` alone determines the weights.
    """

    def __init__(self, shape: LMShape, vocab_size: int) -> None:
        super().__init__()
        if shape.dim % shape.n_heads or shape.head_dim % 2:
            raise ConfigError(f"LM dim {shape.dim} must split into {shape.n_heads} heads of even size")
        self.shape, self.vocab_size = shape, vocab_size
        self.embed = nn.Embedding(vocab_size, shape.dim)
        rotary = Rotary(shape.head_dim, shape.max_seq_len)
        self.blocks = nn.ModuleList(Block(shape, rotary) for _ in range(shape.n_layers))
        self.norm = RMSNorm(shape.dim)
        self._init_weights()

    def _init_weights(self) -> None:
        # GPT-2 style: N(0, 0.02), residual output projections scaled down by depth.
        residual_std = 0.02 / math.sqrt(2 * self.shape.n_layers)
        nn.init.normal_(self.embed.weight, std=0.02)
        for block in self.blocks:
            nn.init.normal_(block.attn.qkv.weight, std=0.02)
            nn.init.normal_(block.attn.out.weight, std=residual_std)
            nn.init.normal_(block.mlp.gate_up.weight, std=0.02)
            nn.init.normal_(block.mlp.down.weight, std=residual_std)

    def stages(self) -> list[nn.Module]:
        """Parameter-owning modules in forward order: [embed, block0, ..., blockN-1, norm]."""
        return [self.embed, *self.blocks, self.norm]

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if tokens.shape[1] > self.shape.max_seq_len:
            raise ConfigError(f"sequence length {tokens.shape[1]} exceeds max_seq_len {self.shape.max_seq_len}")
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return F.linear(self.norm(x), self.embed.weight)
