"""What one `Exchange.mean` puts on the wire and how long that takes on an emulated link: the one
description of a mean's collectives (`mean_collectives`), which the exchange books (`sent`), the
planner replays and `mean_seconds` times with the one exchange cost, `net.cost.exchange_seconds`.

Over M workers, for a buffer of n values (w: the codec's encoded payload of them)::

    fp32                     all-reduce of 4n bytes           sends 2(M−1)/M · 4n per rank (a ring)
    lossy, allgather         all-gather of every payload      sends (M−1) · w
    lossy, reduce_scatter    all-to-all of M encoded chunks   sends (M−1)/M · w
                             + all-gather of the mean chunks  sends (M−1)/M · w     2(M−1)/M · w in all

(side-band scalars ride raw as float32, a "skip" weight or flag as one more element or byte, in
every payload). Between workers of R > 1 ranks, local rank r carries shard r (the largest of the
near-equal shards, ⌈n/R⌉ values, sets the pace) and the worker's ranks then all-gather the
averaged fp32 shards over the link inside a worker (`Topology.inside_worker`).
(A buffer of fewer than R values, which the exchange does not split, is costed as if it were.)
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError
from ..net import Topology, exchange_seconds
from .choices import LOSSY_COLLECTIVES
from .codecs import Codec, get_codec
from .sparse import is_sparse


@dataclass(frozen=True)
class Collective:
    """One collective of a mean: its op, its full buffer (the cost model's B) and what this rank sends."""

    op: str  # allreduce | allgather | alltoall
    nbytes: int
    sent: int


def mean_collectives(
    numel: int, codec: str | Codec, collective: str, workers: int, extra: int = 0, weighted: bool = False, item: int = 4
) -> list[Collective]:
    """The collectives one mean of `numel` values (plus `extra` side-band scalars, and a weight or
    flag when `weighted`) runs over `workers`, in order (module docstring); `collective`: the lossy
    path (`lossy_path`); `item`: an fp32 mean's element size (a float64 buffer's: 8)."""
    codec, m = get_codec(codec), workers
    if codec.name == "fp32":
        wire = item * (numel + extra + int(weighted))
        return [Collective("allreduce", wire, round(2 * (m - 1) / m * wire) if m > 1 else 0)]
    side = 4 * extra + int(weighted)
    if collective != "reduce_scatter":
        payload = codec.wire_bytes(numel) + side
        return [Collective("allgather", m * payload, (m - 1) * payload)]
    chunk = codec.wire_bytes(-(-numel // m))
    piece = chunk + side
    return [Collective("alltoall", m * piece, (m - 1) * piece), Collective("allgather", m * chunk, (m - 1) * chunk)]


def sparse_crossing(sparse: Codec, numel: int, dense: str | Codec) -> float:
    """The number of workers below which a sparse payload's all-gather puts fewer bytes per rank on the
    wire than a dense mean of the same `numel` values in `dense` (fp32: the ring all-reduce; a lossy
    codec: the reduce-scatter): (M − 1)·w_sparse < 2(M − 1)/M·w_dense, i.e. M < 2·w_dense / w_sparse."""
    dense = get_codec(dense)
    w_dense = 4 * numel if dense.name == "fp32" else dense.wire_bytes(numel)
    return 2 * w_dense / max(1, sparse.wire_bytes(numel))


def mean_seconds(
    numel: int,
    codec: str | Codec,
    topology: Topology,
    workers: int,
    ranks_per_worker: int = 1,
    shards: bool = False,
    collective: str = "allgather",
) -> float:
    """Modelled seconds of one mean of `numel` float32 values between `workers` workers of R ranks;
    `shards` (FSDP inside): `numel` is this rank's own shard, every local rank averages its own
    across at once and nothing is gathered inside the worker. `collective`: a lossy codec's path."""
    r = ranks_per_worker
    shard = numel if shards else -(-numel // r)
    steps = mean_collectives(shard, codec, collective, workers)
    seconds = 0.0
    for i, c in enumerate(steps):
        last = i == len(steps) - 1  # the worker's ranks assemble the fp32 mean after the last
        seconds += exchange_seconds(
            c.op, r * c.nbytes, topology, workers, r, assembled_bytes=r * 4 * shard, assemble=last and not shards
        )
    return float(seconds)


def lossy_path(
    codec: str | Codec,
    choice: str,
    workers: int,
    numel: int = 0,
    topology: Topology | None = None,
    ranks_per_worker: int = 1,
    shards: bool = False,
) -> str:
    """How a lossy codec's mean travels: `allgather` (every worker's encoded payload to every
    worker: (M−1) payloads received per rank, one quantization, one collective) or `reduce_scatter`
    (encoded chunks all-to-all, each chunk's sum in fp32 re-encoded and all-gathered: about 2(M−1)/M
    of a payload per rank whatever M is, two quantizations, two collectives).

    `auto`: the all-gather up to 2 workers (the same bytes, one collective and one rounding fewer).
    From 3 on, where the link is modelled (`topology`: an emulated run, CoCoDC's T_s, the planner),
    whichever path `mean_seconds` times shorter for a mean of `numel` values (its convention: this
    rank's shard with `shards`, else the worker's buffer): the all-gather's one collective wins while
    latency dominates (a 1 MB int8 mean over 4 cross-region workers: 0.63 of the reduce-scatter's
    time), the reduce-scatter once bandwidth does (10 MB: 0.81 of the all-gather's). Without a link model: the
    reduce-scatter. Ties go to the reduce-scatter (fewer bytes)."""
    if choice not in LOSSY_COLLECTIVES:
        raise ConfigError(f"codec_collective must be one of {', '.join(LOSSY_COLLECTIVES)}, got {choice!r}")
    if is_sparse(codec):  # a sparse payload: only ever all-gathered (`comm.sparse_mean`)
        return "allgather"
    if get_codec(codec).name == "fp32" or choice != "auto":
        return choice
    if workers <= 2:
        return "allgather"
    if topology is None or numel <= 0:
        return "reduce_scatter"
    return min(
        ("reduce_scatter", "allgather"),
        key=lambda path: mean_seconds(numel, codec, topology, workers, ranks_per_worker, shards, path),
    )
