"""Real hosts: two network namespaces (`netns.Bed`: separate TCP stacks joined by a veth pair), host
A's name resolving to 127.0.0.1 (the default of many Linux images) and host B's to its own address,
each running a torchrun agent with the command docs/multinode.md gives (read from the page; torchrun and
its workers forked from tests/forked_python.py's stand-in). Each
host writes its own run directory: no shared file system. Skipped, with the reason, where namespaces
cannot be made (not root); CI runs as root and runs them."""

from __future__ import annotations

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

WHY = netns.unavailable()
pytestmark = [pytest.mark.timeout(300), pytest.mark.skipif(WHY is not None, reason=WHY or "")]


def train_flags(corpus: Path, strategy: str, *extra: str) -> list[str]:
    every = [] if strategy == "ddp" else ["--sync-every", "3"]
    return [
        "--strategy",
        strategy,
        *every,
        "--steps",
        "8",
        "--quiet",
        "--data",
        str(corpus),
        "--eval-every",
        "100",
        *TINY,
        *extra,
    ]


def on_hosts(
    bed: netns.Bed,
    endpoint: netns.Host,
    args: dict[netns.Host, list[str]],
    env: dict[netns.Host, dict[str, str]] | None = None,
    timeout: float = 150,
    nproc: int = 1,
    python: ForkedPython | None = None,
) -> dict[netns.Host, tuple[int, str]]:
    """Run the documented torchrun command on every host of `args` (its `wansync` arguments), the
    rendezvous endpoint at `endpoint`, `nproc` processes per node; (exit status, output) per host.
    `python`: torchrun and its workers forked from it (tests/forked_python.py), not fresh interpreters."""
    procs = {
        h: bed.start(
            h,
            netns.torchrun_wansync(endpoint.address, a, nproc=nproc, python=python and python.executable),
            env=netns.host_env(python.env if python else {}, (env or {}).get(h, {})),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for h, a in args.items()
    }
    deadline = time.monotonic() + timeout
    out = {}
    for h, p in procs.items():
        try:
            text, _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            bed.close()
            raise
        out[h] = (p.returncode, text)
    return out


def final_params(run: Path, rank: int, world: int = 2) -> torch.Tensor:
    state = checkpoint.load_rank(run, rank, world)
    return torch.cat([v.reshape(-1).float() for v in state["model"].values()])


def wansync_lines(output: str) -> list[str]:
    return [line for line in output.splitlines() if line.startswith("wansync: error")]


@pytest.fixture(scope="module")
def bed():
    with netns.Bed(2, names=("loopback", "address")) as b:
        yield b


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("hosts") / "plays.txt"
    path.write_text(shakespeare_text()[:200_000])
    return path


def one_host(corpus: Path, out: Path, strategy: str) -> Path:
    """The same training on one host: the local launcher's `--workers 2`."""
    r = wansync("train", *train_flags(corpus, strategy), "--workers", "2", "--out", str(out), timeout=120)
    assert r.returncode == 0, r.stderr
    return out


def test_the_bed_gives_each_host_its_own_name_and_resolution(bed):
    a, b = bed.hosts
    r = bed.run(a, ["sh", "-c", "hostname; getent hosts hosta hostb"])
    assert r.stdout.split()[:5] == ["hosta", "127.0.0.1", "hosta", "10.77.0.2", "hostb"], r.stdout
    r = bed.run(b, ["sh", "-c", "hostname; getent hosts hostb"])
    assert r.stdout.split() == ["hostb", "10.77.0.2", "hostb"], r.stdout


def test_three_hosts_meet_on_a_bridge_and_a_shaped_line_holds_its_rate():
    listen = (
        "import socket, sys; s = socket.create_server(('', 7001)); c = s.accept()[0]; n = 0\n"
        "while (b := c.recv(1 << 16)): n += len(b)\nprint(n)"
    )
    send = (
        "import socket, time; time.sleep(0.3); c = socket.create_connection(('{addr}', 7001)); "
        "c.sendall(bytes(2_000_000)); c.close()"
    )
    with netns.Bed(3, rate="100mbit") as three:
        a, _, c = three.hosts
        server = three.start(c, [sys.executable, "-c", listen], stdout=subprocess.PIPE, text=True)
        t0 = time.monotonic()
        r = three.run(a, [sys.executable, "-c", send.format(addr=c.address)])
        assert r.returncode == 0, r.stderr
        assert server.communicate(timeout=30)[0].strip() == "2000000"
        assert time.monotonic() - t0 >= 0.3 + 2e6 * 8 / 100e6 * 0.8  # 160 ms of payload at 100 Mbit/s


def test_diloco_stopped_on_both_hosts_resumes_on_each_without_a_shared_directory_bit_for_bit(
    bed, corpus, tmp_path, forked_python
):
    """Both hosts start with the endpoint on host A, whose name resolves to 127.0.0.1: plain c10d hosts
    no store there and advertises `localhost`, gloo binds loopback; the documented command just works
    (it trains to the checkpoint of step 4). Rank 1 dies after that checkpoint; rank 0 loses it and both
    torchrun agents end. Each host resumes from its own directory, now with the endpoint on host B named
    by its address: its own ranks' files and config.toml; rank 0 deleted nothing it could not see. The
    result is the one-host run's, bit for bit (every strategy meets across hosts through the same groups)."""
    a, b = bed.hosts
    runs = {h: tmp_path / h.name for h in bed.hosts}
    flags = {
        h: ["train", *train_flags(corpus, "diloco", "--checkpoint-every", "2"), "--out", str(runs[h])]
        for h in bed.hosts
    }
    killed = on_hosts(bed, a, flags, env={b: {"WANSYNC_FAULT": "rank=1,step=5,action=kill"}}, python=forked_python)
    assert all(code != 0 for code, _ in killed.values()), killed
    assert f"rendezvous {a.address}:" in killed[a][1]
    assert (runs[a] / "checkpoints" / "step00000004" / "rank0.pt").is_file()
    assert not (runs[a] / "checkpoints" / "step00000004" / "rank1.pt").exists()
    assert (runs[b] / "config.toml").is_file() and not (runs[b] / "summary.json").exists()
    resumed = on_hosts(bed, b, {h: ["train", "--resume", str(runs[h])] for h in bed.hosts}, python=forked_python)
    for code, output in resumed.values():
        assert code == 0, output[-3000:]
    ref = one_host(corpus, tmp_path / "one", "diloco")
    assert torch.equal(final_params(runs[a], 0), final_params(ref, 0))
    assert torch.equal(final_params(runs[b], 1), final_params(ref, 1))


def test_nodes_started_with_different_flags_refuse_in_one_line_naming_the_keys(bed, corpus, tmp_path, forked_python):
    a, b = bed.hosts
    t0 = time.monotonic()
    results = on_hosts(
        bed,
        a,
        {
            a: ["train", *train_flags(corpus, "diloco"), "--out", str(tmp_path / "a")],
            b: [
                "train",
                *train_flags(corpus, "local_sgd", "--model", "tiny", "--lr", "0.002"),
                "--sync-every",
                "4",
                "--out",
                str(tmp_path / "b"),
            ],
        },
        python=forked_python,
    )
    for code, output in results.values():
        assert code != 0
        lines = wansync_lines(output)
        assert len(lines) == 1 and "different training flags" in lines[0], output[-3000:]
        assert all(key in lines[0] for key in ("lr", "model", "strategy", "sync_every")), lines[0]
    assert time.monotonic() - t0 < 60  # at start-up, not after a timeout
    assert not (tmp_path / "a" / "checkpoints").exists()
