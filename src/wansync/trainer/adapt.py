"""`--adapt exposed=5%`: before each outer round, the H and the compression that keep the predicted
exposed share of the wall clock under a target, on the link the run measures.

The rule, at every boundary of DiLoCo or SparseLoCo (any of their options, `overlap_rounds` too):

1. **What every rank agreed.** At the previous boundary each rank shared what it measured: the link
   (`telemetry.linkwatch`: the bandwidth of its newest exchanges, and the lower of that and the
   newest one alone, so that a drop is acted on at once and a recovery once two exchanges confirm
   it; the RTT of its small collectives), its median compute and other time per step over the
   round. The bandwidth counts only from the ranks that saw an exchange cross the link since they
   last shared (by sites, only the sites' first members carry it; an overlapped mean may still be
   on its way); when none did, the link stays as last agreed. The means, rounded to three
   significant digits, reach every rank alike (one small
   all-reduce of the group, issued after that boundary's exchange and waited for at this one: it
   rides behind the exchange on the link and is its RTT's own sample).
2. **The inputs, settled.** The link is the one agreed last. The step (compute and other per step)
   is the fastest of the last `WINDOW` rounds' agreed medians (`settled_step`), not the last round's:
   on a loaded machine a round's median swings by 2x and more (0.22-0.52 s against an emulated
   0.15 s), and what moves it there (a co-tenant, a checkpoint, an evaluation) only ever adds time,
   while the exposed share grows as the step shrinks. A median over the window would still plan
   with a loaded step and give up protection the next unloaded round needs; the fastest recent
   round is the step the knobs must hold the target for, and it moves only when a faster round
   comes in (at once) or when the last fast one leaves the window. The link is not smoothed: a drop
   must be acted on at once, and under load its estimate errs low, toward protection (on the
   benchmark's 100 ms link, 25 % low at worst beside a load of 8, its RTT within 4 %). Every rank keeps
   the same window of agreed numbers, so every rank plans alike. The inputs are settled once the
   window holds `WINDOW` rounds.
3. **What the planner predicts.** For each candidate, in the order of preference — H from the
   lowest allowed up, and at each H the compression from the lightest (the codec ladder fp32, bf16,
   int8, fp4 from the run's codec; SparseLoCo's density halving from the run's) — the planner's
   own prediction (`planner.predict`: the strategy's schedule on the cost model, on the run's
   topology with the measured link between its sites, and this controller's own agreement of step 1
   behind each exchange: an overlapped two-phase mean's second phase waits behind it on the link) of
   the exposed share. The first candidate under the target is taken; one other than the current
   knobs only if it holds the target at a step 10 % faster than the settled one (`HYSTERESIS`): no
   flapping at the target, and a setting taken for a drop of the link leaves room for the next
   faster round (near the point where an exchange stops hiding behind the compute, the exposed
   share moves by a point for a few per cent of step time, and on a busy machine the settled step
   moves by that much). When none is taken, the one predicted least exposed.
4. **When it is taken.** With the current knobs predicted over the target, the choice is toward
   more protection (a later candidate, or an earlier one predicted under the target: less exposed
   either way) and is taken at once. With the current knobs within the target, the choice can only
   be a lighter setting, earlier in the order (lower H, or less compression at the same H): going
   back. It is taken only once it held the target 10 % faster in two consecutive rounds on settled
   inputs (the earliest candidate that was, in both); one round under it (a link that
   reads fast for one exchange) moves nothing.
5. **The change**, when there is one: the codec or density from this boundary's exchange on, H
   from this boundary on (`Strategy.retune`), and one `adapt` record in metrics.jsonl with the
   reason (the measured link and settled step, the prediction, the target).

The first boundary has nothing agreed yet and keeps the run's own knobs. Every rank decides from the
same numbers with the same code, so every rank takes the same decision; a run on the emulator
repeats its decisions as long as its measured times land on the same three digits (a seed fixes
the rest), which an emulated step time (`[compute] step` of a topology file) makes likely.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from ..errors import ConfigError
from ..net.estimate import on_link, wan_link
from ..net.link import Link
from ..net.topology import Topology
from ..planner.prediction import H_CANDIDATES, MAX_SIMULATED_STEPS, predict, setting
from ..planner.sizes import of_module
from ..telemetry.linkwatch import LinkWatch

CODEC_LADDER = ("fp32", "bf16", "int8", "fp4")  # lightest compression first
DENSITY_STEPS = 4  # the density ladder: the run's, then halved this many times - 1
STRATEGIES = ("diloco", "sparseloco")
PURPOSE = "adapt"  # the ledger's purpose of the agreement
AGREED = 6  # float64 values each rank shares at a boundary (`after_round`)
HYSTERESIS = 0.1  # a setting other than the current one must hold the target at a step 10 % faster
WINDOW = 5  # rounds of agreed step times whose fastest the plan takes (`settled_step`)
CACHED = 4096  # predictions kept (each candidate at each step and link the rounds agreed)


@dataclass(frozen=True)
class AdaptSpec:
    """What `--adapt` asks for: the target and the candidates, in the order of preference."""

    target_pct: float
    sync_every: tuple[int, ...]  # H, lowest first
    knob: str  # codec | density
    ladder: tuple[Any, ...]  # lightest compression first

    def candidates(self) -> list[dict[str, Any]]:
        return [{"sync_every": h, self.knob: c} for h in self.sync_every for c in self.ladder]


def _pct(text: str) -> float:
    value = text.strip().removesuffix("%")
    try:
        pct = float(value)
    except ValueError:
        raise ConfigError(f"--adapt exposed={text}: a percentage like 5% is expected") from None
    if not 0 < pct < 100 or not math.isfinite(pct):
        raise ConfigError(f"--adapt exposed={text}: the target must lie strictly between 0 and 100 %")
    return pct


def _range(text: str, key: str, cast: Callable[[str], Any]) -> tuple[Any, Any]:
    lo, sep, hi = text.partition("..")
    try:
        return (cast(lo), cast(hi)) if sep else (cast(text), cast(text))
    except ValueError:
        raise ConfigError(f"--adapt {key}={text}: give a value or a range LOW..HIGH") from None


def parse_adapt(text: str, strategy: str, options: dict[str, Any]) -> AdaptSpec | None:
    """`exposed=5%[,h=LOW..HIGH][,codec=LIGHTEST..HEAVIEST | ,density=HIGH..LOW]` for `strategy`
    with its resolved `options`; None for an empty text. One ConfigError line for each mistake."""
    if not text or not text.strip():
        return None
    if strategy not in STRATEGIES:
        raise ConfigError(
            f"--adapt turns H and the compression of {' and '.join(STRATEGIES)}; {strategy} has no " f"knob it turns"
        )
    fields: dict[str, str] = {}
    for part in text.split(","):
        key, sep, value = part.partition("=")
        key = key.strip()
        if not sep or key not in ("exposed", "h", "codec", "density"):
            raise ConfigError(
                f"--adapt {text!r}: expected exposed=PCT[,h=LOW..HIGH][,codec=A..B][,density=HIGH..LOW], "
                f"got {part.strip()!r}"
            )
        if key in fields:
            raise ConfigError(f"--adapt {text!r}: {key} given twice")
        fields[key] = value.strip()
    if "exposed" not in fields:
        raise ConfigError(f"--adapt {text!r}: the target is missing (exposed=5%, say)")
    if options.get("slow_policy", "wait") != "wait":
        raise ConfigError(
            "--adapt changes H between rounds, which a slow policy other than wait plans its "
            "rounds by: use --slow-policy wait with --adapt"
        )
    knob = "density" if strategy == "sparseloco" else "codec"
    other = "codec" if knob == "density" else "density"
    if other in fields:
        raise ConfigError(f"--adapt {other}=...: {strategy} turns its {knob}, not a {other}")
    h = int(options["sync_every"])
    lo, hi = _range(fields.get("h", f"{h}..{4 * h}"), "h", int)
    if not 1 <= lo <= hi:
        raise ConfigError(f"--adapt h={fields.get('h')}: H needs 1 <= LOW <= HIGH")
    if 3 * hi > MAX_SIMULATED_STEPS:  # the planner would simulate each candidate's periods for hours
        raise ConfigError(
            f"--adapt h={fields.get('h', f'{lo}..{hi}')}: H up to {MAX_SIMULATED_STEPS // 3:,} (the "
            f"planner simulates a warm-up and two periods of each candidate), got {hi:,}"
        )
    hs = tuple(sorted({lo, hi, *(c for c in H_CANDIDATES if lo < c < hi)}))
    ladder = _codec_ladder(fields, options) if knob == "codec" else _density_ladder(fields, options)
    if len(hs) * len(ladder) < 2:
        raise ConfigError(
            f"--adapt {text!r}: the bounds leave one setting (H {hs[0]}, {knob} {ladder[0]}): "
            f"nothing to choose; widen h= or {knob}="
        )
    return AdaptSpec(_pct(fields["exposed"]), hs, knob, ladder)


def _codec_ladder(fields: dict[str, str], options: dict[str, Any]) -> tuple[str, ...]:
    lightest, heaviest = _range(fields.get("codec", f"{options['codec']}..{CODEC_LADDER[-1]}"), "codec", str)
    for name in (lightest, heaviest):
        if name not in CODEC_LADDER:
            raise ConfigError(f"--adapt codec={fields.get('codec')}: {name!r} is not one of {', '.join(CODEC_LADDER)}")
    a, b = CODEC_LADDER.index(lightest), CODEC_LADDER.index(heaviest)
    if a > b:
        raise ConfigError(
            f"--adapt codec={fields['codec']}: give the lightest compression first " f"({' .. '.join(CODEC_LADDER)})"
        )
    return CODEC_LADDER[a : b + 1]


def _density_ladder(fields: dict[str, str], options: dict[str, Any]) -> tuple[float, ...]:
    if options.get("topk"):
        raise ConfigError("--adapt turns SparseLoCo's density: give --density instead of --topk")
    d = float(options["density"])
    high, low = _range(fields.get("density", f"{d}..{d / 2 ** (DENSITY_STEPS - 1)}"), "density", float)
    if not (0 < low <= high <= 1):
        raise ConfigError(f"--adapt density={fields.get('density')}: give HIGH..LOW with 0 < LOW <= HIGH <= 1")
    ladder, x = [], high
    while x >= low * (1 - 1e-9):
        ladder.append(x)
        x /= 2
    if ladder[-1] > low * (1 + 1e-9):
        ladder.append(low)
    chunk = int(options.get("chunk", 64))
    if low * chunk * chunk < 1:
        raise ConfigError(
            f"--adapt density={fields.get('density', '')}: {low:g} keeps less than one value of a "
            f"{chunk}x{chunk} chunk; the lowest density is {1 / chunk ** 2:.2g}"
        )
    return tuple(ladder)


def _three_digits(x: float) -> float:
    return float(f"{x:.3g}")


def settled_step(rounds: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """The (compute, other) per step to plan with: the fastest (least compute + other) of the last
    `WINDOW` rounds' agreed medians (module docstring: the noise of a step time only adds time)."""
    return min(rounds[-WINDOW:], key=sum)


class Tuner:
    """One rank's controller (module docstring): `before_round` and `after_round` at each boundary,
    called by the strategy (`Strategy.round_boundary`)."""

    def __init__(
        self,
        spec: AdaptSpec,
        sync: Any,
        topology: Topology,
        step_times: Callable[[], list[tuple[float, float]]],
        inside: str = "ddp",
        say: Callable[[str], None] | None = None,
    ):
        self.spec, self.sync, self.topology = spec, sync, topology
        self.step_times = step_times  # the run's (compute, other) per step so far
        self.say = say or (lambda line: None)
        self.watch = LinkWatch(sync.group)
        self.size = of_module(sync.name, sync.module)
        self.inside = inside
        self.options = {k: v for k, v in dataclasses.asdict(sync.opts).items()}
        self.current = {"sync_every": int(sync.opts.sync_every), spec.knob: self._knob(sync)}
        self.agreed: list[float] | None = None  # what every rank shared at the last boundary
        self.rounds: list[tuple[float, float]] = []  # the last WINDOW rounds' agreed (compute, other)
        self.under: list[dict[str, Any]] = []  # lighter knobs under the target last round, on settled inputs
        self._pending: tuple[Any, torch.Tensor] | None = None
        self._round_began = 0  # index into step_times where this round began
        self._measured_at: float | None = None  # the newest exchange this rank last shared
        self._cache: dict[tuple, float] = {}
        self.decisions = 0

    def _knob(self, sync: Any) -> Any:
        return sync.codec.name if self.spec.knob == "codec" else float(sync.opts.density)

    # ---- at each boundary ----------------------------------------------------------------------
    def before_round(self, sync: Any) -> None:
        """Wait for what the ranks agreed at the last boundary, choose, and turn the knobs."""
        if self._pending is not None:
            work, vec = self._pending
            t0 = time.perf_counter()
            work.wait()
            sync.comm.waited(PURPOSE, time.perf_counter() - t0)
            self._pending = None
            self.record(self._agree(vec))
        change = self.decide()
        if change is not None:
            self.apply(sync, *change)

    def after_round(self, sync: Any) -> None:
        """Share what this rank saw of the link and its steps (waited for at the next boundary)."""
        est = self.watch.current()
        bw = est.bandwidth_bps
        if bw is not None:
            newest = self.watch.newest(est.rtt_s).bandwidth_bps
            bw = min(bw, newest) if newest is not None else bw
        if est.newest_at is None or est.newest_at == self._measured_at:
            bw = None  # nothing new crossed the link from this rank since
        self._measured_at = est.newest_at
        times = self.step_times()[self._round_began :]
        self._round_began = len(self.step_times())
        compute = statistics.median(c for c, _ in times) if times else 0.0
        other = statistics.median(o for _, o in times) if times else 0.0
        vec = torch.tensor(
            [bw or 0.0, 1.0 if bw else 0.0, est.rtt_s or 0.0, 1.0 if est.rtt_s is not None else 0.0, compute, other],
            dtype=torch.float64,
        )
        assert vec.numel() == AGREED
        sync.comm.count(PURPOSE, vec.numel() * vec.element_size())
        work = dist.all_reduce(vec, group=sync.group, async_op=True)
        work.get_future()  # completed (and its end recorded) when it arrives, not when waited for
        self._pending = (work, vec)

    def _agree(self, vec: torch.Tensor) -> list[float]:
        """[bandwidth (0: no rank saw an exchange yet), RTT (-1: unknown), compute, other], agreed."""
        bw_sum, bw_n, rtt_sum, rtt_n, compute, other = (float(x) for x in vec)
        n = dist.get_world_size()
        last = self.agreed
        bw = _three_digits(bw_sum / bw_n) if bw_n else (last[0] if last else 0.0)  # none saw a new exchange:
        rtt = _three_digits(rtt_sum / rtt_n) if rtt_n else (last[1] if last else -1.0)  # as last agreed
        return [bw, rtt, _three_digits(compute / n), _three_digits(other / n)]

    def record(self, agreed: list[float]) -> None:
        """Take in one boundary's agreement: the link (once one was measured) and the round's step."""
        self.rounds = [*self.rounds, (agreed[2], agreed[3])][-WINDOW:]
        if agreed[0] > 0:
            self.agreed = agreed

    def decide(self) -> tuple[dict[str, Any], dict[str, Any]] | None:
        """The change to make at this boundary (knobs, reason), or None (module docstring, 2 to 4)."""
        if self.agreed is None or not self.rounds:
            return None
        bw, rtt = self.agreed[0], self.agreed[1]
        step_s, other_s = settled_step(self.rounds)
        choice, why = self.choose(bw, rtt, step_s, other_s)
        link = self.link(bw, rtt)
        order = self.spec.candidates()
        now = order.index(self.current) if self.current in order else len(order)
        settled = len(self.rounds) >= WINDOW
        under = [k for k in order[:now] if settled and self.holds(k, link, step_s, other_s)]
        before, self.under = self.under, under
        if choice == self.current:
            return None
        if self.predicted(self.current, link, step_s, other_s) > self.spec.target_pct:
            return choice, why  # toward more protection: at once
        confirmed = [k for k in under if k in before]  # going back: under the target last round too
        if not confirmed:
            return None
        back = confirmed[0]
        return back, self._why(self.predicted(back, link, step_s, other_s), bw, link, step_s, other_s)

    # ---- the choice ------------------------------------------------------------------------------
    def link(self, bandwidth_bps: float, rtt_s: float) -> Link:
        return Link(rtt_s=rtt_s if rtt_s >= 0 else wan_link(self.topology).rtt_s, bandwidth_bps=bandwidth_bps)

    def predicted(self, knobs: dict[str, Any], link: Link, step_s: float, other_s: float) -> float:
        """The planner's exposed share (%) of the strategy with `knobs` on the run's topology with `link`."""
        key = (tuple(sorted(knobs.items())), link, step_s, other_s)
        if key not in self._cache:
            if len(self._cache) >= CACHED:  # a long run's measured inputs keep changing: bounded, not grown
                self._cache.clear()
            options = {**self.options, **knobs}
            if options.get("codec") == "fp32":  # its collective is a lossy codec's choice
                options["codec_collective"] = "auto"
            s = setting(
                self.sync.name,
                options,
                self.size,
                self.workers(),
                on_link(self.topology, link),
                step_s,
                other_s=other_s,
                ranks_per_worker=self.sync.replicas.ranks_per_worker,
                inside=self.inside,
                agreement_bytes=8 * AGREED,  # its own agreement rides behind the exchange
            )
            self._cache[key] = predict(s).exposed_pct
        return self._cache[key]

    def holds(self, knobs: dict[str, Any], link: Link, step_s: float, other_s: float) -> bool:
        """Does `knobs` keep the target at a step `HYSTERESIS` faster than the settled one? What a setting
        other than the current one must do to be taken (module docstring, 3)."""
        fast = 1 - HYSTERESIS
        return self.predicted(knobs, link, step_s * fast, other_s * fast) <= self.spec.target_pct

    def workers(self) -> int:
        r = self.sync.replicas
        return r.workers if r.between_workers else self.sync.world_size

    def choose(
        self, bandwidth_bps: float, rtt_s: float, step_s: float, other_s: float
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        """The first candidate predicted under the target, else the least exposed; with the reason. One
        other than the current knobs must hold the target at a step `HYSTERESIS` faster (`holds`), so
        that a prediction at the target does not flip the knobs back and forth, nor take a setting that
        the next faster round puts over it (a second decision for one change of the link)."""
        link = self.link(bandwidth_bps, rtt_s)
        best, best_pct = None, math.inf
        order = self.spec.candidates()
        now = order.index(self.current) if self.current in order else len(order)
        for i, knobs in enumerate(order):
            pct = self.predicted(knobs, link, step_s, other_s)
            if (pct <= self.spec.target_pct) if i == now else self.holds(knobs, link, step_s, other_s):
                best, best_pct = knobs, pct
                break
            if pct < best_pct:
                best, best_pct = knobs, pct
        assert best is not None
        return best, self._why(best_pct, bandwidth_bps, link, step_s, other_s)

    def _why(self, pct: float, bandwidth_bps: float, link: Link, step_s: float, other_s: float) -> dict[str, Any]:
        return {
            "predicted_exposed_pct": round(pct, 2),
            "link_bw_bps": bandwidth_bps,
            "link_rtt_s": link.rtt_s,
            "step_s": step_s,
            "other_s": other_s,
            "within_target": pct <= self.spec.target_pct,
        }

    def apply(self, sync: Any, choice: dict[str, Any], why: dict[str, Any]) -> None:
        before = dict(self.current)
        sync.retune(**choice)
        self.current = dict(choice)
        self.decisions += 1
        reason = (
            f"predicted {why['predicted_exposed_pct']:.1f} % exposed "
            f"{'<=' if why['within_target'] else '>'} {self.spec.target_pct:g} % on "
            f"{why['link_bw_bps'] / 1e6:.3g} Mbit/s, RTT {why['link_rtt_s'] * 1e3:.3g} ms, "
            f"step {why['step_s'] * 1e3:.3g} ms"
        )
        sync.emit("adapt", before=before, after=choice, target_pct=self.spec.target_pct, reason=reason, **why)
        self.say(
            f"adapt at step {sync.t}: "
            + ", ".join(f"{k} {before[k]} -> {v}" for k, v in choice.items() if before[k] != v)
            + f" ({reason})"
        )

    # ---- resumable ---------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The knobs as they are, where the rounds count from, and what the ranks agreed (the agreement
        in flight is waited for: a resumed run decides from the same numbers)."""
        if self._pending is not None:
            work, vec = self._pending
            work.wait()
            self._pending = None
            self.record(self._agree(vec))
        return {
            "current": dict(self.current),
            "origin": self.sync.timetable.origin,
            "agreed": self.agreed,
            "rounds": [list(r) for r in self.rounds],
            "under": [dict(k) for k in self.under],
            "decisions": self.decisions,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.sync.retune(**state["current"])
        self.sync.timetable.origin = int(state["origin"])
        self.current = dict(state["current"])
        self.agreed = state["agreed"]
        # a checkpoint from before the window kept its last round only
        last = [self.agreed[2:4]] if self.agreed else []
        self.rounds = [(float(c), float(o)) for c, o in state.get("rounds", last)]
        self.under = [dict(k) for k in state.get("under", [])]
        self.decisions = int(state["decisions"])
