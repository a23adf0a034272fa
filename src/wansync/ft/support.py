"""What `--fault-tolerant` supports, checked with the rest of the configuration (`config.validate`):
each refusal is one line that says why."""

from __future__ import annotations

from typing import Any

from ..errors import check

# The strategies whose workers train alone between exchanges: a step can go on without a dead worker.
STRATEGIES = ("local_sgd", "slowmo", "diloco", "streaming", "cocodc", "sparseloco")


def check_fault_tolerant(cfg: Any) -> None:
    """Refuse, in one line with its reason, what a fault-tolerant run cannot do (`cfg`: a `Config`)."""
    check_supported(
        cfg.strategy,
        codec=getattr(cfg, "codec", None),
        slow_policy=getattr(cfg, "slow_policy", None),
        overlap_rounds=bool(getattr(cfg, "overlap_rounds", False)),
    )


def check_supported(
    strategy: str,
    inside: str = "ddp",
    codec: str | None = None,
    subject: str = "--fault-tolerant",
    slow_policy: str | None = None,
    overlap_rounds: bool = False,
) -> None:
    """The refusals, for the CLI's flags and a user's loop alike (`subject`: what the line names).
    The CLI's workers may be of several ranks, DDP or FSDP inside; in a user's loop a fault-tolerant
    worker is one rank (`ft.own_loop`), so a model sharded there (`inside`) is refused."""
    check(
        strategy != "demo",
        f"{subject} does not support demo: it exchanges at every step, so every step would "
        f"wait for a quorum (use one of {', '.join(STRATEGIES)}, whose workers train alone between exchanges)",
    )
    check(
        strategy != "async_diloco",
        f"{subject} does not support async_diloco: its learners never wait for a quorum, and a learner that "
        "dies is not restarted yet (the syncer goes on with the others)",
    )
    check(
        strategy in STRATEGIES,
        f"{subject} does not support {strategy}: it all-reduces gradients every step, so no step can "
        f"go on without every worker (use one of {', '.join(STRATEGIES)})",
    )
    check(
        inside == "ddp",
        f"{subject} takes a worker of one rank, so a model sharded with FSDP2 has no place "
        "in it (workers of several ranks, sharded inside: the CLI's --fault-tolerant --inside fsdp)",
    )
    check(
        codec in (None, "fp32"),
        f"{subject} exchanges fp32 only (torchft's quorum all-reduce sums on the wire), not codec {codec}",
    )
    check(
        slow_policy in (None, "wait"),
        f"{subject} takes slow_policy wait only, not {slow_policy}: the quorum decides who takes part in each "
        f"exchange, and a late worker is not a dead one (it is waited for)",
    )
    check(
        not overlap_rounds,
        f"{subject} does not take overlap_rounds: a quorum's exchange completes when it is "
        "issued, so there is nothing to overlap, and a healed worker would need the round in flight",
    )
