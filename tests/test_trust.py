"""The run secret, admission, the gate and where listeners bind (`wansync.trust`), on loopback.

The multi-host cases (a stranger's namespace, the tunnel, the listeners of a secure run) are
tests/test_secure_bed.py's."""

from __future__ import annotations

import os
import socket
import threading
import time

import pytest

from cli_harness import wansync
from wansync.errors import ConfigError
from wansync.trust import admission, listen, secret, settings
from wansync.trust.admission import AdmissionRefused, admit, enter
from wansync.trust.gate import Connector, Gate
from wansync.trust.secret import Secret


def secret_file(tmp_path, value: bytes = b"s" * 40, mode: int = 0o600, name: str = "run.secret"):
    path = tmp_path / name
    path.write_bytes(value)
    path.chmod(mode)
    return path


# ---- the secret ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "value,mode,says",
    [
        (None, 0o600, "cannot read the run secret"),
        (b"", 0o600, "is empty"),
        (b"x" * 31, 0o600, "31 bytes, fewer than 32"),
        (b"x" * 40, 0o644, "readable by other users"),
        (b"x" * 40, 0o640, "readable by other users"),
    ],
)
def test_a_bad_secret_file_is_one_line(tmp_path, value, mode, says):
    path = tmp_path / "missing" if value is None else secret_file(tmp_path, value, mode)
    with pytest.raises(ConfigError, match=says) as e:
        secret.load(path)
    assert "\n" not in str(e.value) and "x" * 31 not in str(e.value)


def test_a_directory_is_no_secret_and_a_link_to_a_good_file_is_read(tmp_path):
    with pytest.raises(ConfigError, match="regular file"):
        secret.load(tmp_path)
    target = secret_file(tmp_path)
    (tmp_path / "link").symlink_to(target)
    assert secret.load(tmp_path / "link").value == b"s" * 40


def test_each_use_has_its_own_key_and_the_fingerprint_hides_the_secret(tmp_path):
    s = secret.load(secret_file(tmp_path))
    assert s.key("admission/heal") != s.key("admission/rendezvous")
    assert "s" * 10 not in repr(s) and len(s.fingerprint()) == 12


@pytest.mark.parametrize("flag", [["--secret", "abc"], ["--secret=abc"], ["--run-secret", "x"]])
def test_a_secret_on_the_command_line_is_refused_before_anything(flag):
    r = wansync("train", *flag, timeout=60)
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert "visible to every user" in r.stderr and "--secret-file" in r.stderr


@pytest.mark.parametrize(
    "flags,says",
    [
        (["--secret-file", "/nonexistent/run.secret"], "cannot read the run secret"),
        (["--bind", "203.0.113.9"], "this host has no such address"),
        (["--bind", "nosuchif0"], "neither an address nor an interface"),
        (["--bind", "0.0.0.0"], "wildcard"),
        (["--ports", "80-90"], "1024 <= LOW"),
        (["--ports", "abc"], "LOW-HIGH"),
        (
            ["--ports", "41000-41001", "--fault-tolerant", "--workers", "2", "--strategy", "diloco"],
            "holds 2 port(s); this host's listeners need 7",
        ),
    ],
)
def test_bad_trust_flags_are_one_line_and_nothing_starts(tmp_path, flags, says):
    out = tmp_path / "run"
    r = wansync("train", "--model", "tiny", "--steps", "2", "--out", str(out), *flags, timeout=60)
    assert r.returncode != 0 and says in r.stderr, r.stderr
    assert r.stderr.strip().count("\n") == 0, r.stderr
    assert not out.exists()


def test_a_world_readable_secret_is_refused_by_the_cli(tmp_path):
    path = secret_file(tmp_path, mode=0o604)
    r = wansync("train", "--model", "tiny", "--steps", "2", "--secret-file", str(path), "--out", str(tmp_path / "r"))
    assert r.returncode != 0 and "readable by other users" in r.stderr and r.stderr.count("\n") == 1


def test_a_flag_that_contradicts_the_environment_is_refused(tmp_path, monkeypatch):
    a, b = secret_file(tmp_path, name="a"), secret_file(tmp_path, name="b")
    monkeypatch.setenv(secret.ENV, str(a))
    with pytest.raises(ConfigError, match="contradicts"):
        settings.settle(str(b))


# ---- admission ----------------------------------------------------------------------------------
def pair():
    server = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(server.getsockname())
    conn, _ = server.accept()
    server.close()
    return conn, client


def run_server(conn, s, use="heal"):
    box = {}
    t = threading.Thread(target=lambda: box.update(reason=admit(conn, s, use)))
    t.start()
    return t, box


def test_a_holder_of_the_secret_is_admitted_both_ways():
    s = Secret("x", b"k" * 32)
    conn, client = pair()
    t, box = run_server(conn, s)
    enter(client, s, "heal", "here")
    t.join()
    assert box["reason"] is None
    client.sendall(b"after")
    assert conn.recv(5) == b"after"


def test_a_wrong_secret_is_refused_with_one_line_naming_the_address():
    conn, client = pair()
    t, box = run_server(conn, Secret("x", b"k" * 32))
    with pytest.raises(AdmissionRefused) as e:
        enter(client, Secret("y", b"w" * 32), "heal", "here")
    t.join()
    assert "does not hold this run's secret" in box["reason"]
    assert f"127.0.0.1:{client.getsockname()[1]}" in str(e.value) and "\n" not in str(e.value)


def test_an_answer_for_one_use_is_worth_nothing_at_another():
    s = Secret("x", b"k" * 32)
    conn, client = pair()
    t, box = run_server(conn, s, use="rendezvous")
    with pytest.raises(AdmissionRefused):
        enter(client, s, "heal", "here")
    t.join()
    assert box["reason"] is not None


def test_a_replayed_answer_is_refused():
    """A recorded client message (the answer to one challenge) sent again at the next connection."""
    s = Secret("x", b"k" * 32)
    conn, client = pair()
    t, _ = run_server(conn, s)
    recorded = {}
    real_send = client.sendall

    class Recording:
        def __getattr__(self, name):
            return getattr(client, name)

        def sendall(self, data):
            recorded["answer"] = data
            real_send(data)

    enter(Recording(), s, "heal", "here")  # type: ignore[arg-type]
    t.join()
    conn2, client2 = pair()
    t2, box2 = run_server(conn2, s)
    client2.recv(len(admission.MAGIC) + admission.NONCE)
    client2.sendall(recorded["answer"])
    t2.join()
    assert "replayed" in box2["reason"]
    assert client2.recv(200).startswith(b"Rwansync: heal refused")


def test_a_listener_that_does_not_hold_the_secret_is_refused_by_the_client():
    """A host posing as a peer: it sends a challenge and accepts anything, then cannot prove itself."""
    conn, client = pair()

    def impostor():
        conn.sendall(admission.MAGIC + os.urandom(admission.NONCE))
        conn.recv(200)
        conn.sendall(b"A" + os.urandom(admission.TAG))

    threading.Thread(target=impostor).start()
    with pytest.raises(AdmissionRefused, match="does not hold this run's secret"):
        enter(client, Secret("x", b"k" * 32), "heal", "impostor:1")


def test_a_stranger_speaking_another_protocol_or_nothing_is_refused(monkeypatch):
    monkeypatch.setattr(admission, "HANDSHAKE_S", 0.5)
    s = Secret("x", b"k" * 32)
    conn, client = pair()
    t, box = run_server(conn, s)
    client.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + b"x" * 80)
    t.join()
    assert "not a wansync peer" in box["reason"]
    conn, client = pair()
    t0 = time.monotonic()
    t, box = run_server(conn, s)
    t.join(timeout=5)
    assert box["reason"].startswith("no answer within") and time.monotonic() - t0 < 3


# ---- the gate and its local end ------------------------------------------------------------------
@pytest.fixture
def echo():
    server = socket.create_server(("127.0.0.1", 0))

    def serve():
        while True:
            try:
                c, _ = server.accept()
            except OSError:
                return
            threading.Thread(
                target=lambda c=c: [c.sendall(d) for d in iter(lambda: c.recv(4096), b"")] and c.close()
            ).start()

    threading.Thread(target=serve, daemon=True).start()
    yield server.getsockname()
    server.close()


def test_a_gate_splices_an_admitted_client_and_refuses_a_stranger(echo, capfd):
    s = Secret("x", b"k" * 32)
    gate = Gate(socket.create_server(("127.0.0.1", 0)), echo, s, "lighthouse")
    end = Connector(gate.address, s, "lighthouse")
    with socket.create_connection(end.address) as c:
        c.sendall(b"x" * 100_000)
        got = b""
        while len(got) < 100_000:
            got += c.recv(65536)
        assert got == b"x" * 100_000
    with socket.create_connection(gate.address) as stranger:
        stranger.sendall(b"\x00" * 100)
        said = b""
        while not said.endswith(b"\n"):
            said += stranger.recv(300)
        assert said[len(admission.MAGIC) + admission.NONCE :].startswith(b"Rwansync: lighthouse refused 127.0.0.1:")
    with pytest.raises(AdmissionRefused):
        Connector(gate.address, Secret("y", b"w" * 32), "lighthouse").check()
    time.sleep(0.2)
    refused = [line for line in capfd.readouterr().err.splitlines() if "refused a connection" in line]
    assert len(refused) == 1 and gate.log.count == 2  # the second within a second is counted, not logged
    end.close()
    gate.close()


# ---- where listeners bind ------------------------------------------------------------------------
def test_bind_takes_an_interface_or_an_address_of_this_host():
    assert listen.resolve_bind("lo") == ("127.0.0.1", "lo")
    assert listen.resolve_bind("127.0.0.1") == ("127.0.0.1", "lo")
    for bad in ("0.0.0.0", "::", "203.0.113.9", "nosuchif0"):
        with pytest.raises(ConfigError):
            listen.resolve_bind(bad)


def test_every_listener_takes_a_port_of_the_range_and_says_when_it_is_full():
    taken = socket.create_server(("127.0.0.1", 0))
    low = taken.getsockname()[1]
    where = listen.Listen("127.0.0.1", "lo", (low, low))
    with pytest.raises(ConfigError, match=f"every port of --ports {low}-{low}"):
        where.socket("heal server")
    taken.close()
    sock = where.socket("heal server")
    assert sock.getsockname() == ("127.0.0.1", low)
    sock.close()


def test_the_range_holds_what_a_hosts_listeners_need():
    trust = settings.Trust(None, listen.Listen(ports=(41000, 41005)))
    settings.check_range(trust, settings.listeners_needed(1, True, True, True))  # 5 of 6
    with pytest.raises(ConfigError, match="holds 6 port"):
        settings.check_range(trust, settings.listeners_needed(2, True, True, True))


# ---- the agreement's records are sealed ------------------------------------------------------------
def test_an_agreement_record_that_fails_its_tag_is_refused_before_it_is_read(tmp_path, monkeypatch):
    """Rank 1's record in the store written by someone without the run secret (or altered on the
    way): rank 0 refuses it in one line, whatever it says."""
    import datetime
    import json

    import torch.distributed as dist

    from wansync.runner.agreement import agree
    from wansync.runner.torchrun import TorchrunEnv
    from wansync.trust.sealed import SealError, key_for, seal

    monkeypatch.setenv(secret.ENV, str(secret_file(tmp_path)))
    server = dist.TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=30), wait_for_workers=False)
    config = {"strategy": "diloco"}
    forged = {"config": config, "start": 0, "machine": "x", "refused": None}
    prefix = dist.PrefixStore("wansync/run/0/1", server)  # round 1 of run "run", attempt 0: rank 1's keys
    server.add("wansync/run/0/0/rounds/rank1", 1)
    prefix.set("agree/rank1", seal(json.loads(json.dumps(forged)), key_for(None, "agreement")))
    env = TorchrunEnv(0, 2, "127.0.0.1", server.port, 0, 1, "run", 0, agent_store=True)
    with pytest.raises(SealError, match="rank 1's agreement: refused") as e:
        agree(env, config, 0, 5)
    assert "\n" not in str(e.value)
