"""`WANSYNC_DEBUG=1`: check that every rank made the same schedule choice.

The fragment schedule is computed from globally identical values, so every rank picks the same
fragment without extra messages; a mismatch would deadlock the collectives. In debug mode each
slot's choice is all-gathered (8 bytes, purpose `debug`) and a disagreement raises PeerError.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

from ..comm.ledger import CommLedger
from ..errors import PeerError


def debug_enabled() -> bool:
    return os.environ.get("WANSYNC_DEBUG", "") not in ("", "0", "false", "no")


def check_same_choice(t: int, choice: int, ledger: CommLedger, group: Any = None) -> None:
    """Raise PeerError unless every rank of `group` chose `choice` (-1: no sync) at step t."""
    mine = torch.tensor([choice], dtype=torch.int64)
    every = [torch.zeros_like(mine) for _ in range(dist.get_world_size(group))]
    ledger.count("debug", 8)
    dist.all_gather(every, mine, group=group)
    choices = [int(c[0]) for c in every]
    if len(set(choices)) != 1:
        raise PeerError(f"ranks chose different fragments at step {t}: {choices} (rank order)")
