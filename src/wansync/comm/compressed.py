"""Averaging a flat float32 buffer over a process group while sending only encoded bytes.

Quantized values cannot be summed on the wire (each rank has its own scales), so a lossy codec is
averaged by all-gathering every rank's encoded payload and having each rank decode and accumulate all
of them in FP32, in rank order. The same bytes summed in the same order give bitwise identical results
on every rank, which the strategies rely on (their anchors must not drift apart). The ``fp32`` codec
needs no decoding and uses a plain SUM all-reduce.

Byte accounting convention: ``wire_bytes`` is the size of *this rank's* encoded payload, i.e. what one
rank puts on the wire per hop of a ring or all-gather. What a rank actually transmits in total depends
on the algorithm: ``(M - 1) · wire_bytes`` for an all-gather and about ``2 (M - 1) / M · wire_bytes``
for a ring all-reduce (the fp32 path). ``payload_bytes`` is the uncompressed size (``4 · numel``), so
``wire_bytes / payload_bytes`` is the codec's compression ratio.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from wansync.comm.codecs import Codec, Encoded, get_codec

__all__ = ["MeanHandle", "compressed_mean"]


class MeanHandle:
    """A mean in flight: ``wait()`` finishes the collective, decodes (lossy codecs) and returns it.

    ``wait()`` may be called more than once; it returns the same tensor.
    """

    def __init__(
        self,
        codec: Codec,
        numel: int,
        world_size: int,
        work: Any | None,
        finish: Any,
    ) -> None:
        self.codec = codec
        self.numel = numel
        self.world_size = world_size
        self.wire_bytes = codec.wire_bytes(numel)
        self.payload_bytes = 4 * numel
        self._work = work
        self._finish = finish
        self._result: torch.Tensor | None = None

    def is_completed(self) -> bool:
        """Whether the communication is done (decoding may still be pending until ``wait()``)."""
        return self._result is not None or self._work is None or self._work.is_completed()

    def wait(self) -> torch.Tensor:
        """The mean over the group's ranks: a new 1-D float32 tensor, bitwise equal on every rank."""
        if self._result is None:
            if self._work is not None:
                self._work.wait()
                self._work = None
            self._result = self._finish()
            self._finish = None
        return self._result


def compressed_mean(
    x: torch.Tensor,
    codec: str | Codec,
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
) -> MeanHandle:
    """Start averaging the float32 tensor ``x`` over ``group`` and return a :class:`MeanHandle`.

    Every rank must call this with the same codec and the same ``x.numel()``. ``x`` is not modified
    and may be reused as soon as this returns (it has been encoded or copied). With
    ``async_op=True`` the collective runs in the background and decoding happens in ``wait()``, so the
    caller can overlap it with compute. Without an initialized process group the "group" is this one
    rank, and the result is ``decode(encode(x))``, the same quantization a multi-rank run applies.
    """
    codec = get_codec(codec)
    if x.dtype != torch.float32:
        raise TypeError(f"compressed_mean averages float32 tensors, got {x.dtype}")
    flat = x.detach().reshape(-1)
    numel = flat.numel()
    world = dist.get_world_size(group) if dist.is_initialized() else 1

    if codec.name == "fp32":
        buf = flat.clone()
        work = dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=group, async_op=async_op) if world > 1 else None

        def finish_sum() -> torch.Tensor:
            return buf.div_(world)

        return _handle(codec, numel, world, work, finish_sum, async_op)

    enc = codec.encode(flat)
    if world == 1:
        gathered = [enc.data]
        work = None
    else:
        gathered = [torch.empty_like(enc.data) for _ in range(world)]
        work = dist.all_gather(gathered, enc.data, group=group, async_op=async_op)

    def finish_decode() -> torch.Tensor:
        acc = torch.zeros(numel, dtype=torch.float32, device=flat.device)
        for data in gathered:  # rank order: the same sum, bit for bit, on every rank
            acc += codec.decode(Encoded(codec.name, numel, data))
        return acc.div_(world)

    return _handle(codec, numel, world, work, finish_decode, async_op)


def _handle(codec: Codec, numel: int, world: int, work: Any, finish: Any, async_op: bool) -> MeanHandle:
    handle = MeanHandle(codec, numel, world, work if async_op else None, finish)
    if not async_op:
        handle.wait()  # synchronous: the collective has run; decode now so wait() is free
    return handle
