"""What one rank holds, by category, predicted: the planner's memory column, in the categories
`telemetry.memory` measures (summary.json's `memory_per_rank`, benchmarks/memory_bill.py), sharded
(FSDP inside) and not; what an exchange allocates and frees within a step (`transient`); and
whether the whole fits an accelerator (`--gpu-memory`).

Bytes per rank, every tensor fp32 (the masters stay fp32 under `--precision bf16`). p: the
parameters this rank holds (4N with DDP inside; rank 0's FSDP2 chunks, about 4N/R, sharded:
`ModelSize.local_params`); s: p plus the floating-point persistent buffers, what the strategy
exchanges; b: every buffer (held whole by every rank); T: the parameter tensors; per fragment in
flight between steps, f: its bytes on this rank and w_f: its share of the exchange (⌈f/R⌉ with
DDP inside, which splits every exchange over the worker's ranks, else f)::

    parameters       p + b
    gradients        p                  (held from the backward to zero_grad)
    inner_optimizer  AdamW: 2p + 4T (two moments, a step count per tensor); SGD with momentum: p
    outer_state      anchor θ̃ s + outer momentum s (slowmo, cpdp, diloco, streaming, cocodc)
                     + Σ_f Δ f, + θ(t_p) f when the merge is not the α-merge (eager: θ̂ f)
                     `overlap_rounds` (diloco, sparseloco): + 2s, the round's start s_m and the Δ_m in
                     flight (its mean lands in it)
    ddp_buckets      4N per DDP wrapper: the gradient phase (ddp, cpdp, post_local_sgd) and the DDP
                     inside a worker of R > 1 ranks; none with FSDP inside
    exchange         a periodic strategy's averaged buffer beyond the model: the drift's element,
                     4 (none with FSDP inside: the model cannot move into it; none with a lossy
                     codec, whose mean is not taken in the model's buffer); with a lossy codec the
                     reference the workers' change is measured from, s, where the strategy keeps
                     no anchor (local_sgd, post_local_sgd: the last mean), and with error feedback
                     the residual, s; with `robust_mean` and fp32, that same reference, s, where no
                     anchor is kept;
                     fragments: Σ_f the exchange's buffer in flight: fp32 w_f; a lossy codec what
                     it receives, the M payloads it gathers, M·wire(w_f), or on the reduce-scatter
                     path the M encoded chunks of the all-to-all, M·wire(⌈w_f/M⌉); with error
                     feedback the copy of Δ sent, + f, and a residual per fragment, + s

and, allocated and freed within a step (`transient`, B the exchanged bytes: s for a periodic
strategy, the largest fragment f for the others):

    periodic         R = 1: 0 (the mean lands in the model's own buffer); FSDP inside: B (the
                     shards gathered into one buffer); DDP inside: 2B + 2B/R (its shard's mean and
                     the piece it sends, B/R each; the R pieces gathered and the backend's flat
                     copy of them, or the whole put back together, B each); with `robust_mean`,
                     at least s (θ_m − its reference, whose norm the clip measures); averaging the
                     inner optimizer's state (`sync_optimizer_state`) gathers its moments, m, into
                     one buffer: m, + 2m + 2m/R with DDP inside, when larger;
                     a lossy codec (`comm.lossy_mean`; n the values this rank averages, B/4, or
                     ⌈B/4R⌉ with DDP inside): the workers' changes, B, plus the largest phase of
                     the mean (E, D: a block's encode and decode temporaries, `ENCODE_TEMPORARIES`
                     and `DECODE_TEMPORARIES` a value, up to `codecs.BLOCK_VALUES` values):
                     all-gather, w = wire(n): encoding, w + E; gathering, w + 2M·w (the M payloads
                     into one buffer, which gloo fills from a copy of its own: M·w more; NCCL's
                     all_gather_into_tensor writes in place, so there it is an upper bound);
                     decoding, (1 + M)·w + D;
                     reduce-scatter, w = wire(⌈n/M⌉), 2M·w the all-to-all's buffers: encoding,
                     M·w + E; summing the received chunks, 2M·w + 4⌈n/M⌉ + D; re-encoding the
                     mean chunk, that + w − D + E; gathering, (4M + 1)·w; decoding,
                     (3M + 1)·w + D; with DDP inside + the shard's mean, 4n, at the decode, or
                     what travels held while the whole is put back together, 2B + 2B/R
    fragments        the merge's temporaries alive at once: α-merge 2f (θ_m's copy and (1−α)·θ̃);
                     Taylor and damped 7f (θ_m's copy, g, D, g⊙g⊙D, g_corr, τ·g_corr, the new value);
                     eager 2f (θ_m's copy and θ̃_p − θ̂; its start's look-ahead: Δ/M and the momentum's);
                     + f when the schedule reads R_p (θ̃ kept from before the outer step); with DDP
                     inside the mean put back together, f, is held through the merge while the
                     shard's, f/R, is freed (+ f − f/R), or the gathering itself, 2f + f/R
                     (the piece sent, the R pieces and the backend's flat copy), when larger; a
                     lossy codec's decoded mean takes the place of the fp32 path's buffer and its
                     payloads are freed before the merge: the same (measured within 3.3 MB of it:
                     a decode block and gloo's buffers)

The backend's own working buffers are left out (gloo's collectives took 0.7–1.9 MB here, whatever
the size; NCCL's are allocated once per communicator), and so is a lossy fragment sync's own encoded
payload, which only the backend's Work holds while it travels (wire(w_f), benchmarks/memory_bill.py's
"unaccounted"), and so are activations and FSDP2's all-gathered
unit in forward and backward: they depend on the batch and the model's blocks, not the strategy.
With `outer_state_device=cpu` the outer state and the exchange's buffers in flight are in host
memory (`host`), and so are a fragment's merge temporaries: none of them count against the
accelerator (`per_gpu`).
"""

from __future__ import annotations

import dataclasses
import math
from types import MappingProxyType
from typing import Any, Sequence

from ..comm.codecs import BLOCK_VALUES, get_codec
from ..comm.mean_cost import lossy_path
from ..comm.sparse import is_sparse
from ..errors import ConfigError
from ..strategies import make_options, strategy_class
from ..strategies.periodic import DRIFT_SIDE_BAND, Periodic
from ..telemetry.memory import CATEGORIES
from ..units import parse_bytes
from .schedule import Transfer, planned_timetable

VALUE = 4  # bytes of an fp32 value
#: fragment-sized buffers alive at once in a merge
MERGE_TEMPORARIES = MappingProxyType({"alpha": 2, "taylor": 7, "damped": 7, "eager": 2})
ADAMW_MOMENTS = 2
#: bytes a blocked decode (`codecs.decode_into`) allocates per value of its block: the block's payload
#: and its float32 values, rescaled (fp4: its codes as indices, then a float per value, then rescaled)
DECODE_TEMPORARIES = MappingProxyType({"bf16": 2 + VALUE, "int8": 1 + 2 * VALUE, "fp4": 0.5 + 4 + 2 * VALUE})
#: and a blocked encode (`codecs.encode_into`): bf16 its values; int8 x/scale and its rounding; fp4 |x|
#: and the E2M1 code's three 4-byte intermediates
ENCODE_TEMPORARIES = MappingProxyType({"bf16": 2, "int8": 2 * VALUE, "fp4": 4 * VALUE})
#: bytes the statistical quantizer allocates per chosen value (`comm.quantize`: the values, centred,
#: squared and scaled in float64, their segments and slots as int64)
QUANTIZER_TEMPORARIES = 40


def memory_bill(s: Any, held_in_flight: Sequence[Transfer] = ()) -> dict[str, int]:
    """Bytes rank 0 of setting `s` (`predict.Setting`) holds by category (`CATEGORIES`), their
    `total`, the `transient` an exchange adds within a step, the `host` part of the total and
    `per_gpu`: what the accelerator holds at the peak (total − host + transient on it)."""
    bill = held_bytes(s, held_in_flight)
    total, transient = sum(bill.values()), transient_bytes(s)
    fragments = "fragments" in s.options
    on_host = s.options.get("outer_state_device") == "cpu"  # a fragment's Δ, exchange and merge run there too
    host = bill["outer_state"] + (bill["exchange"] if fragments else 0) if on_host else 0
    on_gpu = 0 if on_host and fragments else transient
    return {**bill, "total": total, "transient": transient, "host": host, "per_gpu": total - host + on_gpu}


def held_bytes(s: Any, held_in_flight: Sequence[Transfer]) -> dict[str, int]:
    """What a rank holds between steps, by category (the module docstring's table)."""
    o, size, r = s.options, s.size, s.ranks_per_worker
    sharded = s.inside == "fsdp"
    p, synced = _local_bytes(s)
    sparse = _sparse(s)
    if sparse is not None:
        return _sparse_held(s, sparse, p)
    tt = planned_timetable(s.strategy, o)
    momentum = o.get("outer_momentum", o.get("slowmo_beta", 0.0))
    anchored = "fragments" in o or "outer_lr" in o or "slowmo_beta" in o
    wrappers = (
        0
        if sharded
        else (
            any(tt.ddp_step(t) for t in (1, o.get("sync_every", 1)))
            + (r > 1 and strategy_class(s.strategy).steps_inside_workers)
        )
    )
    bill = dict.fromkeys(CATEGORIES, 0)
    bill.update(
        parameters=p + size.buffer_bytes,
        gradients=p,
        inner_optimizer=inner_optimizer_bytes(s.optimizer, s.momentum, p, len(size.grad_numels)),
        outer_state=(synced + (synced if momentum > 0 else 0)) if anchored else 0,
        ddp_buckets=wrappers * VALUE * size.params,
    )
    if "fragments" in o:
        copies = 1 if tt.merge == "alpha" else 2  # Δ, and θ(t_p) for the other merges
        flying = _fragments_in_flight(s, held_in_flight)
        bill["outer_state"] += sum(copies * f for f, _ in flying)
        bill["exchange"] = sum(w for _, w in flying)
        if o.get("error_feedback") and o["codec"] != "fp32":  # a residual per fragment, once it synced
            bill["exchange"] += VALUE * sum(s.size.local_fragments(o["fragments"], o["partition"], r if sharded else 1))
    elif o.get("codec", "fp32") != "fp32":  # the workers' changes from a reference
        bill["exchange"] = synced * (int(_keeps_mean(s.strategy)) + int(bool(o.get("error_feedback"))))
    elif o.get("drift_telemetry") and not sharded and not o.get("overlap_rounds"):  # the model moved into the
        bill["exchange"] = VALUE * DRIFT_SIDE_BAND  # averaged buffer
    if o.get("robust_mean", "off") != "off" and o.get("codec", "fp32") == "fp32" and _keeps_mean(s.strategy):
        bill["exchange"] += synced  # the robust mean's reference (`Periodic.needs_reference`)
    if o.get("overlap_rounds"):
        bill["outer_state"] += 2 * synced  # s_m and the Δ_m in flight
    return bill


def async_bill(s: Any) -> dict[str, int]:
    """Rank 0 of an asynchronous run (`async_diloco`, one rank per learner): its learner, and the syncer
    beside it in the same process (`strategies/syncer.py`); `memory_bill`'s keys. s: what is exchanged.

    learner          parameters p + b, gradients p, the inner optimizer; with a lossy codec or the sparse
                     payload the version its round started from, s, a copy of the received tensor (host
                     memory); with the sparse payload its error buffer, p (outer state), and the payload's
                     description (`sparse_state_bytes`) twice: the learner's, and the syncer's (host memory)
    syncer           its copies of the model's tensors and θ̃, 2s; the versions a contribution may
                     still be based on, (max_staleness + 1)·s; delayed Nesterov's buffer and momentum,
                     2s, or the outer step's momentum, s (outer_momentum > 0): on the model's device
    exchange         the pending contributions, one per learner at most, M·s, as received (host memory)
    transient        a merge's accumulator, one Δ and the new version before the oldest is freed, 3s
                     (a round's θ_m gathered to be sent, s, is less)"""
    o = s.options
    p, synced = _local_bytes(s)
    rule = 2 if o["staleness_rule"] == "delayed_nesterov" else int(o["outer_momentum"] > 0)
    sparse = _sparse(s)
    base = synced if o["codec"] != "fp32" or sparse is not None else 0
    error, described = (p, sparse_state_bytes(sparse)) if sparse is not None else (0, 0)
    bill = dict.fromkeys(CATEGORIES, 0)
    bill.update(
        parameters=p + s.size.buffer_bytes,
        gradients=p,
        inner_optimizer=inner_optimizer_bytes(s.optimizer, s.momentum, p, len(s.size.grad_numels)),
        outer_state=(2 + o["max_staleness"] + 1 + rule) * synced + error,
        exchange=s.workers * synced + base + 2 * described,
    )
    total, transient, host = sum(bill.values()), 3 * synced, s.workers * synced + base + described
    return {**bill, "total": total, "transient": transient, "host": host, "per_gpu": total - host + transient}


def _keeps_mean(strategy: str) -> bool:
    """Does a periodic strategy keep the last mean as its reference (no anchor: local_sgd, post_local_sgd)?"""
    return getattr(strategy_class(strategy), "reference", None) is Periodic.reference


def transient_bytes(s: Any) -> int:
    """The most an exchange allocates and frees within a step (the module docstring's formulas)."""
    o, r = s.options, s.ranks_per_worker
    sharded = s.inside == "fsdp"
    ddp_inside = r > 1 and not sharded
    sparse = _sparse(s)
    if sparse is not None:
        return _sparse_transient(s, sparse)
    if "fragments" in o:
        f = VALUE * max(s.size.local_fragments(o["fragments"], o["partition"], r if sharded else 1))
        reads_rates = o.get("schedule", "round_robin") != "round_robin"
        merge = (MERGE_TEMPORARIES[planned_timetable(s.strategy, o).merge] + reads_rates) * f
        if not ddp_inside:
            return merge
        share = math.ceil(f / r)  # the shard's mean, held until the whole is put back together
        return max(2 * f + share, f + merge - share)
    if "sync_every" not in o:  # ddp: its buckets are held, nothing more
        return 0
    p, synced = _local_bytes(s)
    b = synced + (VALUE * DRIFT_SIDE_BAND if o.get("drift_telemetry") else 0)
    if o.get("codec", "fp32") != "fp32":
        params = _lossy_periodic(s, b)
    else:
        params = b if sharded else _reassembly(b, r) if ddp_inside else 0
        if o.get("robust_mean", "off") != "off":  # the norm of θ_m − its reference, freed before the mean
            params = max(params, synced)
    if not o.get("sync_optimizer_state"):
        return params
    moments = inner_optimizer_bytes(s.optimizer, s.momentum, p, 0)  # gathered into one buffer, averaged
    return max(params, moments + (_reassembly(moments, r) if ddp_inside else 0))


def _lossy_periodic(s: Any, b: int) -> int:
    """A periodic strategy's lossy mean of b bytes (`comm.lossy_mean`): the workers' changes, b, in a
    buffer of their own, plus the largest of its phases (the module docstring's list); with DDP
    inside, what travels is held while the shard's mean is put back together (`_reassembly`)."""
    o, r, m = s.options, s.ranks_per_worker, s.workers
    ddp_inside = r > 1 and s.inside != "fsdp"
    codec = get_codec(o["codec"])
    enc, dec = ENCODE_TEMPORARIES[codec.name], DECODE_TEMPORARIES[codec.name]
    n = b // VALUE
    part = math.ceil(n / r) if ddp_inside else n  # the values this rank averages
    mean = VALUE * part if ddp_inside else 0  # the shard's mean is a buffer of its own
    if (
        lossy_path(codec, o.get("codec_collective", "auto"), m, n, s.topology, r, s.inside == "fsdp")
        == "reduce_scatter"
    ):
        q = math.ceil(part / m)
        w, block = codec.wire_bytes(q), min(BLOCK_VALUES, q)
        chunks = 2 * m * w  # the all-to-all's send and receive buffers
        phases = [
            m * w + enc * block,  # the chunks encoded
            chunks + VALUE * q + dec * block,  # the received ones summed
            chunks + VALUE * q + w + enc * block,  # this rank's mean chunk re-encoded
            chunks + w + 2 * m * w,  # all-gathered (gloo copies them once more)
            chunks + w + m * w + dec * block + mean,
        ]  # decoded into the mean
        held = chunks + w + m * w
    else:
        w, block = codec.wire_bytes(part), min(BLOCK_VALUES, part)
        phases = [
            w + enc * block,  # the payload encoded
            w + 2 * m * w,  # all-gathered (gloo copies them once more)
            w + m * w + dec * block + mean,
        ]  # decoded and summed into the mean
        held = w + m * w
    peak = max(phases)
    return b + int(max(peak, held + _reassembly(b, r)) if ddp_inside else peak)


def _sparse(s: Any) -> Any:
    """The sparse payload of a strategy whose exchange is sparse (SparseLoCo, DeMo, async_diloco with
    `sparse`), else None: the layout of rank 0's own tensors (its FSDP2 chunks when sharded inside)."""
    cls = strategy_class(s.strategy)
    opts = make_options(s.strategy, **s.options)
    r = s.ranks_per_worker if s.inside == "fsdp" else 1
    shapes = [
        (math.ceil(sh[0] / r), *sh[1:]) if len(sh) > 1 else (math.ceil(sh[0] / r),) if sh else sh
        for sh in (s.size.shapes or [(n,) for n in s.size.grad_numels])
    ]
    codec = cls.wire_codec(opts, shapes)
    return codec if is_sparse(codec) else None


def sparse_state_bytes(codec: Any) -> int:
    """What a sparse payload's description keeps: per chunk, its tensor and segment (int64 each), and
    with the DCT each block size's two matrices."""
    chunks = sum(g.chunks for g in codec.layout.groups)
    dct = sum(VALUE * (g.h * g.h + g.w * g.w) for g in codec.layout.groups) if codec.dct else 0
    return 16 * chunks + dct


def _sparse_held(s: Any, codec: Any, p: int) -> dict[str, int]:
    """SparseLoCo: θ̃ and the error buffer (outer state, p each); DeMo: its momentum (p) in place of
    the inner optimizer it replaces; both: the payload's description."""
    bill = dict.fromkeys(CATEGORIES, 0)
    wrappers = int(s.ranks_per_worker > 1 and s.inside != "fsdp")  # the DDP inside a worker
    bill.update(
        parameters=p + s.size.buffer_bytes,
        gradients=p,
        ddp_buckets=wrappers * VALUE * s.size.params,
        exchange=sparse_state_bytes(codec),
    )
    if strategy_class(s.strategy).steps_optimizer:
        bill.update(
            inner_optimizer=inner_optimizer_bytes(s.optimizer, s.momentum, p, len(s.size.grad_numels)),
            outer_state=(4 if s.options.get("overlap_rounds") else 2) * p,
        )  # + s_m and the Δ_m in flight
    else:
        bill["inner_optimizer"] = p
    return bill


def _sparse_transient(s: Any, codec: Any) -> int:
    """A sparse exchange (`comm.sparse_mean`, `comm.sparse`): the buffer it is formed in (Δ, or DeMo's
    gradient), p; this rank's payload w, the M gathered and gloo's copy of them, 2M·w; the largest
    group's chosen entries while it is encoded (int64 indices and float32 values, 12 B each, and the
    quantizer's float64 work on them, `QUANTIZER_TEMPORARIES` B each); and a run of chunks' dense
    buffers (the chunks, their magnitudes or coefficients, the mean's accumulator and count: 4 of
    `BATCH_VALUES` values at most)."""
    from ..comm.quantize import RAW
    from ..comm.sparse import BATCH_VALUES

    p = VALUE * codec.layout.numel
    w, m = codec.wire_bytes(), s.workers
    kept = max((sec.kept for sec in codec.sections), default=0)
    run = max((min(BATCH_VALUES, sec.group.chunks * sec.group.size) for sec in codec.sections), default=0)
    entries = (12 + (0 if codec.bits == RAW else QUANTIZER_TEMPORARIES)) * kept
    return p + w + 2 * m * w + entries + 4 * VALUE * run


def _reassembly(b: int, r: int) -> int:
    """DDP inside: a mean of b bytes split over the worker's R ranks and put back together."""
    return 2 * b + 2 * math.ceil(b / r)


def _local_bytes(s: Any) -> tuple[int, int]:
    """(p, s): the parameter bytes rank 0 holds, and with the float persistent buffers what it exchanges."""
    p = VALUE * s.size.local_params(s.ranks_per_worker if s.inside == "fsdp" else 1)
    return p, p + VALUE * (s.size.sync_numel - s.size.params)


def inner_optimizer_bytes(optimizer: str, momentum: float, params_bytes: int, tensors: int) -> int:
    """AdamW: its two moments and a 4-byte step count per tensor; SGD: its momentum buffer, if any."""
    if optimizer == "adamw":
        return ADAMW_MOMENTS * params_bytes + VALUE * tensors
    return params_bytes if momentum > 0 else 0


def _fragments_in_flight(s: Any, held: Sequence[Transfer]) -> list[tuple[int, int]]:
    """Per fragment in flight between steps: (its bytes on this rank, the exchange's buffer for it)."""
    o, r, sharded = s.options, s.ranks_per_worker, s.inside == "fsdp"
    local = s.size.local_fragments(o["fragments"], o["partition"], r if sharded else 1)
    codec, m = get_codec(o["codec"]), s.workers
    sent_copy = o.get("error_feedback") and codec.name != "fp32"  # Δ plus the residual, sent
    out = []
    for x in held:
        n = local[x.fragment]
        share = math.ceil(n / r) if r > 1 and not sharded else n
        if codec.name == "fp32":
            wire = VALUE * share
        elif lossy_path(codec, o.get("codec_collective", "auto"), m, n, s.topology, r, sharded) == "reduce_scatter":
            wire = m * codec.wire_bytes(-(-share // m))
        else:
            wire = m * codec.wire_bytes(share)
        out.append((VALUE * n, wire + (VALUE * n if sent_copy else 0)))
    return out


#: The accelerator a plan checks the memory against unless `--gpu-memory` says otherwise: 80 GB, an
#: A100's or H100's (the large table's too).
DEFAULT_GPU_MEMORY = 80e9


def parse_capacity(text: str | None) -> float:
    """`--gpu-memory`: bytes from '80GB', '141 GB', '24GiB' (`units.parse_bytes`); DEFAULT_GPU_MEMORY
    when not given."""
    if text is None:
        return DEFAULT_GPU_MEMORY
    try:
        return parse_bytes(text)
    except ValueError as e:
        raise ConfigError(f"--gpu-memory: {e}") from None


def smallest_fitting_ranks(s: Any, held_in_flight: Sequence[Transfer], capacity: float, most: int = 1024) -> int | None:
    """The fewest ranks per worker (a power of 2, up to `most`) whose FSDP-sharded peak per GPU fits
    `capacity`; None when none does (buffers and transients do not shrink with R)."""
    r = 1
    while r <= most:
        if (
            memory_bill(dataclasses.replace(s, inside="fsdp", ranks_per_worker=r), held_in_flight)["per_gpu"]
            <= capacity
        ):
            return r
        r *= 2
    return None
