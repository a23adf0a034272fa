"""How closely the emulator's measured all-reduce times follow its model, per preset and payload.

Two local ranks (gloo over 127.0.0.1) all-reduce float32 tensors under each preset; for each
(preset, payload) we time issue -> ``wait()`` return on rank 0 and compare it to the modelled
duration. The emulator can only add time: when the real collective on this machine is slower than
the model (``real`` column: the wrapped gloo collective's own time, from the emulator's record), the
measurement follows the machine, not the model.
Target: |measured/modelled - 1| <= 5 % wherever modelled >= 20 ms and real < modelled.

Then a straggler: rank 1 issues a 1 MB all-reduce ``--late-ms`` after rank 0 does. On a real link no
byte crosses before the last rank is ready, so rank 0 is blocked for the lateness plus the transfer;
the table compares its measured wait with (rank 1's issue - rank 0's issue) + modelled, both issue
times read on the one clock the two local processes share.

    python benchmarks/emulator_fidelity.py [--presets lan,two-site] [--sizes 1KB,64KB,1MB,16MB,64MB] [--late-ms 50]
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import socket
import statistics
import sys
import time

import torch
import torch.multiprocessing as mp

SIZES = {"1KB": 1 << 10, "64KB": 64 << 10, "1MB": 1 << 20, "16MB": 16 << 20, "64MB": 64 << 20}
PRESET_NAMES = ["lan", "two-site", "cross-region", "cross-continent"]
BUDGET_S = 4.0  # modelled seconds per (preset, payload) cell; sets the repetitions (1..5)


def _worker(rank: int, port: int, presets: list[str], sizes: list[str], late_s: float, queue) -> None:
    from datetime import timedelta

    import torch.distributed as dist

    from wansync import net

    torch.set_num_threads(1)
    dist.init_process_group(
        net.install(),
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=2,
        timeout=timedelta(seconds=120),
        pg_options=net.Emulator(net.parse_wan("lan")),
    )
    plain = dist.new_group(backend="gloo")
    rows = []
    for preset in presets:
        topo = net.parse_wan(preset)
        group = dist.new_group(pg_options=net.Emulator(topo))  # emulated with this preset
        for size in sizes:
            nbytes = SIZES[size]
            t = torch.ones(nbytes // 4)
            modelled = net.collective_duration("allreduce", nbytes, 2, topo)
            reps = max(1, min(5, int(BUDGET_S / max(modelled, 1e-3))))
            dist.all_reduce(t, group=plain)  # warm the real path
            real, measured = [], []
            for _ in range(reps):
                dist.barrier(group=plain)  # keep the two ranks' issue times close
                t0 = time.perf_counter()
                work = dist.all_reduce(t, group=group, async_op=True)
                work.wait()
                measured.append(time.perf_counter() - t0)
                real.append(work.record.real_end - work.record.issue)  # the wrapped gloo's own time
            rows.append((preset, size, nbytes, reps, modelled, statistics.median(measured), statistics.median(real)))
    late_rows = []
    for preset in presets:  # rank 1 late by late_s: rank 0 waits for it and then for the transfer
        topo = net.parse_wan(preset)
        group = dist.new_group(pg_options=net.Emulator(topo))
        t = torch.ones(SIZES["1MB"] // 4)
        modelled = net.collective_duration("allreduce", SIZES["1MB"], 2, topo)
        waits, expected = [], []
        for _ in range(3):
            dist.barrier(group=plain)
            if rank == 1:
                time.sleep(late_s)
            issue = time.perf_counter()
            dist.all_reduce(t, group=group, async_op=True).wait()
            waited = time.perf_counter() - issue
            issues = torch.zeros(2, dtype=torch.float64)
            issues[rank] = issue
            dist.all_reduce(issues, group=plain)  # perf_counter is one clock for processes of one kernel
            waits.append(waited)
            expected.append(float(issues[1] - issues[0]) + modelled)
        late_rows.append((preset, modelled, statistics.median(expected), statistics.median(waits)))
    if rank == 0:
        queue.put((rows, late_rows))
    dist.barrier(group=plain)
    dist.destroy_process_group()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--presets", default=",".join(PRESET_NAMES))
    ap.add_argument("--sizes", default=",".join(SIZES))
    ap.add_argument("--late-ms", type=float, default=50.0, help="how late rank 1 issues in the straggler rows")
    args = ap.parse_args()
    presets, sizes = args.presets.split(","), args.sizes.split(",")

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    procs = [ctx.Process(target=_worker, args=(r, port, presets, sizes, args.late_ms / 1e3, queue)) for r in range(2)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + 600
    try:
        while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
            if any(p.exitcode not in (None, 0) for p in procs):
                break
            time.sleep(0.1)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()
    if any(p.exitcode != 0 for p in procs) or queue.empty():
        print("benchmark failed: exit codes", [p.exitcode for p in procs], file=sys.stderr)
        return 1
    rows, late_rows = queue.get()

    print("# emulator fidelity: 2 ranks, gloo on 127.0.0.1, all-reduce of float32 tensors, median of reps")
    print(f"# command: python {' '.join(sys.argv)}")
    print(
        f"# date: {datetime.datetime.now().isoformat(timespec='seconds')}  machine: {platform.node()} "
        f"{platform.machine()} {os.cpu_count()} CPUs, Python {platform.python_version()}, torch {torch.__version__}"
    )
    print(
        f"{'preset':<16} {'bytes':>9} {'reps':>4} {'modelled ms':>12} {'measured ms':>12} {'ratio':>7} "
        f"{'real ms':>9}  note"
    )
    for preset, size, nbytes, reps, modelled, measured, real in rows:
        ratio = measured / modelled if modelled > 0 else float("nan")
        if real >= modelled:
            note = "real > modelled"
        elif modelled >= 0.020:
            note = "ok" if abs(ratio - 1) <= 0.05 else "MISS (>5%)"
        else:
            note = "d < 20 ms"
        print(
            f"{preset:<16} {size:>9} {reps:>4} {modelled * 1e3:12.2f} {measured * 1e3:12.2f} {ratio:7.3f} "
            f"{real * 1e3:9.2f}  {note}"
        )
    print(
        f"\n# a straggler: rank 1 issues a 1 MB all-reduce {args.late_ms:g} ms after rank 0 (median of 3); "
        "expected = lateness + modelled"
    )
    print(f"{'preset':<16} {'modelled ms':>12} {'expected ms':>12} {'rank 0 waited ms':>17} {'ratio':>7}")
    for preset, modelled, expected, waited in late_rows:
        print(
            f"{preset:<16} {modelled * 1e3:12.2f} {expected * 1e3:12.2f} {waited * 1e3:17.2f} "
            f"{waited / expected:7.3f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
