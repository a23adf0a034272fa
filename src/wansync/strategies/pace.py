"""Workers of different speeds: which steps each one computes, and what its contribution weighs.

Every worker walks the same steps (the strategy's timetable counts them, so every exchange happens at
the same step everywhere), but a worker may sit a step out (`Strategy.step(idle=True)`: no forward,
no backward, no inner update). Which ones, per outer round of H = `sync_every` steps, is the policy:

- ``wait`` (the default, every strategy's behaviour so far): every worker computes every step, and
  the fast ones wait for the slowest at each exchange.
- ``deadline``: the round closes at a wall-clock deadline, ``deadline`` seconds after it began (0:
  1.1 x H x the median of the workers' step times, measured over the rounds before; the first round
  has none), the time the loop spends on evaluations and checkpoints not counted (`Pace.pause`). A worker computes a step only while it can finish it before the deadline (its own step
  time, measured), always the round's first; the rest of the round it sits out, so the round ends
  for every worker near the deadline. Rounds end by the clock: runs are not reproducible bit for bit.
- ``balanced``: each worker computes H_m = round(H · v_m / max v) steps of the round, spread evenly
  over it (v_m: its speed, 1 / its median step time, measured over the rounds before), so that all
  arrive together; a worker within 10 % of the fastest computes all H (measurements are noisy). Decided from numbers every rank holds alike: reproducible where the speeds are.

Under both, a worker's contribution to a mean is weighted by the steps it computed since the buffer's
last exchange, n_m: the exchange averages Σ_m w_m x_m / Σ_m w_m with w_m = n_m / H (`Exchange.mean`'s
`weight`). This is FedAvg's weighting by the samples each client processed (McMahan et al. 2017,
arXiv:1602.05629) with the partial work FedProx lets a straggler contribute (Li et al. 2020,
arXiv:1812.06127); FedNova (Wang et al. 2020, arXiv:2007.07481) shows it biases the objective towards
the faster workers' data and normalizes each update by its steps instead. We weight by steps, as the
issue asked and FedAvg does: each worker's data counts by what it processed. Under ``wait`` nothing
is weighted (every n_m = H): the bits are those of the unweighted mean.

The speeds are agreed, not assumed: at every round's end each rank puts its median step time of the
round into its worker's slot of a vector and the workers all-reduce it (the first round's at once,
every later one in the background: round r's vector is read at the end of round r + 1), so every
rank reads the same times. The first round runs as ``wait``: nothing is measured before it.
Within a worker of several ranks a ``deadline`` decision is taken by all its ranks together (a MIN
over the worker: none may sit out a step another computes, their DDP would wait).
"""

from __future__ import annotations

import statistics
import time
from typing import TYPE_CHECKING, Any

from ..errors import ConfigError
from .options import Needs, at_least, one_of, option

if TYPE_CHECKING:
    import torch

POLICIES = ("wait", "deadline", "balanced")
DEADLINE_SLACK = 1.1  # the automatic deadline: the median worker's H steps, and 10 % more
BALANCE_TOLERANCE = 0.1  # balanced: a worker within 10 % of the fastest computes every step (noise)
# what a contribution of no computed step weighs: not 0, so that where no worker computed a step since
# the buffer's last exchange (a streaming fragment's final sync after the deadline closed a round) the
# mean is the plain one; a power of two, so that scaling by it loses no bit
NO_STEPS_WEIGHT = 2.0**-20


def slow_policy() -> Any:
    return option(
        "wait",
        "workers of different speeds: wait (the fast wait for the slowest) | deadline (each outer "
        "round closes at a deadline; a worker contributes the steps it completed, weighted by them) | "
        "balanced (each worker's steps per round set from its measured speed so all arrive together)",
        one_of(POLICIES),
    )


def deadline() -> Any:
    return option(
        0.0,
        "seconds an outer round may take under slow_policy deadline (0: 1.1 x H x the workers' "
        "median step time, measured)",
        at_least(0),
        needs=Needs(
            lambda o: o.slow_policy == "deadline",
            "deadline {deadline:g} s does nothing under slow_policy {slow_policy}: give slow_policy deadline, "
            "or leave deadline out",
        ),
    )


class Pace:
    """The policy of one rank (module docstring): `computes(t)` before step t, `after_step` after it."""

    def __init__(
        self,
        policy: str,
        rounds_of: int,
        deadline_s: float,
        replicas: Any,
        worker: int = 0,
        workers: int = 1,
        group: Any = None,
    ):
        """`worker` of `workers`: this rank's worker; `group`: the ranks that agree on the speeds (every
        rank of every worker: None, the default group, for workers of several ranks)."""
        self.policy, self.H, self.deadline_s = policy, rounds_of, deadline_s
        self.replicas, self.worker, self.workers, self.group = replicas, worker, workers, group
        self.computed = 0  # steps this worker computed, over the run
        self.times: list[float] = []  # this round's computed steps' seconds
        self.agreed: list[float] | None = None  # every worker's median step time, as last agreed
        self._vector: torch.Tensor | None = None
        self._work: Any = None
        self._round_start: float | None = None
        self._paused = 0.0  # this round's time on evaluations and checkpoints (`pause`)
        self._gap_paused = 0.0  # the same since the last step
        self._decided: dict[int, bool] = {}

    @property
    def active(self) -> bool:
        return self.policy != "wait"

    # ---- before a step: does this worker compute it? ---------------------------------------------
    def computes(self, t: int) -> bool:
        """Does this worker compute step t (1-based)? Always under `wait`; the same answer on every
        rank of a worker."""
        if not self.active or self.agreed is None:
            return True
        if t not in self._decided:
            self._decided = {t: self._decide(t)}
        return self._decided[t]

    def _decide(self, t: int) -> bool:
        k = (t - 1) % self.H  # the step's place in its round, from 0
        if self.policy == "balanced":
            return self.planned_slots(self.worker)[k]
        if k == 0 or self._round_start is None:
            return True
        mine = statistics.median(self.times) if self.times else self.agreed[self.worker]
        go = time.perf_counter() - self._round_start - self._paused + mine <= self.round_deadline()
        return self._worker_agrees(go)

    def steps_for(self, worker: int) -> int:
        """`balanced`: the steps worker `worker` computes per round, from the agreed speeds."""
        assert self.agreed is not None
        fastest = min(self.agreed)
        if self.agreed[worker] <= (1 + BALANCE_TOLERANCE) * fastest:
            return self.H
        return max(1, min(self.H, round(self.H * fastest / self.agreed[worker])))

    def planned_slots(self, worker: int) -> list[bool]:
        """Which steps of a round worker `worker` computes, by the agreed times: `balanced`'s own rule;
        for `deadline` the steps that would finish before the deadline if each took the worker's agreed
        time (at run time the clock decides). What the planner replays (`planner.predict`)."""
        if not self.active or self.agreed is None:
            return [True] * self.H
        if self.policy == "balanced":
            n = self.steps_for(worker)
            return [(k + 1) * n // self.H > k * n // self.H for k in range(self.H)]
        n = max(1, min(self.H, int(self.round_deadline() // self.agreed[worker])))
        return [k < n for k in range(self.H)]

    def round_deadline(self) -> float:
        """`deadline`: seconds the round may take (the option, or from the agreed step times)."""
        assert self.agreed is not None
        return self.deadline_s or DEADLINE_SLACK * self.H * statistics.median(self.agreed)

    def _worker_agrees(self, go: bool) -> bool:
        inside = self.replicas.inside
        if inside is None or self.replicas.ranks_per_worker == 1:
            return go
        import torch  # here, not at the top: the policy's options are declared without torch (`catalog.py`)
        import torch.distributed as dist

        flag = torch.tensor([1 if go else 0], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=inside)
        return bool(flag.item())

    # ---- after a step --------------------------------------------------------------------------
    def pause(self, seconds: float) -> None:
        """The loop spent `seconds` on something that is not training (an evaluation, a checkpoint:
        `telemetry.run.Run` says so): it counts neither against the round's deadline nor in a step's time."""
        self._paused += seconds
        self._gap_paused += seconds

    def after_step(self, t: int, computed: bool, seconds: float | None) -> None:
        """Step t is done (`computed`: this worker computed it, in `seconds`). At a round's end the
        workers' step times are agreed (in the background) and the next round begins."""
        if seconds is not None:
            seconds = max(0.0, seconds - self._gap_paused)
        self._gap_paused = 0.0
        if computed:
            self.computed += 1
            if seconds is not None:
                self.times.append(seconds)
        if not self.active:
            return
        if t % self.H == 0:
            self._agree()
            self._round_start, self._paused = time.perf_counter(), 0.0
        elif self._round_start is None:
            self._round_start, self._paused = time.perf_counter(), 0.0

    def _agree(self) -> None:
        """The round's median step time of every worker: this round's all-reduce started, the last
        round's read (every rank the same vector)."""
        import torch
        import torch.distributed as dist

        if self._work is not None:
            self._work.wait()
            self.agreed = [float(v) for v in self._vector]
        r, workers = self.replicas.ranks_per_worker, self.workers
        vector = torch.zeros(workers, dtype=torch.float64)
        mine = statistics.median(self.times) if self.times else (self.agreed or [0.0] * workers)[self.worker]
        vector[self.worker] = mine / r
        self.times = []
        if not dist.is_initialized() or dist.get_world_size() == 1:
            self.agreed = [float(v) for v in vector]
            return
        self._vector, self._work = vector, dist.all_reduce(vector, group=self.group, async_op=True)
        if self.agreed is None:  # the first: waited for at once, so the policy starts now
            self._work.wait()
            self.agreed, self._work = [float(v) for v in vector], None

    # ---- what a contribution weighs --------------------------------------------------------------
    def weight(self, since: int) -> float | None:
        """The weight of a contribution that holds the steps computed since `since` (a count of
        `computed`): their share of a round (`NO_STEPS_WEIGHT` for none), or None under `wait` (an
        unweighted mean)."""
        if not self.active:
            return None
        return (self.computed - since) / self.H or NO_STEPS_WEIGHT

    # ---- resumable -------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        if self._work is not None:
            self._work.wait()
            self.agreed, self._work = [float(v) for v in self._vector], None
        return {"computed": self.computed, "times": list(self.times), "agreed": self.agreed}

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        if not state:
            return
        self.computed = int(state["computed"])
        self.times = [float(x) for x in state.get("times", [])]
        self.agreed = None if state.get("agreed") is None else [float(x) for x in state["agreed"]]


def check_every_worker_steps(opts: Any, strategy: str, why: str) -> None:
    """An Options cross-check: a strategy whose steps need every worker (a DDP step) takes `wait` only."""
    if getattr(opts, "slow_policy", "wait") != "wait":
        raise ConfigError(
            f"{strategy} takes slow_policy wait only, not {opts.slow_policy}: {why}, which a worker "
            f"sitting a step out cannot join"
        )
