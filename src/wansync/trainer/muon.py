"""Muon on a model's hidden matrices and AdamW on the rest, as one inner optimizer (`--optimizer muon`).

MuLoCo (Thérien et al., arXiv:2505.23725) is DiLoCo with Muon as the inner optimizer: Muon
(Jordan et al.; torch.optim.Muon) orthogonalizes the momentum of each hidden weight matrix with a
Newton–Schulz iteration, and AdamW trains what is not a hidden matrix. A strategy takes one optimizer
(its `step()`, `zero_grad()`, `state_dict()`, and the schedule's `lr` on every param group), so
`MuonAdamW` is one `torch.optim.Optimizer` whose param groups are the union of a `torch.optim.Muon`'s
and a `torch.optim.AdamW`'s, whose `state` is theirs (one dict, keyed by parameter), and whose step is
theirs. The updates are torch's own: nothing here re-implements them.

**Which parameters are hidden matrices.** The 2-D parameters inside the model's hidden blocks: its
`stages()` between the first and the last when it names them (the LM's transformer blocks: `qkv`,
`out`, `gate_up`, `down`), else its repeated blocks (`strategies.blocks`: a Hugging Face model's
`model.layers`). Everything else goes to AdamW: the embedding and the output head (outside the blocks;
the LM's head is the embedding itself), norms and biases (not 2-D), convolution kernels (4-D), and a
matrix inside a block that is tied to one outside it. A model with no 2-D parameter inside hidden
blocks (the CNN, the ResNets) is refused in one line: Muon would train nothing.

**The learning rate.** A run has one `lr` and one schedule, written on every group (`set_lr`). Muon's
groups take it through Moonlight's shape rule (Liu et al., arXiv:2502.16982; torch's
`adjust_lr_fn="match_rms_adamw"`): a matrix of shape A x B steps by lr x 0.2 x sqrt(max(A, B)),
which gives the orthogonalized update the RMS of a typical AdamW update, so the AdamW learning rate
and weight decay carry over to the matrices. Keller Jordan's rule (torch's default,
sqrt(max(1, A/B))) would need a second, much larger learning rate for the same run. Weight decay is
decoupled in both parts (θ ← θ·(1 − lr·λ), at the unscaled lr). Muon's momentum is 0.95 with Nesterov
and 5 Newton–Schulz steps, torch's defaults; AdamW's betas are (0.9, 0.95) as with `--optimizer adamw`.

**Sharded matrices (FSDP2 inside a worker).** Newton–Schulz needs the whole matrix, and each rank of a
sharded worker holds some rows (a `DTensor`, `Shard(0)` on the worker's mesh). For each such matrix,
each step, every rank of the worker all-gathers the matrix's parameter, gradient and momentum rows in
one collective (the three stacked, `full_tensor()`), runs `torch.optim.Muon`'s step on the whole
matrix, and keeps its own rows of the new parameter and momentum (`distribute_tensor` with
`src_data_rank=None`: a local split, no communication). Every rank computes the same step on the
same full matrix, so a sharded worker takes the step an unsharded worker takes from the same
gradient, and its momentum stays sharded (1/R of it per rank). The cost is one all-gather of three
times each matrix per step inside the worker (where FSDP2 already gathers every parameter twice per
step), the matrix's full size in temporary memory, one matrix at a time, and the Newton–Schulz
compute of the whole matrix on every rank (R times the unsharded worker's, where a rank could instead
orthogonalize 1/R of the matrices and share them: not done). AdamW is elementwise and runs on the
local rows as it is.

    from wansync.trainer.muon import muon_adamw
    optimizer = muon_adamw(model, lr=3e-3, weight_decay=0.0)
    sync = ws.strategy("diloco", model, optimizer, sync_every=50)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterable, cast

import torch
from torch import nn

from ..errors import ConfigError
from ..strategies.base import is_dtensor, local_shard

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor
from ..strategies.blocks import repeated_blocks, unwrap

LR_RULE = "match_rms_adamw"  # Moonlight's: lr x 0.2 x sqrt(max(A, B)) (see the module docstring)
MUON_MOMENTUM = 0.95
ADAMW_BETAS = (0.9, 0.95)  # `--optimizer adamw`'s too
ADAMW_EPS = 1e-8  # torch's default
# torch steps a CPU model's parameters one at a time by default and a GPU's with its foreach kernels; on the
# CPU those give the same bits (tests/test_optim_foreach.py) in less time, more so on FSDP2's DTensors (a
# dispatch per list, not per parameter): the inner optimizers wansync builds take them on either
FOREACH = True
# the hyperparameters of a Muon param group, as torch.optim.Muon's constructor takes them
MUON_KEYS = ("lr", "weight_decay", "momentum", "nesterov", "ns_coefficients", "eps", "ns_steps", "adjust_lr_fn")


def hidden_blocks(model: nn.Module) -> list[nn.Module]:
    """The model's hidden blocks: its `stages()` between the first and the last when it names at least
    three, else its repeated blocks (`strategies.blocks`), else none."""
    model = unwrap(model)
    named = getattr(model, "stages", None)
    stages = list(named()) if callable(named) else []
    if len(stages) >= 3:
        return stages[1:-1]
    found = repeated_blocks(model)
    return [m for _, m in found.blocks] if found is not None else []


def split_parameters(model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """(the hidden matrices, the rest) of the model's trainable parameters, in the model's order: a
    hidden matrix is 2-D, held by a module inside a hidden block, and by no module outside them."""
    inside_modules = {id(m) for block in hidden_blocks(model) for m in block.modules()}
    inside: set[int] = set()
    outside: set[int] = set()
    for _, module in unwrap(model).named_modules(remove_duplicate=False):
        for p in module.parameters(recurse=False):
            (inside if id(module) in inside_modules else outside).add(id(p))
    params = [p for p in model.parameters() if p.requires_grad]
    matrices = [p for p in params if p.ndim == 2 and id(p) in inside and id(p) not in outside]
    chosen = {id(p) for p in matrices}
    return matrices, [p for p in params if id(p) not in chosen]


def muon_adamw(
    model: nn.Module,
    *,
    lr: float,
    weight_decay: float,
    no_decay: Iterable[Any] = (),
    betas: tuple[float, float] = ADAMW_BETAS,
    eps: float = ADAMW_EPS,
) -> MuonAdamW:
    """`MuonAdamW` on `model`: Muon on its hidden matrices, AdamW (`betas`, `eps`) on the rest
    (`split_parameters`). `no_decay`: parameters AdamW trains without weight decay (a Hugging Face
    Trainer's biases and norms); a hidden matrix always decays."""
    matrices, others = split_parameters(model)
    if not matrices:
        raise ConfigError(
            f"optimizer muon: {type(unwrap(model)).__name__} has no 2-D weight inside hidden blocks (its "
            f"stages() between the first and the last, or its repeated blocks), so Muon would train nothing "
            f"and AdamW everything: use adamw"
        )
    skip = {id(p) for p in no_decay}
    groups = [
        {"params": [p for p in others if id(p) not in skip], "weight_decay": weight_decay},
        {"params": [p for p in others if id(p) in skip], "weight_decay": 0.0},
    ]
    others_groups = [g for g in groups if g["params"]]
    return MuonAdamW(matrices, others_groups, lr=lr, weight_decay=weight_decay, betas=betas, adamw_eps=eps)


class MuonAdamW(torch.optim.Optimizer):
    """`torch.optim.Muon` on `matrices` and `torch.optim.AdamW` on `others` (parameters or param-group
    dicts), as one optimizer: its `param_groups` are Muon's, then AdamW's (the very dicts they step
    with), its `state` theirs, `state_dict()`/`load_state_dict()` round-trip both. Matrices sharded
    with FSDP2 (`DTensor`) step on the whole matrix, gathered within their mesh (the module
    docstring)."""

    def __init__(
        self,
        matrices: Iterable[nn.Parameter],
        others: Iterable[Any],
        *,
        lr: float = 1e-3,
        weight_decay: float = 0.0,
        momentum: float = MUON_MOMENTUM,
        betas: tuple[float, float] = ADAMW_BETAS,
        adamw_eps: float = ADAMW_EPS,
    ):
        matrices, others = list(matrices), list(others)
        whole = [p for p in matrices if not is_dtensor(p)]
        sharded = [p for p in matrices if is_dtensor(p)]
        muon: dict[str, Any] = {"lr": lr, "weight_decay": weight_decay, "momentum": momentum, "adjust_lr_fn": LR_RULE}
        # torch refuses an optimizer of no parameters: each part exists only when it has some
        self._muon = torch.optim.Muon(whole, **muon) if whole else None
        self._adamw = (
            torch.optim.AdamW(others, lr=lr, weight_decay=weight_decay, betas=betas, eps=adamw_eps, foreach=FOREACH)
            if others
            else None
        )
        # the sharded matrices' group, made (and checked: 2-D, valid values) by torch's Muon, stepped here
        self._sharded: list[dict[str, Any]] = torch.optim.Muon(sharded, **muon).param_groups if sharded else []
        parts = (
            self._muon.param_groups if self._muon else [],
            self._sharded,
            self._adamw.param_groups if self._adamw else [],
        )
        self._counts = tuple(len(groups) for groups in parts)
        super().__init__([g for groups in parts for g in groups], {})  # the same dicts: set_lr reaches both
        self._link()

    def _link(self) -> None:
        """Point the parts at this optimizer's groups and state (again after `load_state_dict`, which
        replaces both)."""
        n_whole, n_sharded, _ = self._counts
        groups = self.param_groups
        if self._muon is not None:
            self._muon.param_groups, self._muon.state = groups[:n_whole], self.state
        self._sharded = groups[n_whole : n_whole + n_sharded]
        if self._adamw is not None:
            self._adamw.param_groups, self._adamw.state = groups[n_whole + n_sharded :], self.state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self._link()

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._muon is not None:
            self._muon.step()
        for group in self._sharded:
            for p in group["params"]:
                if p.grad is not None:
                    self._step_sharded(p, group)
        if self._adamw is not None:
            self._adamw.step()
        return loss

    def _step_sharded(self, p: DTensor, group: dict[str, Any]) -> None:
        """Muon's step on the whole of the sharded matrix `p`: gather its parameter, gradient and
        momentum rows (one collective), step the full matrix with torch's Muon, keep this rank's rows."""
        from torch.distributed.tensor import DTensor, Shard, distribute_tensor

        state = self.state[p]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(p)  # a DTensor like p: the momentum stays sharded
        buf = state["momentum_buffer"]
        grad = cast(DTensor, p.grad)
        if grad.placements != p.placements:
            grad = grad.redistribute(p.device_mesh, p.placements)
        # the three stacked on a new leading dim: each placement's sharded dim moves one along
        placements = [Shard(pl.dim + 1) if isinstance(pl, Shard) else pl for pl in p.placements]
        stacked = torch.stack([local_shard(p), local_shard(grad), local_shard(buf)])
        full = DTensor.from_local(
            stacked, p.device_mesh, placements, shape=torch.Size((3, *p.shape)), stride=(p.numel(), p.shape[1], 1)
        ).full_tensor()
        param, momentum = full[0], full[2]
        param.grad = full[1]
        whole = torch.optim.Muon([param], **{k: group[k] for k in MUON_KEYS})
        whole.state[param]["momentum_buffer"] = momentum
        whole.step()  # in place on `full`'s rows of the parameter and the momentum
        mine = distribute_tensor(full, p.device_mesh, placements, src_data_rank=None).to_local()
        local_shard(p).copy_(mine[0])
        local_shard(buf).copy_(mine[2])
