"""A run across the public internet, on the namespace bed (docs/security.md): three hosts joined by
WireGuard tunnels over the shaped underlay, a fourth that is a tunnel peer without the run secret.

A fault-tolerant diloco run with a secret, bound to the tunnel and its ports in one range, trains bit for
bit what the same run trains on one host without a secret, while a stranger tries every admission port
(a pickle whose __reduce__ would make a canary file, an admission answer replayed), a node with another
secret tries to join, and a host connects to a tunnel-bound port at its underlay address: each is
refused in one line, the canary never appears, and no host listens on a wildcard or underlay address,
every port in the range but gloo's pairs'. A killed worker heals through the sealed transport, its first
payload corrupted on the way and refused. Skipped, with the reason, where no WireGuard bed can be made.
torchrun and its workers are forks of tests/forked_python.py's stand-in, not fresh interpreters."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import netns
from cli_harness import TINY, wansync
from forked_python import ForkedPython
from wansync.rundir import checkpoint
from wansync.workloads.lm.corpus import shakespeare_text

WHY = netns.unavailable(wireguard=True)
pytestmark = [pytest.mark.timeout(400), pytest.mark.skipif(WHY is not None, reason=WHY or "")]

PORTS = (29400, 29440)
ROOT = Path(__file__).resolve().parents[1]


# a stranger on the tunnel: for every listening port of `host` in the range, does it challenge
# (admission) and how does it answer a wrong secret's answer
def train_flags(corpus: Path) -> list[str]:
    return [
        "train", "--strategy", "diloco", "--sync-every", "3", "--steps", "9", "--quiet", "--data", str(corpus),
        "--eval-every", "100", "--fault-tolerant", "--peer-timeout", "20", *TINY,
    ]  # fmt: skip


@pytest.fixture(scope="module")
def bed():
    with netns.Bed(4, rate="1gbit", wireguard=True) as b:
        yield b


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("secure") / "plays.txt"
    path.write_text(shakespeare_text()[:200_000])
    return path


@pytest.fixture(scope="module")
def secret(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("secret") / "run.secret"
    path.write_bytes(os.urandom(48).hex().encode())
    path.chmod(0o600)
    return path


def start(bed, hosts, endpoint: str, flags, outs, env=None, python: ForkedPython | None = None) -> dict:
    """The documented torchrun command on each of `hosts`; `python`: torchrun and its workers forked
    from it (tests/forked_python.py), not fresh interpreters."""
    return {
        h: bed.start(
            h,
            netns.torchrun_wansync(
                endpoint, [*flags, "--out", str(outs[h])], nnodes=len(hosts), python=python and python.executable
            ),
            env=netns.host_env(python.env if python else {}, (env or {}).get(h, {})),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for h in hosts
    }


def finish(procs: dict, timeout: float = 200) -> dict:
    deadline, out = time.monotonic() + timeout, {}
    for h, p in procs.items():
        text, _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
        out[h] = (p.returncode, text)
    return out


def listeners(bed, host) -> set[tuple[str, int]]:
    r = bed.run(host, ["ss", "-ltnH"])
    found = set()
    for line in r.stdout.splitlines():
        local = line.split()[3]
        addr, _, port = local.rpartition(":")
        found.add((addr.strip("[]").split("%")[0], int(port)))
    return found


def in_range(host, found) -> set[int]:
    return {p for addr, p in found if addr == host.tunnel_address and PORTS[0] <= p <= PORTS[1]}


def final(run: Path, rank: int) -> torch.Tensor:
    state = checkpoint.load_rank(run, rank, 3, step_dir=run / "checkpoints" / "step00000009")
    return torch.cat([v.reshape(-1).float() for v in state["model"].values()])


def secure_env(bed, secret: Path) -> dict:
    """The settings on every host; host A's rank 0 holds the run 5 s at step 4 (the others wait at the
    quorum): every listener stays up while the stranger probes them (it changes no value)."""
    env = {
        h: {"WANSYNC_SECRET_FILE": str(secret), "WANSYNC_BIND": h.tunnel_ifname, "WANSYNC_PORTS": "%d-%d" % PORTS}
        for h in bed.hosts
    }
    env[bed.hosts[0]]["WANSYNC_FAULT"] = "rank=0,step=4,action=pause,seconds=5"
    return env


# a stranger's tries at every admission port of `host` (those that challenge): a recorded answer
# replayed (it holds the secret for the first connection only, as an eavesdropper's recording), and a
# pickle whose __reduce__ would create `canary`; each is refused in one line
TRIES = """
import hashlib, hmac, json, os, pickle, socket, sys
sys.path.insert(0, {src!r})
from wansync.trust.admission import MAGIC, NONCE, TAG
from wansync.trust.secret import load
host, ports, secret_path, canary = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3], sys.argv[4]

class Canary:
    def __reduce__(self):
        return (open, (canary, "w"))

def said(s):
    out = b""
    while not out.endswith(b"\\n"):
        c = s.recv(300)
        if not c: break
        out += c
    return out.decode(errors="replace")[1:].strip()

out = {{}}
for port in ports:
    try:
        s = socket.create_connection((host, port), timeout=2)
    except OSError:
        continue
    try:
        hello = s.recv(len(MAGIC) + NONCE)
    except OSError:  # a listener that says nothing first: not an admission port
        s.close(); continue
    if not hello.startswith(MAGIC):
        s.close(); continue
    s.settimeout(10)
    s.sendall(pickle.dumps(Canary()).ljust(len(MAGIC) + NONCE + TAG, b"."))
    result = {{"pickle": said(s)}}
    s.close()
    if port == {rdzv}:  # the rendezvous: a real answer recorded, then replayed at the next connection
        key = load(secret_path).key("admission/rendezvous")
        s = socket.create_connection((host, port), timeout=5)
        ns = s.recv(len(MAGIC) + NONCE)[len(MAGIC):]
        nc = os.urandom(NONCE)
        answer = MAGIC + nc + hmac.new(key, b"client" + ns + nc, hashlib.sha256).digest()
        s.sendall(answer)
        result["first"] = s.recv(1).decode()
        s.close()
        s = socket.create_connection((host, port), timeout=5)
        s.recv(len(MAGIC) + NONCE)
        s.sendall(answer)
        result["replayed"] = said(s)
        s.close()
    out[port] = result
print(json.dumps(out))
"""


def test_a_secure_run_through_the_tunnel_trains_what_one_host_trains_whatever_a_stranger_tries(
    bed, corpus, secret, tmp_path, forked_python
):
    hosts, stranger = bed.hosts[:3], bed.hosts[3]
    a, b, _ = hosts
    flags = train_flags(corpus)
    one = tmp_path / "one"  # the same run on one host, no secret: the local launcher's three workers
    r = wansync(*flags, "--workers", "3", "--out", str(one), timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]

    secure = {h: tmp_path / h.name for h in hosts}
    procs = start(bed, hosts, a.tunnel_address, flags, secure, env=secure_env(bed, secret), python=forked_python)
    seen: dict = {h: set() for h in hosts}
    deadline = time.monotonic() + 60
    # once every listener of the range is up: each host's manager store, manager and heal server,
    # and on host A the rendezvous and the lighthouse
    while not all(len(in_range(h, seen[h])) >= (5 if h is a else 3) for h in hosts):
        assert time.monotonic() < deadline and all(p.poll() is None for p in procs.values()), seen
        for h in hosts:
            seen[h] |= listeners(bed, h)
        time.sleep(0.2)
    canary, other = tmp_path / "canary", tmp_path / "other.secret"
    other.write_bytes(os.urandom(48).hex().encode())
    other.chmod(0o600)
    code = TRIES.format(src=str(ROOT / "src"), rdzv=29400)
    tries = {
        h: bed.start(
            stranger,
            [sys.executable, "-c", code, h.tunnel_address, str(sorted(in_range(h, seen[h]))), str(secret), str(canary)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for h in hosts
    }
    intruder_env = {stranger: {**secure_env(bed, secret)[stranger], "WANSYNC_SECRET_FILE": str(other)}}
    intruder = start(
        bed, [stranger], a.tunnel_address, flags, {stranger: tmp_path / "intruder"}, intruder_env, forked_python
    )
    around = bed.run(b, [sys.executable, "-c", f"import socket; socket.create_connection(('{a.address}', 29400), 3)"])
    for h in hosts:
        seen[h] |= listeners(bed, h)
    tried = {h: p.communicate(timeout=60)[0] for h, p in tries.items()}
    intruded, _ = intruder[stranger].communicate(timeout=90)
    results = finish(procs)
    for code_, text in results.values():
        assert code_ == 0, text[-3000:]

    # bit for bit the one-host run's, whatever the stranger tried
    for rank, h in enumerate(hosts):
        assert torch.equal(final(secure[h], rank), final(one, rank)), h.name
    # no wildcard, no underlay: the tunnel and loopback only; on the tunnel every port is the range's
    # (5 on the rendezvous host, 3 on the others) but gloo's pairs', in the kernel's ephemeral range
    # (docs/security.md#ports: the documented exception)
    low, high = (int(x) for x in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    for h in hosts:
        bad = [(addr, p) for addr, p in seen[h] if addr not in (h.tunnel_address, "127.0.0.1", "::1")]
        assert bad == [], (h.name, sorted(seen[h]))
        outside = sorted(p for addr, p in seen[h] if addr == h.tunnel_address and not PORTS[0] <= p <= PORTS[1])
        assert all(low <= p <= high for p in outside), (h.name, outside)
        assert len(in_range(h, seen[h])) == (5 if h is a else 3), (h.name, sorted(seen[h]))
    # every admission port refused the pickle in one line naming the stranger; the canary never appeared
    assert not canary.exists()
    answers = {h: json.loads(tried[h].strip().splitlines()[-1]) for h in hosts}
    assert [len(answers[h]) for h in hosts] == [3, 1, 1], tried  # rendezvous, lighthouse; a heal server each
    for by_port in answers.values():
        for result in by_port.values():
            assert (
                result["pickle"].startswith("wansync: ") and f"refused {stranger.tunnel_address}:" in result["pickle"]
            )
    rdzv = answers[a]["29400"]
    assert rdzv["first"] == "A" and "replayed an old answer" in rdzv["replayed"], rdzv
    for h in hosts:  # each listener logged one line per refusal: the agent's output, or its worker's log
        logged = results[h][1] + "".join(f.read_text() for f in (secure[h] / "logs").glob("rank*.log"))
        assert logged.count(f"refused a connection from {stranger.tunnel_address}") >= len(answers[h]), h.name
    # the node with another secret: one line, nothing joined, no traceback
    assert intruder[stranger].returncode != 0
    lines = [line for line in intruded.splitlines() if line.startswith("wansync")]
    assert len(lines) == 1 and "does not hold this run's secret" in lines[0], intruded[-2000:]
    assert "Traceback" not in intruded and not (tmp_path / "intruder").exists(), intruded[-2000:]
    # nothing answers at the underlay address
    assert around.returncode != 0 and "Connection refused" in around.stderr, around.stderr


def test_a_killed_worker_heals_through_a_transfer_corrupted_on_the_way(bed, corpus, secret, tmp_path, forked_python):
    """Rank 1 is killed at step 5 and restarted; the first payload of every live source goes out with a
    byte flipped (`flip_heal`): it is refused by its tag, said in one line, and asked again; the run
    ends well, healed."""
    hosts = bed.hosts[:3]
    a, b, c = hosts
    runs = {h: tmp_path / h.name for h in hosts}
    env = secure_env(bed, secret)
    env[a]["WANSYNC_FAULT"] = "rank=0,step=1,action=flip_heal"
    env[b]["WANSYNC_FAULT"] = "rank=1,step=5,action=kill"
    env[c]["WANSYNC_FAULT"] = "rank=2,step=1,action=flip_heal"
    flags = [*train_flags(corpus), "--max-restarts", "1"]
    results = finish(start(bed, hosts, a.tunnel_address, flags, runs, env, forked_python))
    for code, text in results.values():
        assert code == 0, text[-3000:]
    summary = json.loads((runs[a] / "summary.json").read_text())
    assert summary["heals"] >= 1 and summary["worker_failures"] >= 1, summary
    logs = "".join(f.read_text() for f in (runs[b] / "logs").glob("*.log"))
    assert "refused" in logs and "asking again" in logs, logs[-3000:]
