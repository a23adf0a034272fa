"""Your own model, and your own workload, on wansync's command line (docs/your_model.md).

    wansync train --model examples/my_model.py:build --strategy diloco --workers 2 --steps 200
    wansync train --data examples/my_model.py:workload --strategy diloco --workers 2 --steps 200

`build` is a model for the built-in text data: tokens (B, T) in, logits (B, T, vocab) out.
`workload` is a whole workload (model, data, loss, evaluation): points of 16 features in 4 classes.
wansync calls either under `torch.manual_seed(seed)` on every worker, so every worker starts from
the same model.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

FEATURES, CLASSES, TEST_POINTS = 16, 4, 512


class GRULM(nn.Module):
    """A small recurrent language model."""

    def __init__(self, vocab_size: int, dim: int = 64) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, dim)
        self.rnn = nn.GRU(dim, dim, batch_first=True)
        self.head = nn.Linear(dim, vocab_size)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden, _ = self.rnn(self.embed(tokens))
        return self.head(hidden)


def build(spec) -> nn.Module:
    """--model examples/my_model.py:build: `spec.vocab_size` is the tokenizer's vocabulary."""
    return GRULM(spec.vocab_size)


class Blobs:
    """Classify noisy points around four centres. Each worker draws its own stream of points
    (`spec.rank`); the test points and the centres are the same on every worker."""

    kind = "vision"  # judged by test accuracy: evaluate returns test_loss and test_acc

    def __init__(self, spec) -> None:
        task = torch.Generator().manual_seed(1234)
        self.centres = 2.0 * torch.randn(CLASSES, FEATURES, generator=task)
        self.test = self.draw(task, TEST_POINTS)
        self.stream = torch.Generator().manual_seed(spec.seed * 1_000_003 + spec.rank)
        self.batch_size = spec.batch_size
        self.model = nn.Sequential(nn.Linear(FEATURES, 64), nn.ReLU(), nn.Linear(64, CLASSES))

    def draw(self, generator: torch.Generator, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        labels = torch.randint(0, CLASSES, (n,), generator=generator)
        return self.centres[labels] + torch.randn(n, FEATURES, generator=generator), labels

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.draw(self.stream, self.batch_size)

    def loss(self, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        points, labels = batch
        return F.cross_entropy(model(points), labels)

    @torch.no_grad()
    def evaluate(self, model: nn.Module) -> dict[str, float]:
        points, labels = self.test
        logits = model(points)
        return {
            "test_loss": float(F.cross_entropy(logits, labels)),
            "test_acc": 100.0 * float((logits.argmax(1) == labels).float().mean()),
        }


def workload(spec) -> Blobs:
    """--data examples/my_model.py:workload: `spec` says which worker this is and its batch size."""
    return Blobs(spec)
