"""ViT-S (dim 384, depth 12, heads 6, MLP 1536) sized for small images (28–64 px)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def choose_patch_size(image_size: int) -> int:
    """The divisor of `image_size` nearest image_size / 8 (≈8×8 tokens): 4 for 28 and 32, 8 for 64."""
    divisors = [p for p in range(2, image_size + 1) if image_size % p == 0] or [image_size]
    return min(divisors, key=lambda p: (abs(p - image_size / 8), p))


class PatchEmbed(nn.Module):
    """Patchify conv + class token + learned position embedding (one stage for partitioning)."""

    def __init__(self, in_channels: int, image_size: int, patch: int, dim: int) -> None:
        super().__init__()
        self.proj = nn.Conv2d(in_channels, dim, patch, patch)
        n = (image_size // patch) ** 2
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos_embed = nn.Parameter(torch.randn(1, n + 1, dim) * 0.02)

    def forward(self, x):
        x = self.proj(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1)
        return x + self.pos_embed


class Block(nn.Module):
    """Pre-norm transformer block (scaled-dot-product attention, GELU MLP)."""

    def __init__(self, dim: int, heads: int, mlp: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, mlp), nn.GELU(), nn.Linear(mlp, dim))

    def forward(self, x):
        b, n, d = x.shape
        qkv = self.qkv(self.norm1(x)).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        att = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2])
        x = x + self.proj(att.transpose(1, 2).reshape(b, n, d))
        return x + self.mlp(self.norm2(x))


class ViT(nn.Module):
    def __init__(
        self,
        in_channels: int,
        num_classes: int,
        image_size: int,
        patch: int | None = None,
        dim: int = 384,
        depth: int = 12,
        heads: int = 6,
        mlp: int = 1536,
    ) -> None:
        super().__init__()
        patch = patch or choose_patch_size(image_size)
        if image_size % patch:
            raise ValueError(f"patch size {patch} does not divide image size {image_size}")
        self.patch_size = patch
        self.embed = PatchEmbed(in_channels, image_size, patch, dim)
        self.blocks = nn.ModuleList(Block(dim, heads, mlp) for _ in range(depth))
        self.head = nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, num_classes))
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.trunc_normal_(m.weight, std=0.02)
                nn.init.zeros_(m.bias)

    def forward(self, x):
        x = self.embed(x)
        for blk in self.blocks:
            x = blk(x)
        return self.head(x[:, 0])

    def stages(self) -> list[nn.Module]:
        """Ordered modules covering every parameter once: embedding, each block, head."""
        return [self.embed, *self.blocks, self.head]


def vit_s(in_channels: int, num_classes: int, image_size: int) -> ViT:
    return ViT(in_channels, num_classes, image_size)
