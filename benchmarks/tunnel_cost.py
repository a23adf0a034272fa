"""What a WireGuard tunnel costs on the bed's links: two hosts of the namespace bed (a veth pair shaped
with `tbf` to a rate) with a WireGuard tunnel over it (`netns.Bed(wireguard=True)`: user-space
wireguard-go, MTU 1420), the same transfers over the plain link and through the tunnel, side by side.

For each rate: the throughput of a bulk TCP transfer (a Python sender and receiver, one connection,
3 s of line time, 30 to 100 MB; the payload rate after its first 20 %, past slow start), plain and
tunnel interleaved (the order alternating per repetition), and the round trip of a 1-byte TCP
ping-pong (`Bed.rtt`, the median of 50), plain and tunnel. Also the CPU the two wireguard-go
processes used during the tunnel's transfers and what the sender and receiver used (in cores: CPU
seconds per second of the transfer; of each process's own, so a neighbour's jobs do not count): a
tunnel short of the line with the cores taken by these is CPU-bound, not link-bound. WireGuard's own counters
(`Bed.tunnel_transfer`) confirm each tunnel transfer went through it. The header bound: a full frame
carries 1448 bytes of TCP payload in 1514 on the plain link, 1368 in 1494 in the tunnel (inner MTU
1420, MSS 1368 with timestamps; 60 bytes of outer IPv4, UDP and WireGuard header and tag), a ratio of
0.957 where only the line limits both.

Needs root. Run it with nothing else on the machine. Prints a markdown table (cells: the median over
the repetitions, with half their range) and the command that reproduces it; `--json` a dict instead.

    sudo .venv/bin/python benchmarks/tunnel_cost.py [--rates 100mbit,1gbit] [--reps 3] [--json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
import netns  # noqa: E402 - the test suite's bed, not a second copy

PORT = 5003
SECONDS = 3.0  # each transfer's line time
HEADER_BOUND = (1368 / 1494) / (1448 / 1514)  # TCP payload per byte of a full frame, tunnel against plain

# receives one connection until EOF; prints payload bits/s after its first 20% (slow start, the bucket's burst)
RECEIVER = """
import socket, sys, time
with socket.create_server(("", int(sys.argv[1]))) as srv:
    print("listening", flush=True)
    conn, _ = srv.accept()
    buf, marks, n = bytearray(1 << 20), [], 0
    while k := conn.recv_into(buf):
        n += k
        marks.append((time.perf_counter(), n))
    t1, n1 = next(m for m in marks if m[1] >= n / 5)
    t2, n2 = marks[-1]
    print((n2 - n1) * 8 / (t2 - t1), n)
"""

SENDER = """
import socket, sys
conn = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=60)
chunk, left = bytes(1 << 20), int(sys.argv[3])
while left > 0:
    conn.sendall(chunk[: min(left, len(chunk))])
    left -= len(chunk)
conn.shutdown(socket.SHUT_WR)
conn.recv(1)                   # the receiver's close: all of it arrived
"""


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of `pid` (/proc/<pid>/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def children_seconds() -> float:
    """User + system CPU seconds of the children this process has reaped (the sender and receiver,
    once done): their own, whatever a neighbour on the machine runs."""
    used = resource.getrusage(resource.RUSAGE_CHILDREN)
    return used.ru_utime + used.ru_stime


def transfer(bed: netns.Bed, tunnel: bool, nbytes: int) -> dict:
    """`nbytes` from host a to host b, plain or through the tunnel: payload bits/s, CPU used meanwhile."""
    a, b = bed.hosts
    receiver = bed.start(
        b, [sys.executable, "-c", RECEIVER, str(PORT)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    assert receiver.stdout.readline() == "listening\n", receiver.stderr.read()
    wg0 = [cpu_seconds(p.pid) for p in bed.wg_procs]
    counted0 = bed.tunnel_transfer(a)[b.name][1]
    used0 = children_seconds()
    t0 = time.perf_counter()
    to = b.tunnel_address if tunnel else b.address
    sender = bed.run(a, [sys.executable, "-c", SENDER, to, str(PORT), str(nbytes)], timeout=300)
    out, err = receiver.communicate(timeout=60)
    wall = time.perf_counter() - t0
    used = children_seconds() - used0
    if sender.returncode != 0 or receiver.returncode != 0:
        raise RuntimeError(f"transfer failed: {sender.stderr.strip()} {err.strip()}")
    bps, received = out.split()
    through = bed.tunnel_transfer(a)[b.name][1] - counted0
    if int(received) != nbytes or (through > nbytes) != tunnel:
        raise RuntimeError(f"{received} B of {nbytes} received, {through} B through the tunnel (tunnel={tunnel})")
    return {
        "mbps": float(bps) / 1e6,
        "wg_cores": (sum(cpu_seconds(p.pid) for p in bed.wg_procs) - sum(wg0)) / wall,
        "ends_cores": used / wall,
        "wall_s": wall,
    }


def measure(rate: str, reps: int) -> dict:
    """`reps` rounds of plain and tunnel transfers and round trips at `rate`, the order alternating."""
    nbytes = int(min(100e6, max(30e6, netns._bits(rate) / 8 * SECONDS)))
    runs: dict[str, list[dict]] = {"plain": [], "tunnel": []}
    with netns.Bed(2, rate=rate, wireguard=True) as bed:
        bed.rtt(0, 1, tunnel=True)  # the first handshake, outside the figures
        for rep in range(reps):
            for kind in ("plain", "tunnel") if rep % 2 == 0 else ("tunnel", "plain"):
                run = transfer(bed, kind == "tunnel", nbytes)
                run["rtt_us"] = bed.rtt(0, 1, tunnel=kind == "tunnel") * 1e6
                runs[kind].append(run)
    ratios = [t["mbps"] / p["mbps"] for p, t in zip(runs["plain"], runs["tunnel"])]
    return {"rate": rate, "bytes": nbytes, "runs": runs, "ratio": ratios}


def cell(values: list[float], digits: int = 1) -> str:
    """The median, with half the range."""
    return f"{statistics.median(values):.{digits}f} (±{(max(values) - min(values)) / 2:.{digits}f})"


def table(results: list[dict]) -> str:
    rows = [
        "| line rate | bytes | plain Mbit/s | tunnel Mbit/s | tunnel/plain | RTT plain µs | RTT tunnel µs "
        "| wireguard-go cores (tunnel) | sender + receiver cores: plain / tunnel |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        p, t = r["runs"]["plain"], r["runs"]["tunnel"]
        rows.append(
            f"| {r['rate']} | {r['bytes'] / 1e6:.0f} MB | {cell([x['mbps'] for x in p])} "
            f"| {cell([x['mbps'] for x in t])} | {cell(r['ratio'], 3)} | {cell([x['rtt_us'] for x in p], 0)} "
            f"| {cell([x['rtt_us'] for x in t], 0)} | {cell([x['wg_cores'] for x in t], 2)} "
            f"| {statistics.median(x['ends_cores'] for x in p):.2f} / {statistics.median(x['ends_cores'] for x in t):.2f} |"
        )
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rates", default="100mbit,1gbit", help="tbf rates, tc's syntax, comma-separated")
    ap.add_argument("--reps", type=int, default=3, help="plain/tunnel pairs per rate, interleaved")
    ap.add_argument("--json", action="store_true", help="print a machine-readable dict instead of the table")
    args = ap.parse_args()
    why = netns.unavailable(wireguard=True)
    if why:
        sys.exit(f"tunnel_cost: {why}")
    command = f"sudo .venv/bin/python benchmarks/tunnel_cost.py --rates {args.rates} --reps {args.reps}"
    load = os.getloadavg()[0]
    started = datetime.datetime.now().isoformat(timespec="minutes")
    results = [measure(rate, args.reps) for rate in args.rates.split(",")]
    meta = {
        "command": command,
        "started": started,
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
        "load_average": [load, os.getloadavg()[0]],
        "wireguard_go": subprocess.run(["wireguard-go", "--version"], capture_output=True, text=True).stdout.split()[1],
        "header_bound": HEADER_BOUND,
    }
    if args.json:
        print(json.dumps({**meta, "results": results}, indent=1))
        return
    print(
        f"tunnel_cost  {started}  {meta['machine']}  wireguard-go {meta['wireguard_go']}  load {load:.2f} → {meta['load_average'][1]:.2f}"
    )
    print(f"  {command}\n")
    print(table(results))
    print(f"\nheader bound of tunnel/plain (TCP payload 1368 in 1494 against 1448 in 1514): {HEADER_BOUND:.3f}")


if __name__ == "__main__":
    main()
