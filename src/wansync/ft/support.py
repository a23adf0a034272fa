"""What `--fault-tolerant` supports, checked with the rest of the configuration (`config.validate`):
each refusal is one line that says why."""
from __future__ import annotations

from typing import Any

from ..errors import check

# The strategies whose workers train alone between exchanges: a step can go on without a dead worker.
STRATEGIES = ("local_sgd", "slowmo", "diloco", "streaming", "cocodc")


def check_fault_tolerant(cfg: Any) -> None:
    """Refuse, in one line with its reason, what a fault-tolerant run cannot do (`cfg`: a `Config`)."""
    check(cfg.strategy in STRATEGIES,
          f"--fault-tolerant does not support {cfg.strategy}: it all-reduces gradients every step, so no step can "
          f"go on without every worker (use one of {', '.join(STRATEGIES)})")
    check(cfg.ranks_per_worker == 1, "--fault-tolerant supports workers of one rank only (--ranks-per-worker 1)")
    check(getattr(cfg, "inside", "ddp") == "ddp", "--fault-tolerant does not heal workers sharded inside yet "
          "(--inside fsdp): a restarted worker would need each rank's shard from the same rank of a live worker")
    check(getattr(cfg, "codec", None) in (None, "fp32"),
          f"--fault-tolerant exchanges fp32 only (torchft's quorum all-reduce sums on the wire), not codec {cfg.codec}")
