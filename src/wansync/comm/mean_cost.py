"""What one `Exchange.mean` costs on an emulated link: the collective and the bytes its codec and
its shards put there (`comm.exchange`), timed by the one exchange cost, `net.cost.exchange_seconds`.

An fp32 mean is an all-reduce of the values; a lossy codec's is an all-gather of every worker's
encoded payload. Between workers of R > 1 ranks, local rank r carries shard r (the largest of the
near-equal shards, ⌈numel/R⌉ values, sets the pace) and the worker's ranks then all-gather the
averaged fp32 shards over the site's own link: the emulator runs a worker's ranks in one site.
(A buffer of fewer than R values, which the exchange does not split, is costed as if it were.)
"""
from __future__ import annotations

from ..net import Topology, exchange_seconds
from .codecs import Codec, get_codec


def mean_seconds(numel: int, codec: str | Codec, topology: Topology, workers: int, ranks_per_worker: int = 1,
                 shards: bool = False, collective: str = "allgather") -> float:
    """Modelled seconds of one mean of `numel` float32 values between `workers` workers of R ranks;
    `shards` (FSDP inside): `numel` is this rank's own shard, every local rank averages its own
    across at once and nothing is gathered inside the worker. `collective`: a lossy codec's path
    (`Exchange.lossy_collective`): the all-gather of every payload, or the all-to-all of encoded
    chunks then the all-gather of the encoded mean chunks."""
    codec, r = get_codec(codec), ranks_per_worker
    shard = numel if shards else -(-numel // r)
    cost = dict(inside=topology.intra_link, assemble=not shards)
    if codec.name == "fp32":
        return float(exchange_seconds("allreduce", r * 4 * shard, topology, workers, r, **cost))
    if collective != "reduce_scatter":
        return float(exchange_seconds("allgather", workers * r * codec.wire_bytes(shard), topology, workers, r,
                                      assembled_bytes=r * 4 * shard, **cost))
    chunk = codec.wire_bytes(-(-shard // workers))
    return float(exchange_seconds("alltoall", workers * r * chunk, topology, workers, r, assemble=False,
                                  inside=topology.intra_link)
                 + exchange_seconds("allgather", workers * r * chunk, topology, workers, r,
                                    assembled_bytes=r * 4 * shard, **cost))
