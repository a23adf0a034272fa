"""What the planner needs to know about a model: its tensors' sizes, its fragments, DDP's gradient
buckets, and the step time the FLOPs rule gives it.

A named model (`tiny`, `small`, `150m`, the vision models) is built on the meta device, so its exact
tensors are known without allocating them; the fragments are then `strategies.fragments.partition`'s
own. A bare size (`--params 7e9`) is a stand-in: 1-D tensors of 2^20 elements, no buffers, and
fragments of equal size (a real model's embeddings make its first and last fragments larger).

A worker sharded with FSDP2 (`--inside fsdp`) splits every parameter along its first dimension
into R chunks of ⌈rows/R⌉ rows (the last ones shorter or empty); the planner's figures are rank
0's, which holds a full chunk of each (`ModelSize.local_params`).

The FLOPs rule for sizes nothing here can run: one training step of a worker costs
`6 · N · tokens` floating-point operations (forward 2N, backward 4N per token; attention's own
FLOPs left out), spread over the worker's accelerators at an effective throughput::

    step_s = 6 · N · tokens_per_worker_step / (accelerators_per_worker · flops_per_accelerator)

The throughput follows the precision the run computes in (`--precision`): 400 TFLOP/s effective
per accelerator in bf16 (about 40% of an H100's dense bf16 peak, 989 TFLOP/s), 27 TFLOP/s in fp32
(about 40% of its fp32 peak, 67 TFLOP/s: the trainer leaves TF32 off, PyTorch's default). Other
defaults: 8 accelerators per worker (one node), 524,288 tokens per worker per step (32 sequences
of 2,048 tokens per accelerator).

The tokens of a worker's step (`tokens_per_step`): given (`--tokens-per-step`), else its R ranks'
batches, R × batch_size × seq_len (`--batch-size` is per rank). A bare size (`--params`) has no
workload whose batch this could be: it takes `--batch-size` and `--seq-len` when both are given, and
otherwise the large table's 32 sequences of 2,048 tokens per accelerator, R × 65,536.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property
from types import MappingProxyType

from torch import nn

from ..errors import ConfigError
from ..strategies.base import sync_tensors
from ..strategies.fragments import partition

FLOPS_PER_ACCELERATOR = MappingProxyType({"bf16": 400e12, "fp32": 27e12})  # effective, by --precision
ACCELERATORS_PER_WORKER = 8
SEQUENCES_PER_ACCELERATOR, SEQUENCE_TOKENS = 32, 2048  # a bare size's batch (`tokens_per_step`)
TOKENS_PER_WORKER_STEP = ACCELERATORS_PER_WORKER * SEQUENCES_PER_ACCELERATOR * SEQUENCE_TOKENS  # 2**19
DDP_FIRST_BUCKET_BYTES = 1024 * 1024  # torch.distributed._DEFAULT_FIRST_BUCKET_BYTES
DDP_BUCKET_BYTES = 25 * 1024 * 1024  # DistributedDataParallel(bucket_cap_mb=25)
_STAND_IN_TENSOR = 2**20


def flops_step_s(
    params: float,
    tokens: float = TOKENS_PER_WORKER_STEP,
    accelerators: int = ACCELERATORS_PER_WORKER,
    flops: float = FLOPS_PER_ACCELERATOR["bf16"],
) -> float:
    """Seconds per step by the FLOPs rule: 6·N·tokens / (accelerators · throughput)."""
    return 6.0 * params * tokens / (accelerators * flops)


def tokens_per_step(
    ranks: int, batch_size: int, seq_len: int, *, bare: bool, given: set[str], tokens: float | None = None
) -> tuple[float, str]:
    """(tokens of one worker step, the words that say where they come from): `tokens` when given, else
    the R ranks' batches of `batch_size` sequences of `seq_len` tokens; for a `bare` size (`--params`)
    those two only when both are `given` (a config key's name), else the stated default of
    SEQUENCES_PER_ACCELERATOR × SEQUENCE_TOKENS per accelerator. Half a batch: one line."""
    if tokens is not None:
        return tokens, "given"
    if bare:
        half = {"batch_size", "seq_len"} & given
        if len(half) == 1:
            has, lacks = ("--batch-size", "--seq-len") if "batch_size" in half else ("--seq-len", "--batch-size")
            raise ConfigError(
                f"plan --params: {has} without {lacks} leaves the tokens of a step unknown (the named models' "
                f"batch is not this model's): give {lacks} too, or --tokens-per-step T"
            )
        if not half:
            return ranks * SEQUENCES_PER_ACCELERATOR * SEQUENCE_TOKENS, (
                f"assumed for --params: {SEQUENCES_PER_ACCELERATOR} sequences of {SEQUENCE_TOKENS:,} tokens per "
                f"accelerator x {ranks}; --tokens-per-step, or --batch-size and --seq-len, to change it"
            )
    return ranks * batch_size * seq_len, f"{batch_size} sequences of {seq_len:,} tokens per rank x {ranks}"


def ddp_buckets(
    grad_numels: list[int], first_cap: int = DDP_FIRST_BUCKET_BYTES, cap: int = DDP_BUCKET_BYTES
) -> list[int]:
    """DDP's fp32 gradient buckets in bytes, in the order backward fills them (parameters reversed):
    a bucket closes once it holds at least its cap (the first one's cap is 1 MiB)."""
    out, size = [], 0
    for n in reversed(grad_numels):
        size += 4 * n
        if size >= (first_cap if not out else cap):
            out.append(size)
            size = 0
    if size:
        out.append(size)
    return out


@dataclass(frozen=True)
class ModelSize:
    """The sizes a plan needs: trainable tensors (registration order), the exchanged flat buffer, fragments."""

    name: str
    grad_numels: tuple[int, ...]
    sync_numel: int  # parameters + float persistent buffers
    model: nn.Module | None = None  # the meta-device model (None for a bare size)
    rows: tuple[int, ...] = ()  # each trainable tensor's first dimension (empty: 1-D, as numels)
    buffer_bytes: int = 0  # every buffer, persistent or not: each rank holds them whole
    shapes: tuple[tuple[int, ...], ...] = ()  # each trainable tensor's shape (what a sparse exchange chunks)

    @cached_property
    def params(self) -> int:
        return sum(self.grad_numels)

    def local_params(self, ranks: int = 1) -> int:
        """Elements of the trainable tensors rank 0 holds when FSDP2 shards them over `ranks`."""
        return sum(shard_numel(n, rows, ranks) for n, rows in zip(self.grad_numels, self.rows or self.grad_numels))

    def local_fragments(self, count: int, mode: str = "strided", ranks: int = 1) -> list[int]:
        """Elements of each fragment rank 0 holds when FSDP2 shards the parameters over `ranks`
        (buffers whole)."""
        if self.model is None:
            return [math.ceil(n / ranks) for n in self.fragments(count, mode)]
        return [
            sum(
                shard_numel(t.numel(), t.shape[0] if t.dim() else 1, ranks)
                if isinstance(t, nn.Parameter)
                else t.numel()
                for t in f.tensors
            )
            for f in partition(self.model, count, mode)
        ]

    def fragments(self, count: int, mode: str = "strided") -> list[int]:
        """Elements of each of `count` fragments: the strategy's own partition, or equal shares."""
        if self.model is not None:
            return [f.numel for f in partition(self.model, count, mode)]
        base, extra = divmod(self.sync_numel, count)
        return [base + (1 if p < extra else 0) for p in range(count)]

    @cached_property
    def buckets(self) -> tuple[int, ...]:
        """DDP's gradient buckets in bytes (see `ddp_buckets`)."""
        return tuple(ddp_buckets(list(self.grad_numels)))


def shard_numel(numel: int, rows: int, ranks: int) -> int:
    """Elements of rank 0's chunk of a tensor of `numel` elements in `rows` rows split over `ranks`
    along its first dimension (FSDP2's `Shard(0)`: ⌈rows/ranks⌉ rows)."""
    return math.ceil(rows / ranks) * (numel // rows) if rows else 0


def of_module(name: str, model: nn.Module) -> ModelSize:
    trainable = [p for p in model.parameters() if p.requires_grad]
    return ModelSize(
        name,
        tuple(p.numel() for p in trainable),
        sum(t.numel() for t in sync_tensors(model)),
        model,
        rows=tuple(p.shape[0] if p.dim() else 1 for p in trainable),
        buffer_bytes=sum(b.numel() * b.element_size() for b in model.buffers()),
        shapes=tuple(tuple(p.shape) for p in trainable),
    )


def of_params(params: float) -> ModelSize:
    """A bare size: `params` fp32 parameters in stand-in tensors of 2^20 elements (for a sparse
    exchange's chunks, matrices of 1024 x 1024, a transformer's matrices' blocks; the rest a vector)."""
    n = int(params)
    if n < 1:
        raise ConfigError(f"--params must be >= 1, got {params}")
    full, rest = divmod(n, _STAND_IN_TENSOR)
    numels = (_STAND_IN_TENSOR,) * full + ((rest,) if rest else ())
    side = math.isqrt(_STAND_IN_TENSOR)
    shapes = ((side, side),) * full + (((rest,),) if rest else ())
    return ModelSize(f"{n / 1e9:g}B" if n >= 1e9 else f"{n / 1e6:g}M", numels, n, shapes=shapes)


def of_name(name: str, vocab_size: int = 256) -> ModelSize:
    """A named model (or an hf:PATH one) built on the meta device (`workloads.meta_model`)."""
    from ..workloads import HF_PREFIX, VISION_MODELS, lm_model_names, meta_model

    if name not in lm_model_names() and name not in VISION_MODELS and not name.startswith(HF_PREFIX):
        raise ConfigError(
            f"unknown model {name!r} (LM: {', '.join(lm_model_names())}; "
            f"vision: {', '.join(VISION_MODELS)}; hf:PATH); or give --params N"
        )
    return of_module(name, meta_model(name, vocab_size))
