"""The syncer as a role: the merge (`syncer.py`) behind a listener, run by threads in one process of
the run (global rank 0's, beside its learner), talking to every learner over `comm.p2p`.

    learner -> syncer   hello         {learner, settings, join, resume}  when it connects
                        contribution  {base, tokens, steps, values | data (numel | buffers), final,
                                       run_steps, computed}
    syncer -> learner   welcome       {version, ranks, world, merged_steps, values once the run has
                                       moved on or the learner joins, and to one that joins the steps
                                       its earlier lives computed}  or  refused {why}
                        version       {version, values, stop, merged_steps, dropped, final}

A learner that joins (`join`: a process started into the running run, a learner restarted after it
died) takes the current version from the welcome; its earlier life's connection, if still open, is
closed, and what that life computed stays counted in the goodput. A resumed run's learners (`resume`)
enter the same way, each once rank 0 has restored the syncer's state from its checkpoint
(`load_state_dict`); they are not counted as joins.

A learner that sends a contribution based on version b gets back the first version newer than b, as
soon as it exists: at once when the syncer has moved on while it trained (its contribution waits for
the next merge, stale), else at the merge that follows. Every learner alive at a merge with such a
wait gets the version it publishes. A contribution too stale to merge is answered at once with the
newest version, marked dropped. At the end every learner sends a final contribution (the steps after
its last round, possibly none); once every learner connected has, the syncer merges what is pending
and sends that last version to all of them, so they end on the same model.

The run's length: a learner that knows it (`run_steps`, from the trainer) tells the syncer, which
stops the run once it has merged learners × run_steps learner steps, the compute of a lock-step run
of that length; every version sent from then on says stop. A learner that stops ends its loop.
"""

from __future__ import annotations

import math
import socket
import threading
import time
from dataclasses import asdict
from typing import Any, Callable

import torch

from ..comm import p2p
from ..comm.codecs import Encoded
from ..comm.sparse import is_sparse
from ..errors import PeerError, one_line
from ..trust import admission
from ..trust.settings import Trust
from .syncer import Contribution, Merged, Syncer


DROPS_TO_WARN = 3  # a learner whose rounds are dropped this many times in a row is told about once


class SyncerService:
    """The syncer's threads: an admitted listener, one thread per learner's connection, and the merger.

    `ranks`: each learner's global rank (its leader's), for the emulated link of each pair; `rank`:
    this process's global rank; `emulator`: this process's (None: the real network); `settings`: what
    every learner must have been started with (a learner started otherwise is refused in one line);
    `codec`: what the learners send, a dense codec (`comm.codecs`) or a sparse payload (`comm.sparse`)."""

    def __init__(
        self,
        syncer: Syncer,
        *,
        trust: Trust,
        host: str,
        rank: int,
        ranks: list[int],
        world: int,
        emulator: Any,
        settings: dict[str, Any],
        codec: Any,
        log: Callable[[str], None],
        resume_wait_s: float = 600.0,
    ):
        self.syncer, self.rank, self.ranks, self.world = syncer, rank, ranks, world
        self.emulator, self.settings, self.codec, self.log = emulator, settings, codec, log
        self.key = p2p.key(trust)
        self.cond = threading.Condition()
        self.channels: dict[int, p2p.Channel] = {}
        # learners whose connection closed before their final contribution: not waited for. One that has
        # not connected yet is (every learner of the run is expected from the start)
        self.gone: set[int] = set()
        self.waiting: dict[int, int] = {}  # learner -> the base it waits for a newer version than
        self.finals: set[int] = set()
        self.done: set[int] = set()  # learners sent the last version: their connections close by themselves
        # learner -> the steps it computed in this life (its last contribution says), and in lives before
        self.computed: dict[int, int] = {}
        self.past: dict[int, int] = {}
        self.dropped_in_a_row: dict[int, int] = {}  # learner -> its contributions dropped since its last merged one
        self.joins = 0  # lives started into the running run (a learner restarted after it died)
        self.step_s: dict[int, float] = {}  # learner -> its last round's seconds per step
        # learner -> the figures its run averages over workers (bytes, counts, step time), as its last
        # contribution sent them: rank 0's summary without a collective, a learner that died included
        self.figures: dict[int, dict[str, float]] = {}
        self.holds: dict[int, int] = {}  # learner -> the version it holds (its last contribution's base)
        self.sent, self.sent_bytes = 0, 0  # versions sent to learners, and their bytes
        self.budget: int | None = None
        self.merges: list[dict[str, Any]] = []  # not yet drained into the run's events (`drain`)
        self.busy_s = 0.0
        self.began = time.perf_counter()
        self.closed = False
        self.ended = threading.Event()  # the last version is sent to every learner
        self.error: str | None = None
        self.restored = threading.Event()  # a resumed run's state is loaded (`load_state_dict`)
        self.resume_wait_s = resume_wait_s
        self.listener, self.address = p2p.listen(trust, host, self._serve)
        self.merger = threading.Thread(target=self._merge_loop, daemon=True, name="wansync-syncer")
        self.merger.start()

    # ---- one learner's connection ------------------------------------------------------------
    def _serve(self, conn: socket.socket) -> None:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        channel = p2p.Channel(conn, self.key, p2p.LinkModel(None, 0, 0, self.world), "the learner")
        learner = None
        try:
            hello = channel.recv()
            learner = self._admit(channel, hello)
            if learner is None:
                return
            while True:
                msg = channel.recv()
                if msg["kind"] != "contribution":
                    raise PeerError(f"learner {learner} sent a {msg['kind']!r} message, not a contribution")
                self._contribution(learner, channel, msg)
        except PeerError as e:
            current = learner is not None and self.channels.get(learner) is channel  # not a life replaced
            if current and not self.closed and learner not in self.finals | self.done:
                self.log(f"syncer: learner {learner} left ({one_line(str(e))}); the others go on")
        finally:
            with self.cond:
                if learner is not None and self.channels.get(learner) is channel:
                    del self.channels[learner]
                    self.waiting.pop(learner, None)
                    if learner not in self.finals | self.done:
                        self.gone.add(learner)
                self.cond.notify_all()
            channel.close()

    def _admit(self, channel: p2p.Channel, hello: dict[str, Any]) -> int | None:
        learner = hello.get("learner")
        if hello.get("kind") != "hello" or type(learner) is not int or not 0 <= learner < len(self.ranks):
            channel.send({"kind": "refused", "why": "not a learner's hello"})
            return None
        theirs = hello.get("settings")
        joining, resuming = hello.get("join") is True, hello.get("resume") is True
        if theirs != self.settings:
            keys = sorted(k for k in self.settings if not isinstance(theirs, dict) or theirs.get(k) != self.settings[k])
            why = f"learner {learner} was started with other settings than the syncer's: " + ", ".join(
                f"{k} {theirs.get(k) if isinstance(theirs, dict) else None!r} here, {self.settings[k]!r} at the syncer"
                for k in keys
            )
            channel.send({"kind": "refused", "why": why})
            with self.cond:
                self.error = why
                self.cond.notify_all()
            return None
        if resuming and not self.restored.wait(self.resume_wait_s):  # rank 0 restores the state first
            channel.send({"kind": "refused", "why": "the syncer's state was not restored: rank 0 did not resume"})
            return None
        channel.link = p2p.LinkModel(self.emulator, self.rank, self.ranks[learner], self.world)
        with self.cond:
            old = self.channels.get(learner)
            self.channels[learner] = channel
            self.gone.discard(learner)
            welcome: dict[str, Any] = {
                "kind": "welcome",
                "version": self.syncer.version,
                "ranks": self.ranks,
                "world": self.world,
                "merged_steps": self.syncer.tally.merged_steps,
            }
            if self.syncer.version > 0 or joining:  # the learner starts from where the run is
                welcome["values"] = self.syncer.history[self.syncer.version]
            if joining:  # a new life of this learner: what its last one computed stays counted
                self.past[learner] = self.past.get(learner, 0) + self.computed.pop(learner, 0)
                if not resuming:
                    self.joins += 1
                welcome["computed"] = self.past[learner]  # its data goes on from there
                self.done.discard(learner)
                self.finals.discard(learner)
                self.waiting.pop(learner, None)  # the old life's wait: no one is there to take it
            self.cond.notify_all()
        if old is not None:
            old.close()
        channel.send(welcome)
        if joining and not resuming:
            self.log(f"syncer: learner {learner} joined the running run at version {welcome['version']}")
        return learner

    def _contribution(self, learner: int, channel: p2p.Channel, msg: dict[str, Any]) -> None:
        try:
            base, steps, tokens = int(msg["base"]), int(msg["steps"]), int(msg["tokens"])
            values, relative = None, False
            if steps > 0 and "values" in msg:
                values = msg["values"]
            elif steps > 0 and is_sparse(self.codec):
                values, relative = self._sparse_values(msg["data"], msg["buffers"]), True
            elif steps > 0:
                enc = Encoded(self.codec.name, int(msg["numel"]), msg["data"])
                values, relative = self.codec.decode(enc).to(self.syncer.value.dtype), True
            if values is not None and (not isinstance(values, torch.Tensor) or values.shape != self.syncer.value.shape):
                raise ValueError("its values are not the model's")
        except (KeyError, TypeError, ValueError) as e:
            raise PeerError(f"learner {learner} sent a malformed contribution ({one_line(str(e))})") from None
        reply = None
        with self.cond:
            if msg.get("run_steps") is not None and self.budget is None:
                self.budget = len(self.ranks) * int(msg["run_steps"])
            kept = True
            if values is not None:
                kept = self.syncer.add(Contribution(learner, base, tokens, steps, values, relative, time.monotonic()))
                self.dropped_in_a_row[learner] = 0 if kept else self.dropped_in_a_row.get(learner, 0) + 1
            self.computed[learner] = max(self.computed.get(learner, 0), int(msg.get("computed", 0)))
            if steps > 0 and isinstance(msg.get("step_s"), (int, float)) and msg["step_s"] > 0:
                self.step_s[learner] = float(msg["step_s"])  # its speed, for `dynamic_h`
            self.holds[learner] = base  # the version it trained from, which it holds until a reply
            figures = msg.get("figures")
            if isinstance(figures, dict):  # numbers only: a peer's message, however it was sealed
                self.figures[learner] = {
                    k: float(v)
                    for k, v in figures.items()
                    if isinstance(k, str) and type(v) in (int, float) and math.isfinite(v) and v >= 0
                }
            if msg.get("final"):
                self.finals.add(learner)
                self.waiting.pop(learner, None)
            elif not kept or self.syncer.version > base:
                reply = self._version_message(dropped=not kept)
            else:
                self.waiting[learner] = base
            self.cond.notify_all()
        if not kept:
            self.log(
                f"syncer: dropped learner {learner}'s {steps} steps based on version {base}: more than "
                f"max_staleness {self.syncer.settings.max_staleness} versions old (now {self.syncer.version})"
            )
            if self.dropped_in_a_row.get(learner) == DROPS_TO_WARN:
                self.log(
                    f"syncer: warning: learner {learner}'s last {DROPS_TO_WARN} rounds were all dropped: it trains "
                    f"for nothing while it is this much slower than the others; raise --max-staleness (now "
                    f"{self.syncer.settings.max_staleness}), or shorten its rounds with --dynamic-h"
                )
        if reply is not None:
            self._send(channel, reply)

    def _sparse_values(self, data: Any, buffers: Any) -> torch.Tensor:
        """A sparse contribution as the merge takes it, θ_m − θ̃_base: minus the pseudo-gradient Δ_m its
        payload decodes to (`SparseCodec.decode_into`), then the float buffers as sent. ValueError for
        bytes that are not a payload of the layout."""
        size = self.codec.wire_bytes()
        if not isinstance(data, torch.Tensor) or data.dtype != torch.uint8 or data.numel() != size:
            raise ValueError(f"its payload is not the layout's {size} bytes")
        if not isinstance(buffers, torch.Tensor):
            raise ValueError("its buffers are not a tensor")
        n = self.codec.layout.numel
        values = torch.empty(n + buffers.numel(), dtype=torch.float32)
        try:
            self.codec.decode_into(data.reshape(-1), values[:n])
        except (RuntimeError, IndexError) as e:  # an index beyond its chunk
            raise ValueError(f"its payload does not decode: {one_line(str(e))}") from None
        values[:n].neg_()
        values[n:] = buffers.reshape(-1)
        return values.to(self.syncer.value.dtype)

    def _version_message(self, dropped: bool = False, final: bool = False) -> dict[str, Any]:
        """The newest version as a reply (under the lock)."""
        stop = self.budget is not None and self.syncer.tally.merged_steps >= self.budget
        return {
            "kind": "version",
            "version": self.syncer.version,
            "values": self.syncer.history[self.syncer.version],
            "stop": stop,
            "merged_steps": self.syncer.tally.merged_steps,
            "fastest_step_s": min(self.step_s.values(), default=None),
            "dropped": dropped,
            "final": final,
        }

    # ---- the merger ----------------------------------------------------------------------------
    def _merge_loop(self) -> None:
        while True:
            with self.cond:
                while True:
                    if self.closed:
                        return
                    now = time.monotonic()
                    alive = set(range(len(self.ranks))) - self.gone
                    ending = alive <= self.finals
                    if ending or self.syncer.due(now, len(alive - self.finals)):
                        break
                    self.cond.wait(timeout=self.syncer.wait_s(now))
                began = time.perf_counter()
                merged: Merged | None = None
                if self.syncer.pending:
                    merged = self.syncer.merge()
                    self.merges.append({**asdict(merged), "time": round(time.perf_counter() - self.began, 6)})
                replies = []
                if ending:  # the last version: its values only to a learner that does not hold it
                    message = self._version_message(final=True)
                    same = {**message, "values": None}
                    replies = [
                        (self.channels[m], same if self.holds.get(m) == self.syncer.version else message)
                        for m in sorted(alive)
                        if m in self.channels
                    ]
                    self.finals -= alive
                    self.done |= alive
                else:
                    message = self._version_message()
                    for m, base in sorted(self.waiting.items()):
                        if base < self.syncer.version and m in self.channels:
                            replies.append((self.channels[m], message))
                            del self.waiting[m]
            for channel, message in replies:
                self._send(channel, message)
            self.busy_s += time.perf_counter() - began
            if ending:
                self.ended.set()
                return

    def _send(self, channel: p2p.Channel, message: dict[str, Any]) -> None:
        """A version to a learner, counted (`sent`, `sent_bytes`: the syncer's traffic, booked on rank 0)."""
        try:
            channel.send(message)
        except PeerError:
            return  # its connection's thread sees it gone
        values = message.get("values")
        with self.cond:
            self.sent += 1
            self.sent_bytes += 0 if values is None else values.numel() * values.element_size()

    def wait_ended(self, timeout_s: float = 600.0) -> None:
        """Until the last version is sent to every learner (rank 0's finish, before it closes the syncer)."""
        self.ended.wait(timeout_s)

    # ---- what the run reads -----------------------------------------------------------------------
    def drain(self) -> list[dict[str, Any]]:
        """The merges since the last call (the run's `merge` events)."""
        with self.cond:
            out, self.merges = self.merges, []
        return out

    def learner_figures(self) -> dict[int, dict[str, float]]:
        """Each learner's figures as its last contribution sent them (`figures`)."""
        with self.cond:
            return {learner: dict(f) for learner, f in self.figures.items()}

    def summary(self) -> dict[str, Any]:
        """Goodput (tokens merged / tokens the learners computed: a dropped contribution, or the round of
        a learner that died, is computed and never merged), the merges' staleness and the syncer's idle
        share (of its wall clock, the time it was not merging or sending versions)."""
        tally, wall = self.syncer.tally, time.perf_counter() - self.began
        computed = sum(self.computed.values()) + sum(self.past.values())
        return {
            "versions": self.syncer.version,
            "computed_tokens": computed,
            "merged_tokens": tally.merged_tokens,
            "dropped_tokens": tally.dropped_tokens,
            "goodput": round(tally.merged_tokens / computed, 6) if computed else None,
            "staleness_mean": round(sum(tally.staleness) / len(tally.staleness), 6) if tally.staleness else None,
            "staleness_max": max(tally.staleness, default=None),
            "syncer_idle_time_share": round(max(0.0, 1.0 - self.busy_s / wall), 6) if wall > 0 else None,
            "joins": self.joins,
        }

    # ---- its state, for the run's checkpoint (rank 0's) --------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The merge's state (θ̃, its version and history, the outer optimizer's, the tally) and what the
        goodput counts: each learner's computed steps, and the lives that joined."""
        with self.cond:
            return {
                "syncer": self.syncer.state_dict(),
                "computed": {str(m): n for m, n in self.computed.items()},
                "past": {str(m): n for m, n in self.past.items()},
                "joins": self.joins,
            }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """A resumed run's syncer, before any learner rejoins it (`async_diloco.load_extra_state`)."""
        with self.cond:
            self.syncer.load_state_dict(state["syncer"])
            self.computed = {int(m): int(n) for m, n in state["computed"].items()}
            self.past = {int(m): int(n) for m, n in state["past"].items()}
            self.joins = int(state["joins"])
            self.cond.notify_all()
        self.restored.set()

    def close(self) -> None:
        with self.cond:
            self.closed = True
            self.cond.notify_all()
        admission.close_listener(self.listener)
        for channel in list(self.channels.values()):
            channel.close()
        self.merger.join(timeout=5)
