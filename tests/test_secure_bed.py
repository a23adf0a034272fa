"""A run across the public internet, on the namespace bed (docs/security.md): three hosts joined by
WireGuard tunnels over the shaped underlay, a fourth that is a tunnel peer without the run secret.

A fault-tolerant diloco run with a secret, bound to the tunnel and its ports in one range, ends bit for
bit as the same run on the plain bed without a secret; while it trains no host listens on a wildcard or
underlay address and every wansync port is in the range; the stranger is refused at the rendezvous, the
lighthouse and every heal port (one line each, naming its address), a replayed admission answer too,
nothing reaches a tunnel-bound port from the underlay, and the run goes on unaffected. Skipped, with the
reason, where no WireGuard bed can be made."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

import netns
from cli_harness import TINY
from wansync.rundir import checkpoint
from wansync.workloads.lm.corpus import shakespeare_text

WHY = netns.unavailable(wireguard=True)
pytestmark = [pytest.mark.timeout(400), pytest.mark.skipif(WHY is not None, reason=WHY or "")]

TORCHRUN = Path(sys.executable).parent / "torchrun"
NOT_INHERITED = ("GLOO_", "MASTER_", "RANK", "WORLD_SIZE", "LOCAL_", "TORCHELASTIC_", "WANSYNC_", "OMP_", "NCCL_")
PORTS = (29400, 29440)
ROOT = Path(__file__).resolve().parents[1]

# a stranger on the tunnel: for every listening port of `host` in the range, does it challenge
# (admission) and how does it answer a wrong secret's answer
PROBE = """
import json, os, socket, sys
sys.path.insert(0, {src!r})
from wansync.trust.admission import MAGIC, NONCE, TAG
host, ports = sys.argv[1], json.loads(sys.argv[2])
out = {{}}
for port in ports:
    try:
        s = socket.create_connection((host, port), timeout=3)
    except OSError as e:
        out[port] = "refused: " + str(e); continue
    s.settimeout(2)
    try:
        hello = s.recv(len(MAGIC) + NONCE)
    except OSError:
        out[port] = "silent"; s.close(); continue
    if not hello.startswith(MAGIC):
        out[port] = "other"; s.close(); continue
    s.sendall(MAGIC + os.urandom(NONCE + TAG))
    said = b""
    while not said.endswith(b"\\n"):
        c = s.recv(200)
        if not c: break
        said += c
    out[port] = said.decode(errors="replace")[1:].strip()
    s.close()
print(json.dumps(out))
"""


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


def start(bed, hosts, endpoint: str, flags, outs, env=None) -> dict:
    options = netns.documented_torchrun(endpoint)
    options[options.index("--nnodes") + 1] = str(len(hosts))
    base = {k: v for k, v in os.environ.items() if not k.startswith(NOT_INHERITED)}
    return {
        h: bed.start(
            h,
            [str(TORCHRUN), *options, "-m", "wansync", *flags, "--out", str(outs[h])],
            env=dict(base, **(env or {}).get(h, {})),
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
    """The settings on every host; host A's rank 0 holds the run 8 s at step 4 (the others wait at the
    quorum): every listener stays up while the stranger probes them (it changes no value)."""
    env = {
        h: {"WANSYNC_SECRET_FILE": str(secret), "WANSYNC_BIND": h.tunnel_ifname, "WANSYNC_PORTS": "%d-%d" % PORTS}
        for h in bed.hosts
    }
    env[bed.hosts[0]]["WANSYNC_FAULT"] = "rank=0,step=4,action=pause,seconds=8"
    return env


def test_a_secure_run_through_the_tunnel_trains_what_the_plain_run_trains_and_refuses_a_stranger(
    bed, corpus, secret, tmp_path
):
    hosts, stranger = bed.hosts[:3], bed.hosts[3]
    a = hosts[0]
    plain = {h: tmp_path / "plain" / h.name for h in hosts}
    secure = {h: tmp_path / "secure" / h.name for h in hosts}
    flags = train_flags(corpus)
    results = finish(start(bed, hosts, a.address, flags, plain))
    for code, text in results.values():
        assert code == 0, text[-3000:]

    procs = start(bed, hosts, a.tunnel_address, flags, secure, env=secure_env(bed, secret))
    seen: dict = {h: set() for h in hosts}
    probes: dict = {}
    stop = threading.Event()

    def watch():
        while not stop.is_set():
            for h in hosts:
                seen[h] |= listeners(bed, h)
            # once every worker's heal server is up (3 admission ports besides the rendezvous and lighthouse)
            # once every listener of the range is up: each host's manager store, manager and heal server,
            # and on host A the rendezvous and the lighthouse
            if not probes and all(len(in_range(h, seen[h])) >= (5 if h is a else 3) for h in hosts):
                code = PROBE.format(src=str(ROOT / "src"))
                running = {
                    h: bed.start(
                        stranger,
                        [sys.executable, "-c", code, h.tunnel_address, str(sorted(in_range(h, seen[h])))],
                        stdout=subprocess.PIPE,
                        stderr=subprocess.STDOUT,
                        text=True,
                    )
                    for h in hosts
                }
                for h, p in running.items():
                    probes[h] = p.communicate(timeout=60)[0].strip().splitlines()[-1]
            time.sleep(0.3)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        results = finish(procs)
    finally:
        stop.set()
        watcher.join()
    for code, text in results.values():
        assert code == 0, text[-3000:]

    # bit for bit the plain run's
    for rank, h in enumerate(hosts):
        assert torch.equal(final(secure[h], rank), final(plain[h], rank)), h.name

    # no wildcard, no underlay: the tunnel (ports in the range, or gloo's pairs) and loopback only
    for h in hosts:
        bad = [(addr, p) for addr, p in seen[h] if addr not in (h.tunnel_address, "127.0.0.1", "::1")]
        assert bad == [], (h.name, sorted(seen[h]))
    # on the tunnel, every port is the range's but gloo's pairs', which take the kernel's ephemeral
    # ports (docs/security.md#ports: the documented exception)
    low, high = (int(x) for x in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    for h in hosts:
        outside = sorted(p for addr, p in seen[h] if addr == h.tunnel_address and not PORTS[0] <= p <= PORTS[1])
        assert all(low <= p <= high for p in outside), (h.name, outside)
        assert len(in_range(h, seen[h])) == (5 if h is a else 3), (h.name, sorted(seen[h]))
    # the stranger: every admission port refused it in one line naming its address
    assert probes, "the run ended before its listeners could be probed"
    import json

    challenged = {
        h: {p: said for p, said in json.loads(probes[h]).items() if said.startswith("wansync:")} for h in hosts
    }
    for h in hosts:
        for said in challenged[h].values():
            assert f"refused {stranger.tunnel_address}:" in said, said
    assert "29400" in challenged[a]  # the rendezvous (docs/multinode.md's endpoint port)
    assert [len(challenged[h]) for h in hosts] == [3, 1, 1], probes  # rendezvous, lighthouse; a heal server each
    for h in hosts:  # and each listener logged one line: the agent's output, or its worker's log
        logged = results[h][1] + "".join(f.read_text() for f in (secure[h] / "logs").glob("rank*.log"))
        assert logged.count(f"refused a connection from {stranger.tunnel_address}") == len(challenged[h]), h.name


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


def test_a_secure_run_heals_through_a_corrupted_transfer_and_is_unaffected_by_what_a_stranger_tries(
    bed, corpus, secret, tmp_path
):
    """Rank 1 is killed at step 7 and restarted; its heal's first payload goes out with a byte flipped
    (every live source), is refused before parsing and asked again. Meanwhile a node with another
    secret tries to join (refused in one line, nothing joined), the stranger replays an answer and sends
    a pickle to every admission port, and a host connects to a tunnel-bound port at the underlay
    address: the run ends well, healed, and the canary never appears."""
    hosts, stranger = bed.hosts[:3], bed.hosts[3]
    a, b, c = hosts
    runs = {h: tmp_path / h.name for h in hosts}
    env = secure_env(bed, secret)
    env[a]["WANSYNC_FAULT"] += ";rank=0,step=1,action=flip_heal"
    env[b]["WANSYNC_FAULT"] = "rank=1,step=7,action=kill"  # after host A's pause, while the stranger tries
    env[c]["WANSYNC_FAULT"] = "rank=2,step=1,action=flip_heal"
    flags = [*train_flags(corpus), "--max-restarts", "1"]
    procs = start(bed, hosts, a.tunnel_address, flags, runs, env=env)
    canary = tmp_path / "canary"
    other = tmp_path / "other.secret"
    other.write_bytes(os.urandom(48).hex().encode())
    other.chmod(0o600)
    seen: dict = {h: set() for h in hosts}
    deadline = time.monotonic() + 60
    while not all(len(in_range(h, seen[h])) >= (5 if h is a else 3) for h in hosts):
        assert time.monotonic() < deadline, seen
        for h in hosts:
            seen[h] |= listeners(bed, h)
        time.sleep(0.3)
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
    intruder = start(
        bed,
        [stranger],
        a.tunnel_address,
        flags,
        {stranger: tmp_path / "intruder"},
        env={stranger: {**secure_env(bed, other)[stranger], "WANSYNC_SECRET_FILE": str(other)}},
    )[stranger]
    around = bed.run(
        b, [sys.executable, "-c", f"import socket; socket.create_connection(('{a.address}', 29400), timeout=3)"]
    )
    tried = {h: p.communicate(timeout=60)[0] for h, p in tries.items()}
    intruded, _ = intruder.communicate(timeout=90)
    results = finish(procs)

    for code_, text in results.values():
        assert code_ == 0, text[-3000:]
    assert not canary.exists()
    import json

    answers = {h: json.loads(tried[h].strip().splitlines()[-1]) for h in hosts}
    assert sorted(len(v) for v in answers.values()) == [1, 1, 3], tried  # rendezvous, lighthouse, heal servers
    for h, by_port in answers.items():
        for result in by_port.values():
            assert (
                result["pickle"].startswith("wansync: ") and f"refused {stranger.tunnel_address}:" in result["pickle"]
            )
    rdzv = answers[a]["29400"]
    assert rdzv["first"] == "A" and "replayed an old answer" in rdzv["replayed"], rdzv
    # the node with another secret: one line, nothing joined
    assert intruder.returncode != 0
    lines = [line for line in intruded.splitlines() if line.startswith("wansync")]
    assert len(lines) == 1 and "does not hold this run's secret" in lines[0], intruded[-2000:]
    assert "Traceback" not in intruded, intruded[-2000:]
    assert not (tmp_path / "intruder").exists()
    # nothing listens on the underlay
    assert around.returncode != 0 and "Connection refused" in around.stderr, around.stderr
    # rank 1 came back and healed, through a refused (flipped) payload first
    summary = json.loads((runs[a] / "summary.json").read_text())
    assert summary["heals"] >= 1 and summary["worker_failures"] >= 1, summary
    logs = "".join(f.read_text() for f in (runs[b] / "logs").glob("*.log"))
    assert "refused" in logs and "asking again" in logs, logs[-3000:]
