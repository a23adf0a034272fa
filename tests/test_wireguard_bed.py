"""The bed's WireGuard mode (`netns.Bed(..., wireguard=True)`): three hosts each running user-space
wireguard-go, every pair exchanges over the tunnel addresses and WireGuard's own counters show it,
host names resolve to the tunnel, a service bound to the tunnel is not reachable around it at the bed
address, `close` leaves no namespace, wireguard-go, socket or key behind, and the tunnel's packets
cross the shaped link (a transfer through it at 10mbit takes at least its line time). Skipped, with the
reason, where no WireGuard bed can be made (not root, no wireguard-go or wg, no /dev/net/tun)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

import netns

WHY = netns.unavailable(wireguard=True)
pytestmark = [pytest.mark.timeout(60), pytest.mark.skipif(WHY is not None, reason=WHY or "")]

PORT = 5002  # the bed's namespaces have ports of their own

# serves one connection on (address, port) until EOF, answering with the byte count; bound to one address
SERVER = """
import socket, sys
with socket.create_server((sys.argv[1], int(sys.argv[2]))) as srv:
    print("listening", flush=True)
    conn, _ = srv.accept()
    buf, n = bytearray(1 << 20), 0
    while k := conn.recv_into(buf):
        n += k
    conn.sendall(str(n).encode())
"""

# sends argv[3] bytes to (argv[1], argv[2]); prints the seconds until the server's count came back
CLIENT = """
import socket, sys, time
t0 = time.perf_counter()
conn = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=float(sys.argv[4]))
conn.sendall(bytes(int(sys.argv[3])))
conn.shutdown(socket.SHUT_WR)
assert conn.recv(64) == sys.argv[3].encode()
print(time.perf_counter() - t0)
"""


def serve(bed: netns.Bed, host: netns.Host, address: str) -> subprocess.Popen:
    """SERVER in `host` on `address`, once it listens."""
    proc = bed.start(
        host, [sys.executable, "-c", SERVER, address, str(PORT)], stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    assert proc.stdout.readline() == b"listening\n", proc.stderr.read()
    return proc


def send(
    bed: netns.Bed, host: netns.Host, address: str, nbytes: int, timeout: float = 5
) -> subprocess.CompletedProcess:
    return bed.run(host, [sys.executable, "-c", CLIENT, address, str(PORT), str(nbytes), str(timeout)], timeout=30)


@pytest.fixture(scope="module")
def bed():
    with netns.Bed(3, rate="100mbit", wireguard=True) as bed:
        yield bed


def test_every_pair_exchanges_over_the_tunnel_and_its_counters_grow(bed):
    for i, j in [(0, 1), (1, 2), (2, 0)]:
        a, b = bed.hosts[i], bed.hosts[j]
        before_a, before_b = bed.tunnel_transfer(a)[b.name], bed.tunnel_transfer(b)[a.name]
        server = serve(bed, b, b.tunnel_address)
        sent = send(bed, a, b.tunnel_address, 100_000)
        server.wait(timeout=10)
        assert sent.returncode == 0, sent.stderr
        after_a, after_b = bed.tunnel_transfer(a)[b.name], bed.tunnel_transfer(b)[a.name]
        assert after_a[1] - before_a[1] > 100_000  # a sent it into the tunnel, to b's peer entry
        assert after_b[0] - before_b[0] > 100_000  # b received it from a's
        assert bed.handshakes(a)[b.name] > 0 and bed.handshakes(b)[a.name] > 0
    assert 0 < bed.rtt(0, 2, tunnel=True) < 0.05  # the ping-pong of every other bed test, through the tunnel


def test_host_names_resolve_to_the_tunnel_and_name_underlay_for_the_bed_address(bed):
    a, b = bed.hosts[:2]
    look = "import socket; print(*(socket.gethostbyname(n) for n in ('hosta', 'hostb', 'hostb-underlay')))"
    out = bed.run(a, [sys.executable, "-c", look])
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [a.tunnel_address, b.tunnel_address, b.address]
    assert a.tunnel_ifname.startswith("wg") and a.tunnel_address.startswith(netns.TUNNEL_SUBNET)


def test_a_service_on_the_tunnel_address_is_not_reachable_at_the_bed_address(bed):
    a, b = bed.hosts[:2]
    server = serve(bed, b, b.tunnel_address)
    around = send(bed, a, b.address, 1000, timeout=2)
    assert around.returncode != 0
    assert "ConnectionRefused" in around.stderr or "timed out" in around.stderr, around.stderr
    through = send(bed, a, b.tunnel_address, 1000)  # the same server, the way it is meant
    server.wait(timeout=10)
    assert through.returncode == 0, through.stderr


def test_close_leaves_no_namespace_wireguard_go_socket_or_key():
    bed = netns.Bed(2, wireguard=True)
    pids = [p.pid for p in bed.wg_procs]
    names = [h.ns for h in bed.hosts]
    sockets = [netns.WG_SOCKETS / f"{h.tunnel_ifname}.sock" for h in bed.hosts]
    assert len(pids) == 2 and all(Path(f"/proc/{pid}").exists() for pid in pids)
    assert all(s.exists() for s in sockets) and bed.keys.is_dir()
    assert bed.keys.stat().st_mode & 0o077 == 0 and all(
        (bed.keys / f"{h.name}.key").stat().st_mode & 0o077 == 0 for h in bed.hosts
    )
    bed.close()
    assert all(p.returncode is not None for p in bed.wg_procs)
    assert not [pid for pid in pids if Path(f"/proc/{pid}").exists()]
    listed = netns.ip("netns", "list").stdout
    assert not [ns for ns in names if ns in listed]
    assert not [s for s in sockets if s.exists()] and not bed.keys.exists()


def running(pid: int) -> bool:
    """Whether `pid` runs (a zombie its dead parent left to init does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


# a bed whose owner is killed: it prints its wireguard-go pids, then waits to die
ORPHAN = """
import sys, time
sys.path.insert(0, sys.argv[1])
import netns
bed = netns.Bed(2, wireguard=True)
print(*(p.pid for p in bed.wg_procs), *(h.ns for h in bed.hosts), *(h.tunnel_ifname for h in bed.hosts), bed.keys, flush=True)
time.sleep(60)
"""


def test_the_next_bed_cleans_up_the_tunnel_of_a_bed_whose_owner_was_killed():
    owner = subprocess.Popen(
        [sys.executable, "-c", ORPHAN, str(Path(__file__).parent)], stdout=subprocess.PIPE, text=True
    )
    try:
        pid_a, pid_b, ns_a, ns_b, if_a, if_b, keys = owner.stdout.readline().split()
    finally:
        owner.kill()
        owner.wait()
    pids, sockets = [int(pid_a), int(pid_b)], [netns.WG_SOCKETS / f"{i}.sock" for i in (if_a, if_b)]
    assert all(running(pid) for pid in pids) and all(s.exists() for s in sockets)
    netns.clean_stale()
    assert not [pid for pid in pids if running(pid)]
    listed = netns.ip("netns", "list").stdout
    assert ns_a not in listed and ns_b not in listed
    assert not [s for s in sockets if s.exists()] and not Path(keys).exists()


def test_the_tunnel_crosses_the_shaped_link():
    """1.25 MB at 10 Mbit/s is a second of line time (more: WireGuard's headers); through the tunnel
    it takes no less (a lower bound only, with a margin for the bucket's burst)."""
    nbytes = 1_250_000
    with netns.Bed(2, rate="10mbit", wireguard=True) as bed:
        a, b = bed.hosts
        server = serve(bed, b, b.tunnel_address)
        t0 = time.perf_counter()
        sent = send(bed, a, b.tunnel_address, nbytes, timeout=20)
        took = time.perf_counter() - t0
        server.wait(timeout=10)
        assert sent.returncode == 0, sent.stderr
        assert bed.tunnel_transfer(a)[b.name][1] > nbytes
    print(f"{nbytes} B through the tunnel at 10mbit: {float(sent.stdout):.2f} s ({took:.2f} s with the interpreter)")
    assert float(sent.stdout) > 0.8 * nbytes * 8 / 10e6
