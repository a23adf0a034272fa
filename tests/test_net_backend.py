"""The emulating backend, on real 2-rank gloo groups over 127.0.0.1.

Each session below starts two worker processes (this file run as a script), which run one
scenario and write what they saw to JSON; the tests then state the properties. Modelled
durations are ~100 ms so that scheduler noise stays small against them.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from wansync.runner.localgroup import run_ranks as forked

WORLD = 2
D = 0.100  # modelled duration of one small all-reduce in the timing session (s)
SLACK = 0.060  # how much later than modelled a completion may be
LATE = 0.150  # how much later one rank issues in the straggler scenario


# -- harness --------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _scenario(rank: int, world: int, name: str, port: int) -> dict:
    """A rank of `forked` (forked from the forkserver, torch imported): its plain gloo group gives way
    to the scenario's own."""
    import torch.distributed as dist

    dist.destroy_process_group()
    return {"timing": _timing, "training": _training}[name](rank, world, port)


def run_ranks(scenario: str, tmp: Path, timeout: float = 90.0) -> list[dict]:
    """Run ``scenario`` on WORLD fresh interpreters (a peer that dies: `forked` would stop at it);
    return each rank's JSON. Never leaves a process behind."""
    port = _free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    procs = []
    for rank in range(WORLD):
        log = open(tmp / f"{scenario}.{rank}.log", "w")
        procs.append(
            subprocess.Popen(
                [sys.executable, __file__, scenario, str(rank), str(WORLD), str(port), str(tmp)],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
            )
        )
        log.close()
    deadline = time.monotonic() + timeout
    failed_at = None
    try:
        while any(p.poll() is None for p in procs):
            now = time.monotonic()
            if any(p.poll() not in (None, 0) for p in procs):
                failed_at = failed_at or now
                if now - failed_at > 5:  # a peer failed; the survivors get 5 s to notice
                    break
            if now > deadline:
                break
            time.sleep(0.05)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait(timeout=10)
    logs = "\n".join(
        f"--- rank {r} (exit {p.returncode}) ---\n" + (tmp / f"{scenario}.{r}.log").read_text()[-3000:]
        for r, p in enumerate(procs)
    )
    if any(p.returncode != 0 for p in procs):
        raise AssertionError(f"scenario {scenario!r} failed:\n{logs}")
    paths = [tmp / f"{scenario}.{r}.json" for r in range(WORLD)]
    return [json.loads(p.read_text()) if p.exists() else {} for p in paths]


@pytest.fixture(scope="module")
def timing(tmp_path_factory):
    return forked(_scenario, WORLD, "timing", _free_port(), timeout=90)


@pytest.fixture(scope="module")
def training(tmp_path_factory):
    return forked(_scenario, WORLD, "training", _free_port(), timeout=90)


# -- timing: the emulator's own guarantees --------------------------------------------------------


@pytest.mark.timeout(120)
def test_a_collective_completes_no_earlier_than_modelled_and_not_much_later(timing):
    for out in timing:
        s = out["single"]
        assert s["modelled"] == pytest.approx(D, abs=1e-3)
        assert s["modelled"] <= s["elapsed"]
        assert s["value"] == [3.0] * 4  # and the math is the real all-reduce's
        rec = s["record"]
        assert rec["op"] == "allreduce" and rec["nbytes"] == 16
        assert rec["end"] >= max(rec["real_end"], rec["modelled_end"])
        # not much later than the later of the real and the modelled completion: a loaded host may
        # wake the ranks apart or finish the real all-reduce late, which is not the emulator's delay
        assert rec["end"] - max(rec["real_end"], rec["modelled_end"]) < SLACK
        assert rec["waited"] == pytest.approx(s["elapsed"] - s["issued"], abs=0.02)  # the time in wait()


@pytest.mark.timeout(120)
def test_back_to_back_collectives_queue_on_the_link(timing):
    for out in timing:
        f = out["fifo"]
        first, second = f["records"]
        assert second["start"] == pytest.approx(first["modelled_end"], abs=1e-9)  # FIFO: queued behind
        assert f["first_done_when_second_done"]
        assert 2 * D <= f["elapsed"]
        assert second["end"] - first["start"] < 2 * D + SLACK


@pytest.mark.timeout(120)
def test_compute_overlapping_a_collective_hides_it(timing):
    for out in timing:
        for case in out["overlap"]:
            # the link's time runs from the transfer's start, not from the wait: the compute before the
            # wait hides it, and only what is left of it is waited (on a loaded host a late peer or a
            # late real all-reduce moves the completion; idle, this is modelled - compute)
            assert case["modelled_end"] == pytest.approx(case["start"] + case["modelled"], abs=1e-6)
            if case["compute"] > case["modelled"]:  # it began while this rank computed, not at its wait
                assert case["start"] < case["wait_from"], case
            exposed = max(0.0, max(case["modelled_end"], case["real_end"]) - case["wait_from"])
            assert case["waited"] == pytest.approx(exposed, abs=0.03), case


@pytest.mark.timeout(120)
def test_a_transfer_starts_when_its_last_member_issues_it_so_an_early_rank_waits_for_both(timing):
    early, late = (out["straggler"] for out in timing)
    (e1, e2), (l1, l2) = early["records"], late["records"]
    assert l1["issue"] > e1["issue"] + LATE / 2  # the scenario: rank 1 came late
    # one clock for both processes (one kernel): the early rank's transfer started at the late one's start
    assert e1["ready"] == l1["ready"] == l1["start"] == e1["start"]
    assert e1["modelled_end"] == l1["modelled_end"] == pytest.approx(l1["start"] + D, abs=1e-3)
    assert e2["start"] == l2["start"] == e1["modelled_end"]  # the second queues behind it on both
    assert e2["modelled_end"] == l2["modelled_end"]
    for rank in (early, late):  # both finish when the model says, together
        last = rank["records"][-1]
        assert last["modelled_end"] <= last["end"] < last["modelled_end"] + SLACK
    # the early rank was blocked for the straggler's lateness plus both transfers, not the larger of them
    assert early["elapsed"] >= (l1["start"] - e1["issue"]) + 2 * D - 1e-3
    assert late["elapsed"] < 2 * D + SLACK


@pytest.mark.timeout(120)
def test_ranks_draw_the_same_jitter(timing):
    a, b = (out["jitter"]["durations"] for out in timing)
    assert len(a) == 6 and a == b  # identical floats on both ranks
    assert len(set(a)) > 1  # and it does vary from collective to collective
    assert all(d >= D for d in a)
    assert all(r["group"] != "0" for r in timing[0]["jitter"]["records"])  # it ran on the subgroup


# -- training: emulation changes time, never math -------------------------------------------------


@pytest.mark.timeout(120)
def test_ddp_under_the_emulator_matches_plain_gloo_bitwise(training):
    digests = {out["ddp"]["emulated"] for out in training} | {out["ddp"]["plain"] for out in training}
    assert len(digests) == 1  # same bits on both ranks, emulated or not
    for out in training:
        ops = out["ddp"]["ops"]
        assert {"broadcast", "allgather", "allreduce"} <= set(ops)  # DDP really ran under it
        assert out["ddp"]["took_at_least_the_modelled_total"]  # and waited for the link


@pytest.mark.timeout(120)
def test_periodic_model_averager_averages_under_the_emulator(training):
    for out in training:
        av = out["averager"]
        assert av["averaged_as_expected"]
        assert av["off_period_step_left_params_alone"]
        assert av["ops"] == {"allreduce": 1}


@pytest.mark.timeout(120)
def test_other_collectives_compute_what_gloo_computes(training):
    for out in training:
        assert out["collectives"] == {k: True for k in out["collectives"]}, out["collectives"]
        assert set(out["collectives"]) >= {
            "broadcast",
            "all_gather",
            "all_gather_into_tensor",
            "reduce_scatter",
            "reduce_scatter_tensor",
            "barrier",
            "subgroup_all_reduce",
            "all_reduce_coalesced",
        }
        assert out["emulator"] == [True, True]  # the default group's; none on a plain gloo group


@pytest.mark.timeout(120)
def test_a_dead_peer_is_an_error_not_a_hang(tmp_path):
    survivor = run_ranks("dead_peer", tmp_path, timeout=60)[0]
    assert survivor["raised"], survivor
    assert survivor["seconds"] < 30


def _without_an_emulator(rank: int, world: int, store_path: str) -> str:
    """A rank of `run_ranks` whose plain group gives way to an emulated one made without an emulator."""
    import torch.distributed as dist

    from wansync import net
    from wansync.errors import ConfigError

    dist.destroy_process_group()
    try:
        dist.init_process_group(net.install(), store=dist.FileStore(store_path, 1), rank=0, world_size=1)
    except ConfigError as e:
        return f"ConfigError: {e}"
    return "no error"


def test_an_emulated_group_needs_an_emulator(tmp_path):
    (said,) = forked(_without_an_emulator, 1, str(tmp_path / "store"), timeout=60)
    assert said.startswith("ConfigError: the wansync_emu backend needs an emulator"), said


def _short(rank: int, world: int, port: int) -> dict:
    """Short collectives on an idle, fast link: completed by the waiting thread (`CallerWork`), or
    from the real work's callback once a caller asks for the Future (DDP's hooks)."""
    import torch
    import torch.distributed as dist

    from wansync import net
    from wansync.net.work import CallerWork

    dist.destroy_process_group()
    emulator, plain = _init(rank, world, port, net.parse_wan("rtt=0.02ms,bw=10gbit"))
    out = {}
    t = torch.full((4,), float(rank + 1))
    work = dist.all_reduce(t, async_op=True)
    out["caller"] = isinstance(work, CallerWork)
    work.wait()
    rec = work.record
    out["waited"] = {
        "sum": t.tolist(),
        "after_modelled": rec.end >= rec.modelled_end,
        "booked": rec.waited > 0,
        "done": work.is_completed() and work.is_success(),
    }
    u = torch.full((4,), float(rank + 1))
    fut = dist.all_reduce(u, async_op=True).get_future()
    out["future"] = {"sum": fut.wait()[0].tolist(), "recorded": emulator.records()[-1].end is not None}
    late = dist.all_reduce(torch.ones(2), async_op=True)
    late.wait()
    out["future_after_wait"] = late.get_future().done()
    dist.barrier(group=plain)
    return out


def test_a_short_collective_on_an_idle_link_completes_in_the_waiting_thread_no_earlier_than_modelled():
    for out in forked(_short, WORLD, _free_port(), timeout=60):
        assert out["caller"]
        assert out["waited"] == {"sum": [3.0] * 4, "after_modelled": True, "booked": True, "done": True}
        assert out["future"] == {"sum": [3.0] * 4, "recorded": True}
        assert out["future_after_wait"]


# -- worker side ----------------------------------------------------------------------------------


def _init(rank: int, world: int, port: int, topology, seed: int = 0):
    """The default group under an Emulator of ``topology``; returns (emulator, a plain gloo group)."""
    from datetime import timedelta

    import torch.distributed as dist

    from wansync import net

    emulator = net.Emulator(topology, seed=seed)
    dist.init_process_group(
        net.install(),
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=60),
        pg_options=emulator,
    )
    return emulator, dist.new_group(backend="gloo")  # a plain group, for syncing and reference results


def _timing(rank: int, world: int, port: int) -> dict:
    import torch
    import torch.distributed as dist

    from wansync import net

    flat = net.Topology(sites=1, intra_link=net.Link(rtt_s=D, bandwidth_bps=1e9))  # 2-rank ring: 1 RTT
    emulator, plain = _init(rank, world, port, flat)
    out: dict = {}

    def fresh():
        dist.barrier(group=plain)
        emulator.reset_records()

    fresh()
    t = torch.full((4,), float(rank + 1))
    t0 = time.perf_counter()
    work = dist.all_reduce(t, async_op=True)
    issued = time.perf_counter() - t0
    work.wait()
    elapsed = time.perf_counter() - t0
    (rec,) = emulator.records()
    out["single"] = {
        "elapsed": elapsed,
        "issued": issued,
        "modelled": rec.modelled_s,
        "value": t.tolist(),
        "record": rec.as_dict(),
    }

    fresh()
    t0 = time.perf_counter()
    w1 = dist.all_reduce(torch.ones(4), async_op=True)
    w2 = dist.all_reduce(torch.ones(4), async_op=True)
    w2.wait()
    out["fifo"] = {
        "elapsed": time.perf_counter() - t0,
        "first_done_when_second_done": w1.is_completed(),
        "records": [r.as_dict() for r in emulator.records()],
    }
    w1.wait()

    out["overlap"] = []
    for compute in (0.04, 0.15):
        fresh()
        w = dist.all_reduce(torch.ones(4), async_op=True)
        time.sleep(compute)
        wait_from = time.perf_counter()  # the emulator's clock (one kernel: the same in every process)
        w.wait()
        (rec,) = emulator.records()
        out["overlap"].append(
            {"compute": compute, "modelled": rec.modelled_s, "waited": rec.waited, "wait_from": wait_from}
            | {k: getattr(rec, k) for k in ("start", "modelled_end", "real_end")}
        )

    fresh()  # rank 1 issues two back-to-back collectives LATE after rank 0 does
    if rank == 1:
        time.sleep(LATE)
    t0 = time.perf_counter()
    dist.all_reduce(torch.ones(4), async_op=True)
    dist.all_reduce(torch.ones(4), async_op=True).wait()
    out["straggler"] = {"elapsed": time.perf_counter() - t0, "records": [r.as_dict() for r in emulator.records()]}

    jittery = net.Topology(sites=1, intra_link=net.Link(rtt_s=D, bandwidth_bps=1e9, jitter_s=0.03))
    sub = dist.new_group(pg_options=net.Emulator(jittery, seed=123))  # a group with its own emulator
    fresh()
    for _ in range(6):
        dist.all_reduce(torch.ones(4), group=sub)
    recs = sub.records()
    out["jitter"] = {"durations": [r.modelled_s for r in recs], "records": [r.as_dict() for r in recs]}
    return out


def _digest(params) -> str:
    import hashlib

    return hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in params)).hexdigest()


def _training(rank: int, world: int, port: int) -> dict:
    import torch
    import torch.distributed as dist
    from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
    from torch.nn.parallel import DistributedDataParallel as DDP

    from wansync import net

    emulator, plain = _init(rank, world, port, net.parse_wan("rtt=4ms,bw=1gbit"))
    out: dict = {"emulator": [net.emulator_of() is emulator, net.emulator_of(plain) is None]}

    def train(group):
        torch.manual_seed(100 + rank)  # ranks start apart: DDP's initial broadcast must fix that
        model = torch.nn.Linear(8, 3)
        ddp = DDP(model, process_group=group)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        gen = torch.Generator().manual_seed(rank)
        for _ in range(3):
            ddp(torch.randn(16, 8, generator=gen)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        return list(model.parameters())

    emulator.reset_records()
    t0 = time.perf_counter()
    emulated = train(None)  # the default group: emulated
    took = time.perf_counter() - t0
    summ = emulator.summary()
    out["ddp"] = {
        "emulated": _digest(emulated),
        "plain": _digest(train(plain)),
        "ops": {op: d["count"] for op, d in summ["per_op"].items()},
        "took_at_least_the_modelled_total": took >= summ["modelled_s"],  # the link is FIFO
    }

    torch.manual_seed(rank)
    model = torch.nn.Linear(4, 2)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()]) / world
    dist.all_reduce(flat, group=plain)  # the reference, computed as the averager does
    averager = PeriodicModelAverager(period=2, warmup_steps=0)
    emulator.reset_records()
    averager.average_parameters(model.parameters())  # step 0: averages
    averaged = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    with torch.no_grad():
        for p in model.parameters():
            p.add_(rank)
    before = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    averager.average_parameters(model.parameters())  # step 1: off period
    after = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    out["averager"] = {
        "averaged_as_expected": torch.equal(averaged, flat),
        "off_period_step_left_params_alone": torch.equal(before, after),
        "ops": {op: d["count"] for op, d in emulator.summary()["per_op"].items()},
    }

    checks: dict[str, bool] = {}
    x = torch.arange(4.0) + 10 * rank
    y = x.clone()
    dist.broadcast(y, src=1)
    checks["broadcast"] = torch.equal(y, torch.arange(4.0) + 10)
    gathered = [torch.empty(4) for _ in range(world)]
    dist.all_gather(gathered, x)
    expected = torch.cat([torch.arange(4.0) + 10 * r for r in range(world)])
    checks["all_gather"] = torch.equal(torch.cat(gathered), expected)
    into = torch.empty(4 * world)
    dist.all_gather_into_tensor(into, x)
    checks["all_gather_into_tensor"] = torch.equal(into, expected)
    big = torch.arange(4.0 * world) * (rank + 1)
    total = torch.arange(4.0 * world) * sum(r + 1 for r in range(world))
    mine = total[4 * rank : 4 * rank + 4]
    rs = torch.empty(4)
    dist.reduce_scatter(rs, list(big.chunk(world)))
    checks["reduce_scatter"] = torch.equal(rs, mine)
    rst = torch.empty(4)
    dist.reduce_scatter_tensor(rst, big.clone())
    checks["reduce_scatter_tensor"] = torch.equal(rst, mine)
    a, b = torch.ones(3) * rank, torch.ones(2) * (rank + 1)
    dist.all_reduce_coalesced([a, b])
    checks["all_reduce_coalesced"] = torch.equal(a, torch.ones(3)) and torch.equal(b, torch.ones(2) * 3)
    dist.barrier()
    checks["barrier"] = emulator.records()[-1].op == "barrier"
    sub = dist.new_group([0, 1])
    s = torch.ones(2) * (rank + 1)
    dist.all_reduce(s, group=sub)
    checks["subgroup_all_reduce"] = torch.equal(s, torch.ones(2) * 3) and net.emulator_of(sub) is emulator
    out["collectives"] = checks
    dist.barrier(group=plain)
    dist.destroy_process_group()
    return out


def _dead_peer(rank: int, world: int, port: int) -> dict:
    import torch
    import torch.distributed as dist

    from wansync import net

    _init(rank, world, port, net.parse_wan("rtt=4ms,bw=1gbit"))
    if rank == 1:
        os._exit(0)  # dies without a goodbye, like a killed worker
    t0 = time.perf_counter()
    try:
        for _ in range(50):
            dist.all_reduce(torch.ones(4), async_op=True).wait()
            time.sleep(0.05)
        raised = ""
    except RuntimeError as exc:
        raised = str(exc).splitlines()[0] or type(exc).__name__
    return {"raised": raised, "seconds": time.perf_counter() - t0}


def _exit_while_completing(rank: int, world: int, port: int) -> dict:
    """Collectives waited for, then the interpreter's own exit, while each thread that completed one is
    held 0.1 s after it released the caller (as a loaded machine may hold it): the completer thread
    (a transfer of ~8 ms) and gloo's own thread (a short one's Future, as DDP's comm hooks take it).
    Returns what c10d Works each such thread still held when it released the caller."""
    import gc
    import threading

    import torch
    import torch.distributed as dist

    from wansync import net
    from wansync.net import emulator

    held: list[str] = []
    threads: set[str] = set()

    def works_in(value, depth: int = 0) -> bool:
        if isinstance(value, dist.Work):
            return True
        inner = list(value) if isinstance(value, (list, tuple)) else list(getattr(value, "__dict__", {}).values())
        return depth < 2 and any(works_in(v, depth + 1) for v in inner)

    def linger(complete):
        def completed(fut, *args):
            if threading.current_thread() is threading.main_thread():
                return complete(fut, *args)
            threads.add("completer" if threading.current_thread().name == "wansync-link" else "gloo")
            frame = sys._getframe(1)
            while frame is not None:
                held.extend(f"{frame.f_code.co_name}: {k}" for k, v in frame.f_locals.items() if works_in(v))
                frame = frame.f_back
            complete(fut, *args)
            time.sleep(0.1)

        return completed

    Future = emulator.Future
    Future.set_result, Future.set_exception = linger(Future.set_result), linger(Future.set_exception)
    _init(rank, world, port, net.parse_wan("rtt=4ms,bw=1gbit"))
    global _SLOW_TO_COLLECT  # the interpreter's exit collects it: the held threads return while it does
    gc.disable()  # built without the collector's passes over torch's objects (2 s of a rank's CPU)
    _SLOW_TO_COLLECT = [[[i]] for i in range(2_000_000)]
    gc.enable()
    dist.all_reduce(torch.ones(1 << 18))  # modelled ~6 ms: through the completer
    lan = dist.new_group(backend=net.install(), pg_options=net.Emulator(net.parse_wan("lan"), seed=0))
    if rank == 1:  # rank 0's Future is then completed by gloo's thread, not inline where it is asked for
        time.sleep(0.3)
    dist.all_reduce(torch.ones(1), group=lan, async_op=True).get_future().wait()  # short: gloo's callback
    return {"held": held, "threads": sorted(threads)}


if __name__ == "__main__":
    scenario, rank, world, port, outdir = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
    result = {"dead_peer": _dead_peer, "exit_while_completing": _exit_while_completing}[scenario](rank, world, port)
    Path(outdir, f"{scenario}.{rank}.json").write_text(json.dumps(result))
    if scenario != "exit_while_completing":  # that one's exit is what it tests
        os._exit(0)  # skip interpreter teardown of gloo threads; the JSON is the result


def test_sleep_until_never_returns_before_its_end():
    """The emulator wakes early and yields the rest (`net.emulator.sleep_until`): a transfer may
    complete late, never before its modelled end."""
    import time

    from wansync.net.emulator import WAKE_EARLY_S, sleep_until

    for ahead in (-1e-3, 0.0, WAKE_EARLY_S / 2, WAKE_EARLY_S, 2e-3, 1e-2):
        end = time.perf_counter() + ahead
        sleep_until(end)
        assert time.perf_counter() >= end


def _threads_around_a_destroyed_group(rank: int, world: int) -> tuple[int, int, int]:
    """This process's threads before an emulated group, with it, and once it is destroyed."""
    import torch
    import torch.distributed as dist

    from wansync import net

    threads = lambda: len(os.listdir("/proc/self/task"))  # noqa: E731
    before = threads()
    group = dist.new_group(backend=net.install(), pg_options=net.Emulator(net.parse_wan("lan"), seed=0))
    dist.all_reduce(torch.ones(1000), group=group)
    during = threads()
    dist.destroy_process_group(group)  # the group object stays referenced here, as a strategy keeps it
    return before, during, threads()


def test_a_rank_exits_cleanly_while_the_thread_that_completed_its_last_collective_is_still_returning(tmp_path):
    """A thread that completed a collective, still returning when the caller reaches the interpreter's exit,
    must not touch a c10d object whose destructor takes the GIL back: during finalization that thread is
    ended by a forced unwind, which C++ turns into std::terminate (SIGABRT, "terminate called without an
    active exception": a rank of the HF Trainer's checks under torchrun, on a loaded machine)."""
    first, second = run_ranks("exit_while_completing", tmp_path, timeout=60)
    assert first == {"held": [], "threads": ["completer", "gloo"]}  # each let its Works go before the caller
    assert second["held"] == [] and "completer" in second["threads"]
    for rank in range(WORLD):
        assert "terminate called" not in (tmp_path / f"exit_while_completing.{rank}.log").read_text()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="counts threads in /proc")
def test_destroying_an_emulated_group_ends_its_gloo_threads_then_not_at_the_interpreters_exit():
    """Left to the interpreter's exit, a gloo thread that still held a tensor aborted a rank (SIGABRT)."""
    for before, during, after in forked(_threads_around_a_destroyed_group, 2):
        assert during > before and after == before, (before, during, after)
