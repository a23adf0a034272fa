"""Every strategy's options, and the registry's list of strategies: a name and its `Options` each.

This module imports no torch. Everything the command line shows of a strategy comes from here: the
`[strategy]` config keys and their `--flags`, each with its help, default and rules, and the checks
that relate them. So `wansync --help`, and each subcommand's, needs no torch. An algorithm's update
lives in the module of its name (`ddp.py` … `demo.py`), whose class declares the same `Options`. The
registry (`strategies/__init__.py`) imports that module only when the class is wanted: to build the
strategy, or to read its timetable or class attributes. `OPTIONS_OF` is the list: adding a strategy
is its module and one entry here.

The options nest as the algorithms do: post-local SGD's extend LocalSGD's, SlowMo's add the slow
momentum, CPDP's are SlowMo's with the paper's K and β, DiLoCo's add the outer optimizer, CoCoDC's
extend Streaming DiLoCo's. The sources of each default are in the algorithm's module docstring.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType

from ..comm.choices import DEFAULT_DENSITY
from ..errors import check
from ..rules import positive_or_inf
from .options import (
    Needs,
    Options,
    aggregate,
    at_least,
    check_sparse_options,
    chunk,
    codec,
    codec_collective,
    dct,
    density,
    error_decay,
    error_feedback,
    in_range,
    one_of,
    option,
    outer_lr,
    outer_momentum,
    outer_state_device,
    overlap_rounds,
    positive,
    quant_range,
    robust_kappa,
    robust_mean,
    sync_every,
    topk,
    value_bits,
)
from .pace import check_every_worker_steps, deadline, slow_policy


# ---- the periodic strategies (`periodic.py`): LocalSGD, post-local SGD, SlowMo, CPDP, DiLoCo ------
@dataclass
class PeriodicOptions(Options):
    """The knobs of every periodic strategy; with these defaults, LocalSGD's."""

    sync_every: int = sync_every(8)
    sync_optimizer_state: bool = option(False, "average the inner optimizer's state at every boundary")
    drift_telemetry: bool = option(
        True, "report worker drift at every boundary (one more element of the parameter exchange)"
    )
    codec: str = codec()
    codec_collective: str = codec_collective()
    error_feedback: bool = error_feedback()
    slow_policy: str = slow_policy()
    deadline: float = deadline()
    robust_mean: str = robust_mean()
    robust_kappa: float = robust_kappa()


@dataclass
class PostLocalSGDOptions(PeriodicOptions):
    """LocalSGD's (H counted after the switch), plus when to switch."""

    switch_step: int = option(100, "DDP for steps 1 ... switch_step, LocalSGD after", at_least(0))

    def cross_check(self) -> None:
        super().cross_check()
        if self.switch_step:
            check_every_worker_steps(self, "post_local_sgd", "its steps up to switch_step are DDP steps")


@dataclass
class SlowMoOptions(PeriodicOptions):
    """LocalSGD's (H is τ in the SlowMo paper), plus the slow momentum β and slow learning rate α."""

    slowmo_beta: float = option(0.5, "slow momentum beta", in_range(0, 1))
    slowmo_lr: float = option(1.0, "slow learning rate alpha", positive)
    outer_state_device: str = outer_state_device()


@dataclass
class CPDPOptions(SlowMoOptions):
    """SlowMo's with the paper's K = 4 and β = 0.3 (0: the reviewers' "β = 0" ablation), plus phase 1."""

    sync_every: int = sync_every(4)
    slowmo_beta: float = SlowMoOptions.with_default("slowmo_beta", 0.3)
    grad_phase: bool = option(
        True, "gradient all-reduce at each reconciliation step (phase 1; " "off: the LocalSGD+SlowMo ablation)"
    )

    def cross_check(self) -> None:
        super().cross_check()
        if self.grad_phase:
            check_every_worker_steps(self, "cpdp", "its step K all-reduces every worker's gradients (a DDP step)")


@dataclass
class DiLoCoOptions(PeriodicOptions):
    """The periodic knobs with H = 100, plus the outer optimizer's."""

    sync_every: int = sync_every(100)
    outer_lr: float = outer_lr()
    outer_momentum: float = outer_momentum()
    outer_state_device: str = outer_state_device()
    overlap_rounds: bool = overlap_rounds()


# ---- the fragment strategies (`fragments.py`, `fragment_timetable.py`): Streaming DiLoCo, CoCoDC ------
PARTITIONS = ("strided", "sequential")  # how a model's blocks are dealt to fragments (`fragments.partition`)
SCHEDULES = ("adaptive", "adaptive_fair", "round_robin")  # which fragment syncs next (`fragments.Schedule`)
COMPENSATIONS = ("taylor", "alpha", "damped")  # CoCoDC's merge of a late fragment
OUTER_SCALINGS = ("none", "interval")  # CoCoDC's outer learning rate of a merge


@dataclass
class StreamingOptions(Options):
    """Fragments, overlap and the merge; the outer optimizer is DiLoCo's, per fragment."""

    sync_every: int = sync_every(100)
    fragments: int = option(4, "number of fragments P", at_least(1))
    overlap: int = option(5, "overlap depth tau: inner steps while a fragment syncs")
    alpha: float = option(0.5, "weight of the local fragment in the merge", in_range(0, 1, high_included=True))
    outer_lr: float = outer_lr()
    outer_momentum: float = outer_momentum()
    outer_state_device: str = outer_state_device()
    codec: str = codec("exchanged pseudo-gradients")
    codec_collective: str = codec_collective()
    error_feedback: bool = error_feedback()
    partition: str = option("strided", f"fragment partition: {'|'.join(PARTITIONS)}", one_of(PARTITIONS))
    syncs_per_period: int = option(0, "fragment syncs per period N (0: one per fragment, N = P)")
    eager: bool = option(
        False,
        "eager updates (arXiv:2502.12996): each worker steps with its own pseudo-gradient / "
        "M at a sync's start and swaps that for the mean's step when it arrives (replaces the merge: "
        "alpha and CoCoDC's compensation are not used)",
    )
    slow_policy: str = slow_policy()
    deadline: float = deadline()
    robust_mean: str = robust_mean()
    robust_kappa: float = robust_kappa()

    def cross_check(self) -> None:
        super().cross_check()
        h, p = self.sync_every, self.fragments
        check(p <= h, f"fragments ({p}) must be <= sync_every ({h})")
        check(0 <= self.overlap < h, f"overlap (tau) must be in [0, sync_every) = [0, {h}), got {self.overlap}")
        check(
            self.syncs_per_period == 0 or p <= self.syncs_per_period <= h,
            f"syncs_per_period must be 0 (automatic) or between fragments ({p}) and sync_every "
            f"({h}), got {self.syncs_per_period}",
        )


def AUTOMATIC_N(what: str) -> Needs:  # noqa: N802 - reads as the condition it declares
    """The knobs of the automatic N act only when N is not given."""
    return Needs(
        lambda o: o.syncs_per_period == 0,
        f"{what} sets the automatic syncs_per_period, and syncs_per_period {{syncs_per_period}} is given, so it "
        f"would do nothing: drop one of the two",
    )


@dataclass
class CoCoDCOptions(StreamingOptions):
    """Streaming DiLoCo's (`alpha`: the damping of compensation=damped and =alpha), plus compensation and
    adaptation."""

    syncs_per_period: int = option(
        0, "fragment syncs per period N (0: N from gamma, T_c and T_s, decided at " "step H)"
    )
    max_syncs_per_fragment: int = option(
        2,
        "automatic N: at most this many syncs of each fragment per period, "
        "N <= this*P (0: no cap, N <= H as in the paper)",
        at_least(0),
        needs=AUTOMATIC_N("max_syncs_per_fragment {max_syncs_per_fragment}"),
    )
    outer_scaling: str = option(
        "none",
        f"outer lr of a merge: {'|'.join(OUTER_SCALINGS)} (interval: "
        "outer_lr*I_p/H, I_p the steps the pseudo-gradient covers)",
        one_of(OUTER_SCALINGS),
    )
    lam: float = option(
        0.5,
        "delay-compensation strength lambda",
        at_least(0),
        needs=Needs(
            lambda o: o.compensation != "alpha",
            "lam {lam:g} is the Taylor term's strength, and compensation alpha has none, so it would do "
            "nothing: drop it, or give compensation taylor or damped",
        ),
    )
    gamma: float = option(0.4, "network utilization target gamma", positive, needs=AUTOMATIC_N("gamma {gamma:g}"))
    schedule: str = option("adaptive_fair", f"which fragment syncs next: {'|'.join(SCHEDULES)}", one_of(SCHEDULES))
    compensation: str = option("damped", f"merge of a late fragment: {'|'.join(COMPENSATIONS)}", one_of(COMPENSATIONS))


# ---- the sparse strategies (`comm/sparse.py`'s payload): SparseLoCo, DeMo -------------------------
@dataclass
class SparseLoCoOptions(Options):
    """H, the outer step, the error feedback and the sparse payload's knobs (sources: `sparseloco.py`)."""

    sync_every: int = sync_every(30)
    outer_lr: float = option(
        1.0, "α: the outer step θ̃ ← θ̃ − α·Δ̄ on the aggregated sparse pseudo-gradient (no " "momentum)", positive
    )
    error_decay: float = error_decay()
    density: float = density(DEFAULT_DENSITY)
    topk: int = topk()
    chunk: int = chunk()
    bits: int = value_bits(2)
    quant_range: float = quant_range()
    dct: bool = dct()
    aggregate: str = aggregate()
    outer_state_device: str = outer_state_device()
    slow_policy: str = slow_policy()
    deadline: float = deadline()
    overlap_rounds: bool = overlap_rounds()
    robust_mean: str = robust_mean()
    robust_kappa: float = robust_kappa()

    def cross_check(self) -> None:
        super().cross_check()
        check_sparse_options(self, DEFAULT_DENSITY)


@dataclass
class DeMoOptions(Options):
    """β and the sparse payload's knobs (sources: `demo.py`)."""

    momentum_decay: float = option(0.999, "β: the momentum's decay, m ← β·m + g, before each send", in_range(0, 1))
    density: float = density(DEFAULT_DENSITY)
    topk: int = topk()
    chunk: int = chunk()
    bits: int = value_bits(32)
    quant_range: float = quant_range()
    aggregate: str = aggregate()
    robust_mean: str = robust_mean()
    robust_kappa: float = robust_kappa()

    def cross_check(self) -> None:
        super().cross_check()
        check_sparse_options(self, DEFAULT_DENSITY)


# ---- asynchronous DiLoCo (`async_diloco.py`, its syncer `syncer.py`) --------------------------------
STALENESS_RULES = ("none", "polynomial", "delayed_nesterov")  # `staleness.py`
#: a knob of the sparse payload acts only where the learners send it
SPARSE_PAYLOAD = (
    Needs(
        lambda o: o.sparse,
        "{key} shapes the sparse payload, and sparse is off (each learner sends its codec's dense payload), so "
        "it would do nothing: drop it, or give sparse true",
    ),
)


@dataclass
class AsyncDiLoCoOptions(Options):
    """Each learner's H and payload (the codec's, or SparseLoCo's sparse one with its knobs and defaults),
    DiLoCo's outer optimizer, and the syncer's quorum, grace window, staleness bound and rule (sources:
    `async_diloco.py`, `syncer.py`, `staleness.py`, `sparseloco.py`)."""

    sync_every: int = sync_every(100)
    outer_lr: float = outer_lr()
    outer_momentum: float = outer_momentum()
    merge_quorum: int = option(
        1, "contributions the syncer waits for before it merges (of the learners connected)", at_least(1)
    )
    grace: float = option(
        0.5,
        "seconds the syncer waits for more contributions once the quorum is in (inf: every learner connected)",
        positive_or_inf,
    )
    max_staleness: int = option(
        4, "a contribution based on a version more than this many versions old is dropped", at_least(0)
    )
    staleness_rule: str = option(
        "delayed_nesterov",
        f"what a merge does with stale pseudo-gradients: {'|'.join(STALENESS_RULES)}",
        one_of(STALENESS_RULES),
    )
    dn_period: int = option(
        0,
        "delayed Nesterov's period N in merges (0: learners / merge_quorum, rounded)",
        at_least(0),
        needs=Needs(
            lambda o: o.staleness_rule == "delayed_nesterov",
            "dn_period {dn_period} is delayed Nesterov's period, and staleness_rule is {staleness_rule}, so it "
            "would do nothing: drop it, or give staleness_rule delayed_nesterov",
        ),
    )
    codec: str = codec(
        "exchanged parameters (lossless) or pseudo-gradients (lossy)",
        needs=(
            Needs(
                lambda o: not o.sparse,
                "codec {codec} encodes the dense payload, and sparse is on (each learner sends the sparse "
                "payload instead), so it would do nothing: drop it, or give sparse false",
            ),
        ),
    )
    dynamic_h: bool = option(
        False,
        "Dynamic Local Updates: each learner's round is H x its speed / the fastest learner's (speeds measured "
        "from the learners' own rounds), so that they arrive together",
    )
    sparse: bool = option(
        False,
        "send SparseLoCo's payload instead of the codec's: the top values of each chunk of the error-fed "
        "pseudo-gradient (density, chunk, bits, quant_range, dct, error_decay)",
    )
    error_decay: float = error_decay(SPARSE_PAYLOAD)
    density: float = density(DEFAULT_DENSITY, SPARSE_PAYLOAD)
    topk: int = topk(SPARSE_PAYLOAD)
    chunk: int = chunk(needs=SPARSE_PAYLOAD)
    bits: int = value_bits(2, SPARSE_PAYLOAD)
    quant_range: float = quant_range(SPARSE_PAYLOAD)
    dct: bool = dct(SPARSE_PAYLOAD)

    def cross_check(self) -> None:
        super().cross_check()
        if self.sparse:  # else a sparse knob given is refused as idle (`SPARSE_PAYLOAD`)
            check_sparse_options(self, DEFAULT_DENSITY)


# ---- the list ---------------------------------------------------------------------------------------
#: Every strategy: its name, which is also its module's (`ddp` is `ddp.py`), and its options. DDP has none.
OPTIONS_OF: MappingProxyType[str, type[Options]] = MappingProxyType(
    {
        "ddp": Options,
        "local_sgd": PeriodicOptions,
        "post_local_sgd": PostLocalSGDOptions,
        "slowmo": SlowMoOptions,
        "cpdp": CPDPOptions,
        "diloco": DiLoCoOptions,
        "streaming": StreamingOptions,
        "cocodc": CoCoDCOptions,
        "sparseloco": SparseLoCoOptions,
        "demo": DeMoOptions,
        "async_diloco": AsyncDiLoCoOptions,
    }
)
