"""The heal transport: a fetch waits for its source to serve the step (a race on a loaded machine), the
state comes sealed from a server bound to the worker's address behind admission, and nothing a peer
sends is unpickled or even parsed before its tag matches."""

from __future__ import annotations

import hashlib
import hmac
import os
import pickle
import socket
import threading
import time
from datetime import timedelta

import pytest
import torch

pytest.importorskip("torchft")

from wansync.errors import PeerError  # noqa: E402
from wansync.ft import transport  # noqa: E402
from wansync.ft.transport import Again, HealTransport, fetch  # noqa: E402
from wansync.trust import admission, listen, sealed, secret  # noqa: E402
from wansync.trust.admission import AdmissionRefused, admit  # noqa: E402
from wansync.trust.listen import Listen  # noqa: E402
from wansync.trust.secret import ENV, Secret  # noqa: E402
from wansync.trust.settings import Trust  # noqa: E402

TIMEOUT = timedelta(seconds=20)
SHORT = timedelta(seconds=1)
STATE = {
    "model": {"w": torch.arange(6.0).reshape(2, 3), "b": torch.randn(4).bfloat16()},
    "optimizer": {"state": {0: {"step": torch.tensor(3.0)}}, "param_groups": [{"lr": 0.1, "betas": (0.9, 0.99)}]},
    "step": 80,
}
PLAIN = Trust(None, Listen())


@pytest.fixture(autouse=True)
def no_trust_settings(monkeypatch):
    for name in (ENV, listen.BIND_ENV, listen.PORTS_ENV):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def pair():
    """A source and a receiver without a run secret; both shut down after the test."""
    made = [HealTransport(TIMEOUT, "127.0.0.1", PLAIN), HealTransport(TIMEOUT, "127.0.0.1", PLAIN)]
    yield made
    for t in made:
        t.shutdown(wait=False)


def secret_file(tmp_path, value: bytes, name: str = "run.secret"):
    path = tmp_path / name
    path.write_bytes(value)
    path.chmod(0o600)
    return path


def serve_later(source, step: int, after_s: float) -> threading.Thread:
    t = threading.Thread(target=lambda: (time.sleep(after_s), source.send_checkpoint([1], step, STATE, TIMEOUT)))
    t.start()
    return t


def same_state(got, want=STATE) -> bool:
    return (
        got["step"] == want["step"]
        and torch.equal(got["model"]["w"], want["model"]["w"])
        and got["model"]["b"].dtype == torch.bfloat16
        and torch.equal(got["model"]["b"].view(torch.int16), want["model"]["b"].view(torch.int16))
        and got["optimizer"]["param_groups"] == want["optimizer"]["param_groups"]
        and list(got["optimizer"]["state"]) == [0]
    )


# ---- the race: a fetch before the source serves the step ----------------------------------------
def test_a_fetch_before_the_source_serves_that_step_is_answered_no(pair):
    source, _ = pair
    with pytest.raises(Again, match="not serving step 80: no state staged"):
        fetch(source.metadata(), 80, None, sealed.PUBLIC_KEY, time.monotonic() + 5)
    source.send_checkpoint([1], 75, STATE, TIMEOUT)  # still serving its previous heal
    with pytest.raises(Again, match="not serving step 80: serving 75"):
        fetch(source.metadata(), 80, None, sealed.PUBLIC_KEY, time.monotonic() + 5)


def test_ours_waits_until_the_source_serves_the_step_and_gets_its_state(pair):
    source, receiver = pair
    source.send_checkpoint([1], 75, STATE, TIMEOUT)
    later = serve_later(source, 80, after_s=0.5)
    got = receiver.recv_checkpoint(0, source.metadata(), 80, TIMEOUT)
    later.join()
    assert same_state(got)


def test_ours_gives_up_at_the_timeout_when_the_source_never_serves_it(pair):
    source, receiver = pair
    source.send_checkpoint([1], 75, STATE, TIMEOUT)
    t0 = time.monotonic()
    with pytest.raises(PeerError, match="failed within 1 s: the source answered: not serving step 80: serving 75") as e:
        receiver.recv_checkpoint(0, source.metadata(), 80, SHORT)
    assert time.monotonic() - t0 < 15 and "\n" not in str(e.value)  # bounded by the timeout, one line


def test_after_disallow_nothing_is_served(pair):
    source, receiver = pair
    source.send_checkpoint([1], 80, STATE, TIMEOUT)
    source.disallow_checkpoint()
    with pytest.raises(PeerError, match="no state staged"):
        receiver.recv_checkpoint(0, source.metadata(), 80, SHORT)


# ---- where the server listens -------------------------------------------------------------------
def test_the_server_binds_the_advertised_address_not_a_wildcard():
    for host, bound in (("127.0.0.1", "127.0.0.1"), ("localhost", None), ("::1", "::1")):
        t = HealTransport(TIMEOUT, host, PLAIN)
        try:
            address = t._listener.getsockname()[0]
            assert address not in listen.WILDCARDS and (bound is None or address == bound)
            assert t.metadata() == (f"[{address}]" if ":" in address else address) + f":{t._listener.getsockname()[1]}"
        finally:
            t.shutdown()


def test_an_ipv6_source_is_reached_at_its_bracketed_address():
    source, receiver = HealTransport(TIMEOUT, "::1", PLAIN), HealTransport(TIMEOUT, "127.0.0.1", PLAIN)
    try:
        source.send_checkpoint([1], 80, STATE, TIMEOUT)
        assert source.metadata().startswith("[::1]:")
        assert same_state(receiver.recv_checkpoint(0, source.metadata(), 80, TIMEOUT))
    finally:
        source.shutdown()
        receiver.shutdown()


def test_with_ports_the_server_takes_its_port_from_the_range(monkeypatch):
    monkeypatch.setenv(listen.PORTS_ENV, "47100-47199")
    t = HealTransport(TIMEOUT, "127.0.0.1")
    try:
        assert 47100 <= t._listener.getsockname()[1] <= 47199
    finally:
        t.shutdown()


# ---- with a run secret --------------------------------------------------------------------------
@pytest.fixture
def secured(tmp_path, monkeypatch):
    """A source and a receiver holding the run secret (WANSYNC_SECRET_FILE), the source serving STATE."""
    monkeypatch.setenv(ENV, str(secret_file(tmp_path, b"r" * 40)))
    source, receiver = HealTransport(TIMEOUT, "127.0.0.1"), HealTransport(TIMEOUT, "127.0.0.1")
    source.send_checkpoint([1], 80, STATE, TIMEOUT)
    yield source, receiver
    source.shutdown(wait=False)
    receiver.shutdown(wait=False)


def test_with_a_secret_a_heal_fetch_works(secured):
    source, receiver = secured
    assert secret.from_env() is not None
    assert same_state(receiver.recv_checkpoint(0, source.metadata(), 80, TIMEOUT))


def test_a_client_without_the_secret_or_with_another_is_refused_and_the_rightful_one_is_served(secured, tmp_path):
    source, receiver = secured
    with pytest.raises(PeerError, match="admits only holders of the run secret") as none:
        fetch(source.metadata(), 80, None, sealed.PUBLIC_KEY, time.monotonic() + 5)
    wrong = Secret("wrong", b"w" * 40)
    with pytest.raises(AdmissionRefused, match="heal refused 127.0.0.1") as other:
        fetch(source.metadata(), 80, wrong, sealed.key_for(wrong, "heal"), time.monotonic() + 5)
    assert "\n" not in str(none.value) and "\n" not in str(other.value)
    assert same_state(receiver.recv_checkpoint(0, source.metadata(), 80, TIMEOUT))


def test_a_replayed_admission_answer_is_refused(secured):
    source, receiver = secured
    host, port = transport.parse_address(source.metadata())
    key = secret.from_env().key("admission/heal")
    hello = len(admission.MAGIC) + admission.NONCE
    with socket.create_connection((host, port), timeout=5) as first:
        ns = admission._read(first, hello)[len(admission.MAGIC) :]
        nc = os.urandom(admission.NONCE)
        answer = admission.MAGIC + nc + hmac.new(key, b"client" + ns + nc, hashlib.sha256).digest()
        first.sendall(answer)
        assert admission._read(first, 1) == b"A"  # the recorded answer was a good one
    with socket.create_connection((host, port), timeout=5) as replay:
        admission._read(replay, hello)  # a fresh challenge
        replay.sendall(answer)
        verdict = replay.recv(1000)
    assert verdict.startswith(b"R") and b"does not hold this run's secret" in verdict
    assert same_state(receiver.recv_checkpoint(0, source.metadata(), 80, TIMEOUT))


# ---- a payload that fails its tag --------------------------------------------------------------
class FlipProxy:
    """A man in the middle: forwards every connection to `target`, flipping one byte of what the
    server sends at offset `at` of its stream."""

    def __init__(self, target: tuple[str, int], at: int):
        self.target, self.at, self.connections = target, at, 0
        self.sock = socket.create_server(("127.0.0.1", 0))
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.sock.getsockname()[1]}"

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            server = socket.create_connection(self.target)
            threading.Thread(target=self._pump, args=(client, server, None), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, self.at), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket, flip_at: int | None) -> None:
        seen = 0
        try:
            while data := src.recv(1 << 16):
                if flip_at is not None and seen <= flip_at < seen + len(data):
                    data = bytearray(data)
                    data[flip_at - seen] ^= 0x01
                seen += len(data)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self.sock.close()


def test_a_payload_with_one_byte_flipped_is_refused_before_parsing_retried_then_given_up(secured, monkeypatch):
    source, receiver = secured
    parsed = []
    monkeypatch.setattr(sealed, "_parse", lambda *a: parsed.append(a))
    handshake = len(admission.MAGIC) + admission.NONCE + 1 + admission.TAG  # the server's side of admission
    proxy = FlipProxy(transport.parse_address(source.metadata()), at=handshake + len(b"ok\n") + 30)  # its header
    try:
        with pytest.raises(PeerError, match="failed within 1 s: .* refused: its tag does not match") as e:
            receiver.recv_checkpoint(0, proxy.address, 80, SHORT)
    finally:
        proxy.close()
    assert parsed == [] and proxy.connections > 1 and "\n" not in str(e.value)


# ---- a rogue server that sends a pickle ---------------------------------------------------------
class Canary:
    """Unpickled, it creates the file at `path`."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def rogue_server(run_secret: Secret, payload: bytes) -> socket.socket:
    """A server holding the run secret (it passes admission) that answers every request with `payload`."""
    listener = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            with conn:
                if admit(conn, run_secret, "heal") is None:
                    conn.recv(256)
                    conn.sendall(b"ok\n" + payload)

    threading.Thread(target=serve, daemon=True).start()
    return listener


@pytest.mark.parametrize("frame", ["a bare pickle", "a pickle sealed under the public key"])
def test_a_rogue_servers_pickle_never_runs(secured, tmp_path, frame):
    _, receiver = secured
    canary = tmp_path / "canary"
    evil = pickle.dumps(Canary(str(canary)))
    payload = evil if frame == "a bare pickle" else sealed.seal({"step": 80, "state": {"x": evil}}, sealed.PUBLIC_KEY)
    rogue = rogue_server(secret.from_env(), payload)
    try:
        with pytest.raises(PeerError) as e:
            receiver.recv_checkpoint(0, f"127.0.0.1:{rogue.getsockname()[1]}", 80, SHORT)
    finally:
        rogue.close()
    assert not canary.exists() and "\n" not in str(e.value) and "refused" in str(e.value)
