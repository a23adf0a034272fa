"""Per-sync-event communication timing: bytes, modelled and measured duration, exposed and hidden part.

Two sources of "the training thread was blocked on the network":

* **Our strategies** exchange through :mod:`wansync.comm.ledger`, whose ``Pending.wait()`` times
  every blocking wait and tells its listeners (``CommLedger.on_wait``): that time is exposed.
* **DDP** (and every strategy that wraps the model in ``DistributedDataParallel``: ddp, cpdp,
  post_local_sgd) communicates *inside* ``forward()`` and ``backward()``, where the reducer waits
  on the bucket futures in C++. :meth:`CommTimer.instrument` measures it without changing a bit
  of DDP's arithmetic:

  - it registers a comm hook that *calls torch's own default* ``allreduce_hook`` (same division,
    same all-reduce) and only timestamps around it: the hook runs when a bucket's gradients are
    ready, so the moment the last hook returns is the point where backward's compute is done
    (``C``); a ``.then`` on the returned future timestamps each bucket's completion;
  - it wraps the instance's ``_pre_forward`` (and ``_sync_buffers``): there DDP blocks on the
    broadcast of module buffers from rank 0 before every forward (``broadcast_buffers=True``; the
    LM's rotary tables are buffers) and, once, on the bucket-rebuild broadcasts of its second
    iteration. A window that sent something is exposed in full; one that did not stays compute.

  After ``backward()`` returns at ``R``, the bucket wait that was exposed is
  ``clamp(F_last - C, 0, R - C)`` with ``F_last`` the last bucket completion: between ``C`` and
  ``F_last`` the thread had nothing to do but wait (DDP's reducer waits for every bucket before
  backward returns). Bucket communication before ``C`` overlapped backward compute: hidden.

With the emulator on (``--wan``), every collective has a :class:`wansync.net.CollectiveRecord`
(issue, modelled duration, completion, ``waited`` when Python waited on its Work). Each collective
issued during a training step then gets: modelled duration, measured duration (issue → completion),
exposed part (its ``waited``; for DDP buckets and buffer broadcasts, the share of the blocked
interval above during which it was the one being waited for, FIFO by completion) and hidden part
(measured − exposed). A sync event is one training step's communication (or ``finish``);
collectives issued in a step are attributed to that step even when they are waited on later
(asynchronous strategies).

Without the emulator only DDP's buckets and buffer broadcasts have completion timestamps (from the
hook); our strategies' collectives have their exposed part (ledger waits, attributed to the step in
which they were waited on) but ``measured_s`` and ``hidden_s`` are ``None``. Run under
``--wan lan`` for complete records at (almost) no added cost.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

__all__ = ["CommTimer", "ddp_modules", "attribute_blocked", "union_length"]


def ddp_modules(obj: Any) -> list[Any]:
    """The DistributedDataParallel wrappers a strategy holds (its attributes, its gradient phases'
    wrappers, and its ``model``)."""
    from torch.nn.parallel import DistributedDataParallel

    found: dict[int, Any] = {}
    candidates = list(vars(obj).values())
    candidates += [v.ddp for v in list(candidates) if hasattr(v, "ddp")]  # GradientSync phases
    try:
        candidates.append(obj.model)
    except Exception:  # noqa: BLE001 - a property that cannot be evaluated yet
        pass
    for v in candidates:
        if isinstance(v, DistributedDataParallel):
            found[id(v)] = v
    return list(found.values())


def union_length(intervals: list[tuple[float, float]]) -> float:
    """Total length covered by the intervals."""
    total, cur_s, cur_e = 0.0, None, None
    for s, e in sorted(intervals):
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        total += cur_e - cur_s
    return total


def attribute_blocked(a: float, b: float, ends: list[float]) -> list[float]:
    """Split the blocked interval [a, b] among transfers that complete at ``ends`` (FIFO): each one
    gets the part of [a, b] between the previous completion and its own."""
    out = [0.0] * len(ends)
    prev = a
    for i in sorted(range(len(ends)), key=lambda i: ends[i]):
        hi = min(ends[i], b)
        if hi > prev:
            out[i] = hi - prev
            prev = hi
    return out


@dataclass
class _Bucket:
    hook_start: float
    hook_end: float
    nbytes: int
    done: float | None = None


@dataclass
class _Step:
    step: int | str
    start: float
    end: float = 0.0
    ledger_bytes: int = 0
    ledger_waited: float = 0.0
    buckets: list[_Bucket] = field(default_factory=list)
    buffer_syncs: list[tuple[float, float, int]] = field(default_factory=list)
    ddp_blocked: tuple[float, float] | None = None  # [C, min(F_last, R)]
    records: list[Any] = field(default_factory=list)


class CommTimer:
    """Collects the timing of one worker's communication, step by step (training thread only)."""

    def __init__(self, emulator: Any = None) -> None:
        """``emulator``: the :class:`wansync.net.Emulator` the group runs under (None: not emulated);
        its records from now on are attributed to steps."""
        self.emulator = emulator
        self.instrumented: list[str] = []
        self.uninstrumented: list[str] = []
        self._steps: list[_Step] = []
        self._cur: _Step | None = None
        self.steps = 0  # training steps timed by this process
        self._cursor = emulator.record_count() if emulator is not None else 0

    @property
    def emulated(self) -> bool:
        return self.emulator is not None

    @property
    def in_step(self) -> bool:
        """Between `begin` and `end`: a step's (or the finish's) communication is being timed."""
        return self._cur is not None

    # ---- DDP instrumentation ------------------------------------------------------------------
    def instrument(self, ddp: Any) -> bool:
        """Time ``ddp``'s bucket all-reduces and buffer broadcasts (math unchanged). False when a comm
        hook is already registered (then its backward wait stays in ``compute``)."""
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        timer = self

        def timed_allreduce_hook(process_group, bucket):  # no annotations: DDP inspects them
            t0 = time.perf_counter()
            fut = allreduce_hook(process_group, bucket)
            buf = bucket.buffer()
            b = _Bucket(t0, time.perf_counter(), buf.numel() * buf.element_size())
            if timer._cur is not None:
                timer._cur.buckets.append(b)

            def done(f):
                b.done = time.perf_counter()
                return f.value()

            return fut.then(done)

        try:
            # the hook's state is the group it all-reduces over: DDP's own (a worker's ranks), not the default
            ddp.register_comm_hook(ddp.process_group, timed_allreduce_hook)
        except RuntimeError:
            self.uninstrumented.append(type(ddp).__name__)
            return False
        depth = [0]

        def blocking(fn: Any, buffers: bool) -> Any:
            def timed(*args: Any, **kwargs: Any) -> Any:
                outer = depth[0] == 0
                nbytes = 0
                if buffers and outer:
                    check = getattr(ddp, "_check_sync_bufs_pre_fwd", lambda: True)
                    if check():
                        nbytes = sum(b.numel() * b.element_size() for b in getattr(ddp, "modules_buffers", []))
                rebuilt = getattr(ddp, "_has_rebuilt_buckets", True)
                depth[0] += 1
                t0 = time.perf_counter()
                try:
                    return fn(*args, **kwargs)
                finally:
                    t1 = time.perf_counter()
                    depth[0] -= 1
                    # only a window that communicated: buffers broadcast, or the one-off bucket rebuild
                    talked = nbytes > 0 or not buffers or getattr(ddp, "_has_rebuilt_buckets", True) != rebuilt
                    if outer and talked and timer._cur is not None:
                        timer._cur.buffer_syncs.append((t0, t1, nbytes))

            return timed

        # DDP's pre-forward: the blocking buffer broadcast and, once, the bucket-rebuild broadcasts
        ddp._pre_forward = blocking(ddp._pre_forward, True)
        ddp._sync_buffers = blocking(ddp._sync_buffers, False)  # when called after forward
        self.instrumented.append("ddp")
        return True

    # ---- the step protocol (called by the training loop) ------------------------------------
    def begin(self, step: int | str, ledger_bytes: int) -> None:
        if isinstance(step, int):
            self.steps += 1
        self._cur = _Step(step=step, start=time.perf_counter(), ledger_bytes=-ledger_bytes)

    def after_backward(self) -> float:
        """Call right after ``backward()`` returns: the seconds of forward+backward that were spent
        blocked on DDP communication (buffer broadcasts + bucket waits after compute was done)."""
        r = time.perf_counter()
        s = self._cur
        if s is None:
            return 0.0
        exposed = sum(e - b for b, e, _ in s.buffer_syncs)
        if s.buckets:
            c = max(b.hook_end for b in s.buckets)
            f_last = max((b.done or r) for b in s.buckets)
            hi = min(max(f_last, c), r)
            s.ddp_blocked = (c, hi)
            exposed += hi - c
        return exposed

    def waited_on(self, groups: set[str]) -> tuple[float, int]:
        """(seconds waited, bytes) of this step's collectives so far on `groups`: FSDP's all-gathers
        and reduce-scatters inside a sharded worker, which it waits for inside forward and backward
        (emulated runs only: elsewhere nothing records them, and (0, 0))."""
        s = self._cur
        if s is None or not self.emulated:
            return 0.0, 0
        recs = [r for r in self.emulator.records_since(self._cursor) if r.group in groups and r.issue >= s.start]
        return sum(r.waited or 0.0 for r in recs), sum(r.nbytes for r in recs)

    def end(self, ledger_bytes: int, ledger_waited: float) -> None:
        s = self._cur
        if s is None:
            return
        s.end = time.perf_counter()
        s.ledger_bytes += ledger_bytes
        s.ledger_waited = ledger_waited
        if self.emulated:  # collectives issued in this step (not those of an evaluation before it)
            s.records = [r for r in self._new_records() if r.issue >= s.start]
        if s.ledger_bytes or s.ledger_waited or s.buckets or s.buffer_syncs or s.records:
            self._steps.append(s)
        self._cur = None

    # ---- emulator records -------------------------------------------------------------------
    def _new_records(self) -> list[Any]:
        new = self.emulator.records_since(self._cursor)
        self._cursor += len(new)
        return new

    # ---- results ----------------------------------------------------------------------------
    def events(self) -> list[dict[str, Any]]:
        return [self._event(s) for s in self._steps]

    def _event(self, s: _Step) -> dict[str, Any]:
        ev: dict[str, Any] = {"step": s.step}
        if self.emulated:
            colls = self._collectives(s)
            ev["bytes"] = sum(c["bytes"] for c in colls)
            ev["collectives"] = len(colls)
            ev["modelled_s"] = sum(c["modelled_s"] for c in colls)
            ends = [(r.start, r.end if r.end is not None else s.end) for r in s.records]
            ev["measured_s"] = union_length(ends)
            ev["exposed_s"] = sum(c["exposed_s"] for c in colls)
            ev["hidden_s"] = max(0.0, ev["measured_s"] - ev["exposed_s"])
            ev["per_collective"] = colls
            return ev
        ddp_bytes = sum(b.nbytes for b in s.buckets)
        buf_bytes = sum(n for _, _, n in s.buffer_syncs)
        ddp_exposed = sum(e - b for b, e, _ in s.buffer_syncs)
        if s.ddp_blocked:
            ddp_exposed += s.ddp_blocked[1] - s.ddp_blocked[0]
        # the ledger counts DDP's gradient bytes too (as "grads"); what is left is the strategy's own
        own_bytes = max(0, s.ledger_bytes - ddp_bytes)
        ev["bytes"] = max(s.ledger_bytes, ddp_bytes) + buf_bytes
        ev["collectives"] = len(s.buckets) + len(s.buffer_syncs) + (1 if own_bytes else 0)
        ev["modelled_s"] = None
        ev["exposed_s"] = ddp_exposed + s.ledger_waited
        if own_bytes or s.ledger_waited:
            ev["measured_s"] = ev["hidden_s"] = None  # no completion time for the strategy's collectives
        else:
            spans = [(b.hook_start, b.done if b.done is not None else s.end) for b in s.buckets]
            spans += [(b, e) for b, e, _ in s.buffer_syncs]
            ev["measured_s"] = union_length(spans)
            ev["hidden_s"] = max(0.0, ev["measured_s"] - ev["exposed_s"])
        return ev

    def _collectives(self, s: _Step) -> list[dict[str, Any]]:
        recs = s.records
        exposed: list[float | None] = [r.waited for r in recs]
        # DDP buckets: records issued inside a hook call share the backward's blocked interval
        bucket_idx = [i for i, r in enumerate(recs) if any(b.hook_start <= r.issue <= b.hook_end for b in s.buckets)]
        if bucket_idx and s.ddp_blocked:
            c, hi = s.ddp_blocked
            ends = [recs[i].end or hi for i in bucket_idx]
            parts = attribute_blocked(c, hi, ends)
            parts[ends.index(max(ends))] += max(0.0, (hi - c) - sum(parts))  # callback after the record's end
            for i, p in zip(bucket_idx, parts):
                exposed[i] = p
        for b0, b1, _ in s.buffer_syncs:  # blocking broadcasts: the whole window is exposed
            idx = [i for i, r in enumerate(recs) if b0 <= r.issue <= b1]
            for i in idx:
                exposed[i] = None  # the window below replaces what Work.wait() saw (no double count)
            ends = [recs[i].end or b1 for i in idx]
            parts = attribute_blocked(b0, b1, ends)
            if idx:
                parts[ends.index(max(ends))] += max(0.0, (b1 - b0) - sum(parts))  # copies around it
            for i, p in zip(idx, parts):
                exposed[i] = (exposed[i] or 0.0) + p
        out = []
        for r, ex in zip(recs, exposed):
            measured = (r.end - r.start) if r.end is not None else None  # on the link, not queued
            ex_s = ex or 0.0
            out.append(
                {
                    "op": r.op,
                    "bytes": r.nbytes,
                    "issue_s": r.issue - s.start,
                    "queued_s": max(0.0, r.start - r.issue),
                    "modelled_s": r.modelled_s,
                    "measured_s": measured,
                    "exposed_s": ex_s,
                    "hidden_s": max(0.0, measured - ex_s) if measured is not None else None,
                }
            )
        return out

    def summary(self, steps: int, epochs: float | None) -> dict[str, Any]:
        """Totals and the derived figures, per training step and per epoch."""
        evs = self.events()
        total_bytes = sum(e["bytes"] for e in evs)
        exposed = sum(e["exposed_s"] for e in evs)
        known = [e for e in evs if e["measured_s"] is not None]
        measured = sum(e["measured_s"] for e in known) if known else None
        hidden = sum(e["hidden_s"] for e in known) if known else None
        exposed_known = sum(e["exposed_s"] for e in known)
        out: dict[str, Any] = {
            "events": len(evs),
            "bytes": total_bytes,
            "bytes_per_step": total_bytes / steps if steps else 0.0,
            "events_per_epoch": len(evs) / epochs if epochs else None,
            "modelled_s": sum(e["modelled_s"] for e in evs) if self.emulated else None,
            "measured_s": measured,
            "exposed_s": exposed,
            "hidden_s": hidden,
            "hidden_pct": (
                100.0 * hidden / (hidden + exposed_known) if hidden is not None and hidden + exposed_known > 0 else None
            ),
            "complete": len(known) == len(evs),
            "ddp_instrumented": bool(self.instrumented),
        }
        if self.uninstrumented:
            out["ddp_uninstrumented"] = self.uninstrumented
        return out
