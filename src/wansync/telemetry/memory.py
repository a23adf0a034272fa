"""What a rank holds in memory, by category: summary.json's `memory_per_rank`, the figures
`benchmarks/memory_bill.py` measures, and what the planner's formula (`planner.memory`) predicts.

Every tensor is counted once, by the storage it lies in: a byte goes to the first category below
whose tensors cover it, and the bytes of a storage that no tensor covers (the padding FSDP2 puts
after a shard) to the first category that reached the storage.

- `parameters`: the model's parameters (this rank's shards when FSDP2 shards them) and buffers;
- `gradients`: their gradients. `zero_grad(set_to_none=True)` frees them between steps; then the
  bill counts what every backward allocates again, one gradient per trainable shard;
- `inner_optimizer`: the inner optimizer's state (AdamW: two moments and a step count per tensor;
  DeMo's momentum, the state of the optimizer it replaces);
- `outer_state`: the strategy's anchors θ̃ and their outer-optimizer state (momentum; SparseLoCo's
  error buffer, which takes its place), and per exchange in flight its pseudo-gradient Δ and θ(t_p);
- `ddp_buckets`: DDP's gradient buckets, which live in C++ (their sizes from DDP's logging data);
- `exchange`: anything else the strategy holds: the part of a periodic strategy's flat buffer
  beyond the model (the drift's element) and the exchange's buffers in flight (the copy of Δ being
  averaged, a lossy codec's payload and the gathered payloads).

The strategy is walked, not asked: its anchors (`anchor`, `anchors`), its exchanges in flight
(`timetable.in_flight`), and for `exchange` every tensor reachable from its attributes through
wansync objects, containers and closures (a mean in flight keeps its buffers in one).
"""

from __future__ import annotations

from typing import Any, Iterable, Iterator

import torch

from .commtime import ddp_modules

CATEGORIES = ("parameters", "gradients", "inner_optimizer", "outer_state", "ddp_buckets", "exchange")


def local(t: torch.Tensor) -> torch.Tensor:
    """The tensor this rank holds: a DTensor's local shard, any other tensor itself."""
    return getattr(t, "_local_tensor", t)


class Bill:
    """Bytes by category, each storage byte counted once (see the module docstring)."""

    def __init__(self) -> None:
        self.bytes = dict.fromkeys(CATEGORIES, 0)
        self.host = 0  # of these, in host memory beside an accelerator model
        self._storages: dict[int, tuple[int, str, bool, list[tuple[int, int]]]] = {}
        self._accelerator = False

    def on_accelerator(self, model: torch.nn.Module) -> None:
        self._accelerator = any(p.device.type != "cpu" for p in model.parameters())

    def claim(self, category: str, tensors: Iterable[Any]) -> None:
        """Count the bytes of `tensors` not counted yet under `category`."""
        for t in tensors:
            if not isinstance(t, torch.Tensor):
                continue
            t = local(t)
            storage = t.untyped_storage()
            size = storage.nbytes()
            if size == 0:
                continue
            entry = self._storages.setdefault(storage.data_ptr(), (size, category, t.device.type == "cpu", []))
            host, covered = entry[2], entry[3]
            item = t.element_size()
            span = 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride())) if t.numel() else 0
            start = t.storage_offset() * item
            new = _new_bytes(covered, (start, start + span * item))
            self.add(category, new, host)

    def add(self, category: str, n: int, host: bool = False) -> None:
        """Count `n` bytes under `category` that no Python tensor holds."""
        self.bytes[category] += n
        if host and self._accelerator:
            self.host += n

    def close(self) -> dict[str, int]:
        """The bill: bytes by category, `total`, and `host` (the part in host memory when the model
        is on an accelerator: the outer state under `outer_state_device=cpu`)."""
        for size, first, host, covered in self._storages.values():
            self.add(first, size - sum(b - a for a, b in covered), host)  # bytes no tensor covers
        self._storages = {}
        return {**self.bytes, "total": sum(self.bytes.values()), "host": self.host}


def _new_bytes(covered: list[tuple[int, int]], span: tuple[int, int]) -> int:
    """Add the byte range `span` to the disjoint, sorted ranges `covered` (in place); return how
    many of its bytes were not covered yet."""
    before = sum(b - a for a, b in covered)
    merged: list[tuple[int, int]] = []
    for a, b in sorted([*covered, span]):
        if merged and a <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], b))
        else:
            merged.append((a, b))
    covered[:] = merged
    return sum(b - a for a, b in merged) - before


def memory_per_rank(model: torch.nn.Module, optimizer: torch.optim.Optimizer, sync: Any) -> dict[str, int]:
    """Bytes this rank holds by category (`CATEGORIES`), their `total` and the `host` part."""
    bill = Bill()
    bill.on_accelerator(model)
    params = list(model.parameters())
    bill.claim("parameters", [*params, *model.buffers()])
    grads = [p.grad for p in params if p.grad is not None]
    if grads:
        bill.claim("gradients", grads)
    else:  # freed by zero_grad: what each backward allocates again
        bill.add("gradients", sum(local(p).numel() * p.element_size() for p in params if p.requires_grad))
    held = sync.state_tensors() if hasattr(sync, "state_tensors") else {}
    bill.claim("inner_optimizer", [*optimizer_tensors(optimizer), *held.get("inner_optimizer", ())])
    bill.claim("outer_state", [*outer_tensors(sync), *held.get("outer_state", ())])
    bill.add("ddp_buckets", ddp_bucket_bytes(sync))
    bill.claim("exchange", reachable(vars(sync)))
    return bill.close()


def optimizer_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]


def outer_tensors(sync: Any) -> Iterator[torch.Tensor]:
    """The anchors' θ̃ and outer-optimizer state; per exchange in flight, Δ and θ(t_p)."""
    anchors = [a for a in (getattr(sync, "anchor", None), *getattr(sync, "anchors", ())) if a is not None]
    for anchor in anchors:
        yield anchor.value
        yield from optimizer_tensors(anchor.optimizer)
    for x in getattr(getattr(sync, "timetable", None), "in_flight", ()):
        yield from (t for t in (x.delta, x.theta_start) if t is not None)


def ddp_bucket_bytes(sync: Any) -> int:
    """Bytes of the gradient buckets of every DDP wrapper the strategy holds (its gradient phase,
    the DDP inside its worker), from DDP's logging data: they live in C++."""
    total = 0
    for ddp in ddp_modules(sync):
        sizes = ddp._get_ddp_logging_data().get("bucket_sizes", "")
        total += sum(int(s) for s in str(sizes).split(",") if s.strip())
    return total


def reachable(root: Any) -> Iterator[torch.Tensor]:
    """Every tensor reachable from `root` through containers, wansync objects, closures and torch
    optimizers (not through modules: their tensors are the model's, counted as parameters)."""
    seen: set[int] = set()
    stack = [root]
    while stack:
        obj = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            yield obj
        elif isinstance(obj, dict):
            stack.extend(obj.values())
        elif isinstance(obj, (list, tuple, set, frozenset)):
            stack.extend(obj)
        elif isinstance(obj, torch.optim.Optimizer):
            stack.append(optimizer_tensors(obj))
        elif callable(obj) and getattr(obj, "__closure__", None):
            stack.extend(c.cell_contents for c in obj.__closure__ if c.cell_contents is not None)
        elif type(obj).__module__.startswith("wansync.") and hasattr(obj, "__dict__"):
            stack.extend(vars(obj).values())
