"""The nodes of a torchrun launch agree on what they train before any of them trains.

Each node is started by hand, with its own flags. Two started with another strategy, learning rate,
sync period or model would train different things (some combinations exit 0 with different
models) or abort inside gloo with a misleading "lost contact". So at start-up every rank publishes,
through torchrun's store, the fingerprint of its resolved configuration (`config.fingerprint`: every
key that changes what a run computes), where it starts (afresh, or the step of the checkpoint it
resumes) and the machine it runs on, and reads every other rank's. A difference is refused by every
rank in one line naming the keys, within --peer-timeout. Besides the fingerprint, the run-control keys
that decide when every rank meets in a collective outside the strategy's own (`SCHEDULE_KEYS`: the last
step, the evaluations' means, the checkpoints' barrier) must agree too: nodes given different `--steps`
would otherwise train until one of them left and the others died waiting for it.

The machines give each rank its share of the cores: nodes started on one machine (a workstation, the
test bed's namespaces) would otherwise each take all of them, and ran 12 times slower.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ..errors import ConfigError, PeerError, first_line
from ..net import machine_identity
from ..trust.sealed import SealError, key_for, seal, unseal
from ..trust.settings import current
from .torchrun import TorchrunEnv

SHOWN_KEYS = 4  # keys named in the one line
SCHEDULE_KEYS = ("steps", "eval_every", "checkpoint_every")
SHOWN_CHARS = 40  # of each value


@dataclass(frozen=True)
class Agreement:
    """What the ranks agreed on besides the configuration."""

    ranks_here: int  # ranks of the launch on this machine, co-located nodes included
    round: int = 0  # this run's number in the launch (a grid trains several)

    @property
    def threads(self) -> int:
        """This rank's share of the machine's cores (--threads 0)."""
        return max(1, len(os.sched_getaffinity(0)) // self.ranks_here)


def shared(fingerprint: dict[str, Any], cfg: Any) -> dict[str, Any]:
    """What every rank of a launch must hold alike: the fingerprint (what it computes), the schedule
    of the collectives it meets the others in outside the strategy (`SCHEDULE_KEYS`), and the content
    of a `--model`/`--data` plug-in file (`plugin_digests`)."""
    return {**fingerprint, **{k: getattr(cfg, k) for k in SCHEDULE_KEYS}, **plugin_digests(cfg)}


def plugin_digests(cfg: Any) -> dict[str, str]:
    """`model_file`/`data_file`: the SHA-256 of a `path/to/file.py:factory` plug-in, as this node reads
    it. Two nodes naming the same path may hold different versions of the file (another machine's
    copy), and would build two different models. Not part of the checkpoint's fingerprint: a resume
    after the user edited the file is theirs to decide."""
    out = {}
    for flag in ("model", "data"):
        value = getattr(cfg, flag, None)
        where = value.rpartition(":")[0] if isinstance(value, str) else ""
        if where.endswith(".py"):
            try:
                out[f"{flag}_file"] = hashlib.sha256(Path(where).expanduser().read_bytes()).hexdigest()[:16]
            except OSError as e:
                out[f"{flag}_file"] = f"unreadable ({e.strerror or type(e).__name__})"
    return out


def agree(
    env: TorchrunEnv, config: dict[str, Any], start: int, timeout_s: float, refused: str | None = None
) -> Agreement:
    """Publish this rank's `config` (a fingerprint) and `start` (0, or the checkpoint step it resumes
    from), read every rank's, and refuse a difference in one line (module docstring). `refused`: rank
    0 will not start (its run directory), and every other rank stops with its reason. Without
    torchrun's agents (the variables set by hand: rank 0's process group will host the store) there
    is no store to meet in before the process group: nothing is compared. A grid (compare, sweep)
    trains its runs in the same order on every rank: each meets the others in its round's keys."""
    if not env.agent_store:
        return Agreement(env.local_world_size)
    if env.rejoined:  # the others agreed long ago, in rank 0's round: this node meets their records there
        round_ = env.store(timeout_s).add("rounds/rank0", 0)
    else:
        round_ = env.store(timeout_s).add(f"rounds/rank{env.rank}", 1)
    store = replace(env, round=round_).store(timeout_s)
    mine = {"config": config, "start": start, "machine": machine_identity(), "refused": refused}
    # sealed (`trust.sealed`): plain data under the run secret's HMAC, checked before it is parsed
    key = key_for(current().secret, "agreement")
    store.set(f"agree/rank{env.rank}", seal(json.loads(json.dumps(mine, sort_keys=True, default=str)), key))
    records = []
    for rank in range(env.world_size):
        try:
            records.append(unseal(store.get(f"agree/rank{rank}"), key, f"rank {rank}'s agreement"))
        except SealError:
            raise
        except (RuntimeError, ValueError) as e:  # DistStoreError is a RuntimeError: the wait timed out
            raise PeerError(
                f"rank {rank} did not say what it trains within --peer-timeout {timeout_s:g} s (is its "
                f"node started, with the same --nnodes?): {first_line(e)[:200]}"
            ) from None
    first = records[0]
    if first.get("refused") and env.rank != 0:
        raise ConfigError(f"rank 0 will not start: {first['refused']}")
    for rank, record in enumerate(records[1:], 1):
        check_same(first, record, rank, start=not env.rejoined)  # a node that rejoins heals, from no checkpoint
    return Agreement(sum(1 for r in records if r["machine"] == mine["machine"]), round_)


def check_same(first: dict[str, Any], other: dict[str, Any], rank: int, start: bool = True) -> None:
    """Rank `rank`'s record against rank 0's: the same configuration, and (`start`) the same start."""
    keys = sorted(
        k for k in set(first["config"]) | set(other["config"]) if first["config"].get(k) != other["config"].get(k)
    )
    if keys:
        shown = keys[:SHOWN_KEYS] + (["..."] if len(keys) > SHOWN_KEYS else [])
        raise ConfigError(
            f"the nodes were started with different training flags ({', '.join(keys)}): rank {rank} has "
            f"{_values(other['config'], shown)} where rank 0 has {_values(first['config'], shown)}; "
            f"start every node with the same flags"
        )
    if start and first["start"] != other["start"]:
        raise ConfigError(
            f"rank {rank} {_start(other['start'])} but rank 0 {_start(first['start'])}: resume on every "
            f"node (--resume) from the same checkpoint, or on none"
        )


def _values(config: dict[str, Any], keys: list[str]) -> str:
    return ", ".join(k if k == "..." else f"{k}={str(config.get(k, '(unset)'))[:SHOWN_CHARS]}" for k in keys)


def _start(step: int) -> str:
    return f"resumes from the checkpoint of step {step}" if step else "starts afresh"
