"""A test bed of hosts: Linux network namespaces joined by veth pairs, each a host with its own TCP
stack, address, host name and name resolution, optionally shaped with `tbf` or `htb` (never netem: CI
kernels may lack it).

    with Bed(2, rate="100mbit", names=("loopback", "address")) as bed:
        a, b = bed.hosts
        proc = bed.start(a, ["torchrun", ...])        # in A's namespace, under A's host name

Host i lives in namespace `<prefix>h<i>` at 10.77.0.<i+1>/24. Two hosts are one veth pair; three or
more meet on a bridge in a namespace of its own. `shape` limits a host's whole egress (`tbf`);
`shape_pairs` gives each directed pair of hosts a rate of its own (`htb`, a class per destination),
again mid-test to change them; `rtt` measures a pair's round trip. Each host's /etc/hosts (`ip netns
exec` mounts /etc/netns/<ns>/hosts over it) names localhost and every host; its own name resolves to
127.0.0.1 (`names` "loopback": the default of many Linux images, where torchrun's and gloo's guesses
fail) or to its address ("address"). A process started in a host runs under `unshare --uts` with
that host's name, in a session of its own. `close` (also on failure) kills every process in the
bed's namespaces and deletes them; a bed whose owner (the pid in its name) died is cleaned up by the
next. Needs root; `unavailable()` says why a bed cannot be made here, for a skip. `documented_torchrun`
gives the torchrun options of docs/multinode.md's command, which the bed's hosts run.

`wireguard=True` puts a WireGuard tunnel over that network, as sites joined by a VPN have: each host
runs user-space `wireguard-go` (no kernel module needed) on `wg<token>h<i>` at 10.78.0.<i+1>/24, MTU
1420 (wg-quick's: fits the veth's 1500 over IPv6 too), a peer for every other host at its bed address.
The tunnel's packets cross the bed's links, so `rate` and `shape` hold them too. In that mode a host
name resolves to the host's tunnel address (a run that names its hosts goes through the tunnel, as
on a VPN) and `<name>-underlay` to its bed address; `Host.tunnel_address` and `tunnel_ifname` say
where the tunnel is (None without one), `tunnel_transfer` and `handshakes` show that it carried the
traffic. Its private keys live in a directory of the bed's own (0700, the keys 0600) that `close`
removes, with each wireguard-go (SIGTERM, then SIGKILL) and its control socket: /var/run/wireguard is
shared by every namespace, hence the bed's token in the interface's name. `unavailable(wireguard=True)`
says why a tunnel cannot be made here.
"""

from __future__ import annotations

import itertools
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

PREFIX = "wsbed"
DOCS = Path(__file__).resolve().parents[1] / "docs"
NETNS_ETC = Path("/etc/netns")
SUBNET = "10.77.0"
UNLIMITED = "100gbit"  # above a veth here (~10 Gbit/s); a 10gbit class held it to 9.6
ECHO_PORT = 7  # the bed's namespaces have ports of their own
TUNNEL_SUBNET = "10.78.0"
WG_PORT = 51820  # every host's own: one per namespace
WG_MTU = 1420  # wg-quick's: 1500 less WireGuard's 80 bytes over IPv6 (60 over IPv4: 20 IP, 8 UDP, 16 header, 16 tag)
WG_SOCKETS = Path("/var/run/wireguard")  # wireguard-go's control sockets, one directory for every namespace
WG_IFNAME = re.compile(r"wg(\d+)x\d+h\d+")  # a bed's tunnel interface: wg<owner pid>x<bed>h<host>
_count = itertools.count()


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


def unavailable(wireguard: bool = False) -> str | None:
    """Why no bed (`wireguard`: with a WireGuard tunnel) can be made here (None: it can)."""
    if os.geteuid() != 0:
        return "the multi-host bed needs root (network namespaces)"
    for tool in ("ip", "tc", "unshare") + (("wireguard-go", "wg") if wireguard else ()):
        if shutil.which(tool) is None:
            return f"the multi-host bed needs `{tool}`"
    if wireguard and (why := _tun_unavailable()):
        return why
    probe = f"{PREFIX}{os.getpid()}probe{next(_count)}"
    made = ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"network namespaces are unavailable: {made.stderr.strip()}"
    try:
        inside = subprocess.run(
            ["ip", "netns", "exec", probe, "unshare", "--uts", "true"], capture_output=True, text=True
        )
    finally:
        ip("netns", "del", probe, check=False)
    if inside.returncode != 0:
        return f"cannot run a process in a namespace of its own: {inside.stderr.strip()}"
    return None


def _tun_unavailable() -> str | None:
    """Why wireguard-go could not make its interface: it needs the TUN device."""
    try:
        os.close(os.open("/dev/net/tun", os.O_RDWR))
    except OSError as e:
        return f"a WireGuard bed needs /dev/net/tun (user-space wireguard-go): {e}"
    return None


@dataclass(frozen=True)
class Host:
    ns: str  # its network namespace
    name: str  # its host name
    address: str  # its address on the bed's network
    ifname: str  # its interface there
    tunnel_address: str | None = None  # its address on the WireGuard tunnel (None: no tunnel)
    tunnel_ifname: str | None = None  # the tunnel's interface (wireguard-go's)


class Bed:
    """`n` hosts (module docstring). `rate` (tc's syntax, e.g. "1gbit"): each host's egress line
    rate; `names`: per host, "loopback" or "address" (what its own name resolves to); `wireguard`:
    a WireGuard tunnel between every pair of hosts, over the bed's links."""

    def __init__(self, n: int = 2, rate: str | None = None, names: tuple[str, ...] = (), wireguard: bool = False):
        clean_stale()
        self.token = f"{os.getpid()}x{next(_count)}"
        self.hosts = [
            Host(
                f"{PREFIX}{self.token}h{i}",
                f"host{chr(97 + i)}",
                f"{SUBNET}.{i + 1}",
                f"ws{self.token}{i}"[-15:],
                *((f"{TUNNEL_SUBNET}.{i + 1}", self._tunnel_ifname(i)) if wireguard else ()),
            )
            for i in range(n)
        ]
        self.switch = f"{PREFIX}{self.token}sw" if n > 2 else None
        self.names = names or ("address",) * n
        self.procs: list[subprocess.Popen] = []
        self.wg_procs: list[subprocess.Popen] = []  # each host's wireguard-go, in the order of `hosts`
        self.public_keys: dict[str, str] = {}  # a host's name -> its WireGuard public key
        self.keys = Path(tempfile.mkdtemp(prefix=f"{PREFIX}{self.token}keys")) if wireguard else None  # 0700
        try:
            self._build(rate)
            if wireguard:
                self._tunnel()
        except BaseException:
            self.close()
            raise

    def _tunnel_ifname(self, i: int) -> str:
        """Host i's WireGuard interface: its control socket's name in the one /var/run/wireguard of every
        namespace, so the bed's token (and owner, for `clean_stale`) is in it, whole."""
        name = f"wg{self.token}h{i}"
        if len(name) > 15:  # IFNAMSIZ; 7-digit pids and 1000 beds in one process would reach it
            raise ValueError(f"tunnel interface {name!r} is longer than Linux's 15 characters")
        return name

    def _build(self, rate: str | None) -> None:
        for h in self.hosts:
            ip("netns", "add", h.ns)
            ip("-n", h.ns, "link", "set", "lo", "up")
        if self.switch is None:
            a, b = self.hosts
            ip("link", "add", a.ifname, "netns", a.ns, "type", "veth", "peer", "name", b.ifname, "netns", b.ns)
        else:
            ip("netns", "add", self.switch)
            ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
            ip("-n", self.switch, "link", "set", "br0", "up")
            for i, h in enumerate(self.hosts):
                port = f"p{i}"
                ip("link", "add", h.ifname, "netns", h.ns, "type", "veth", "peer", "name", port, "netns", self.switch)
                ip("-n", self.switch, "link", "set", port, "master", "br0")
                ip("-n", self.switch, "link", "set", port, "up")
        for h in self.hosts:
            ip("-n", h.ns, "addr", "add", f"{h.address}/24", "dev", h.ifname)
            ip("-n", h.ns, "link", "set", h.ifname, "up")
            if rate is not None:
                self.shape(h, rate)
            self._write_hosts(h)

    def _tunnel(self) -> None:
        """A wireguard-go per host, then its keys, port, peers (every other host, at its bed address, for
        its tunnel /32) and tunnel address."""
        for h in self.hosts:
            self.wg_procs.append(_start_wireguard_go(h, self.keys))
        for h in self.hosts:
            private = self.keys / f"{h.name}.key"
            fd = os.open(private, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(_wg("genkey").stdout)
            self.public_keys[h.name] = _wg("pubkey", input=private.read_text()).stdout.strip()
        for h in self.hosts:
            peers = []
            for other in self.hosts:
                if other is not h:
                    peers += ["peer", self.public_keys[other.name], "endpoint", f"{other.address}:{WG_PORT}"]
                    peers += ["allowed-ips", f"{other.tunnel_address}/32"]
            key = str(self.keys / f"{h.name}.key")
            _wg("set", h.tunnel_ifname, "private-key", key, "listen-port", str(WG_PORT), *peers, ns=h.ns)
            ip("-n", h.ns, "addr", "add", f"{h.tunnel_address}/24", "dev", h.tunnel_ifname)
            ip("-n", h.ns, "link", "set", h.tunnel_ifname, "mtu", str(WG_MTU), "up")

    def tunnel_transfer(self, host: Host) -> dict[str, tuple[int, int]]:
        """Bytes `host`'s tunnel received from and sent to each peer (by host name), WireGuard's own
        counters (`wg show transfer`): proof that traffic went through the tunnel, not around it."""
        return {name: (int(rx), int(tx)) for name, (rx, tx) in self._wg_show(host, "transfer").items()}

    def handshakes(self, host: Host) -> dict[str, float]:
        """When `host` last completed a handshake with each peer (by host name; Unix seconds, 0: never)."""
        return {name: float(t) for name, (t,) in self._wg_show(host, "latest-handshakes").items()}

    def _wg_show(self, host: Host, what: str) -> dict[str, list[str]]:
        """`wg show <if> <what>`'s rows by the peer's host name."""
        if host.tunnel_ifname is None:
            raise ValueError("the bed has no WireGuard tunnel (Bed(..., wireguard=True))")
        by_key = {key: name for name, key in self.public_keys.items()}
        rows = [line.split() for line in _wg("show", host.tunnel_ifname, what, ns=host.ns).stdout.splitlines()]
        return {by_key[key]: values for key, *values in rows if key in by_key}

    def shape(self, host: Host, rate: str) -> None:
        """Limit `host`'s egress to `rate` with a token bucket (replacing any earlier limit)."""
        burst = max(32 * 1024, int(_bits(rate) / 8 / 1000))  # a millisecond at line rate
        subprocess.run(
            [
                "ip",
                "netns",
                "exec",
                host.ns,
                "tc",
                "qdisc",
                "replace",
                "dev",
                host.ifname,
                "root",
                "tbf",
                "rate",
                rate,
                "burst",
                str(burst),
                "latency",
                "100ms",
            ],
            check=True,
            capture_output=True,
            text=True,
        )

    def shape_pairs(self, rates: dict[tuple[int, int], str]) -> None:
        """Limit host i's traffic to host j to `rates[(i, j)]` (tc's syntax), each directed pair on its
        own: on a bridge a host's one link carries all its pairs, so i's egress gets an htb class per
        destination, picked by a u32 filter on the destination address. Pairs not named, and traffic
        to no host (ARP), are unlimited. Changes the classes in place, so calling it again mid-test
        (a link dropping) loses no queued packet; replaces a `shape` (tbf) limit."""
        for i, j in rates:
            if i == j or not (0 <= i < len(self.hosts) and 0 <= j < len(self.hosts)):
                raise ValueError(f"pair {(i, j)}: expected two different hosts of {len(self.hosts)}")
        for i, h in enumerate(self.hosts):
            if _root_qdisc(h) != "htb 1:":
                tc(h, "qdisc", "replace", "dev", h.ifname, "root", "handle", "1:", "htb", "default", "ffff")
            _htb_class(h, "1:ffff", UNLIMITED)
            for j, other in enumerate(self.hosts):
                if j != i:
                    _htb_class(h, f"1:{j + 1:x}", rates.get((i, j), UNLIMITED))
                    tc(
                        h,
                        "filter",
                        "replace",
                        "dev",
                        h.ifname,
                        "parent",
                        "1:",
                        "protocol",
                        "ip",
                        "prio",
                        "1",
                        "handle",
                        f"800::{j + 1:x}",
                        "u32",
                        "match",
                        "ip",
                        "dst",
                        f"{other.address}/32",
                        "flowid",
                        f"1:{j + 1:x}",
                    )

    def rtt(self, a: int, b: int, tunnel: bool = False) -> float:
        """Median round trip (seconds) of a 1-byte TCP ping-pong from host `a` to host `b` (`tunnel`:
        to its tunnel address): what the bed's links (and the tunnel) add to every exchange."""
        server = self.start(
            self.hosts[b],
            [sys.executable, "-c", _ECHO_SERVER, str(ECHO_PORT)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        to = self.hosts[b].tunnel_address if tunnel else self.hosts[b].address
        out = self.run(self.hosts[a], [sys.executable, "-c", _ECHO_CLIENT, to, str(ECHO_PORT)], timeout=30)
        try:
            err = server.communicate(timeout=10)[1]  # it serves one connection: the port is free again
        except subprocess.TimeoutExpired:
            server.kill()
            err = server.communicate()[1]
        if out.returncode != 0:
            raise RuntimeError(f"rtt {a}->{b}: {out.stderr.strip()} (echo server: {err.strip()})")
        return float(out.stdout)

    def _write_hosts(self, host: Host) -> None:
        """Names to bed addresses or, with a tunnel, to tunnel addresses and `<name>-underlay` to bed ones."""
        d = NETNS_ETC / host.ns
        d.mkdir(parents=True, exist_ok=True)
        at = {h.name: h.tunnel_address or h.address for h in self.hosts}
        own = "127.0.0.1" if self.names[self.hosts.index(host)] == "loopback" else at[host.name]
        lines = ["127.0.0.1 localhost", "::1 localhost ip6-localhost", f"{own} {host.name}"]
        lines += [f"{at[h.name]} {h.name}" for h in self.hosts if h is not host]
        lines += [f"{h.address} {h.name}-underlay" for h in self.hosts if h.tunnel_address]
        (d / "hosts").write_text("\n".join(lines) + "\n")

    def command(self, host: Host, args: list[str]) -> list[str]:
        """`args` as run in `host`: its namespace, its /etc/hosts, its host name."""
        return [
            "ip",
            "netns",
            "exec",
            host.ns,
            "unshare",
            "--uts",
            "--",
            "sh",
            "-c",
            'hostname "$0" && exec "$@"',
            host.name,
            *args,
        ]

    def start(self, host: Host, args: list[str], env: dict[str, str] | None = None, **kwargs) -> subprocess.Popen:
        """Start `args` in `host`, in a session of its own; `close` ends it."""
        proc = subprocess.Popen(self.command(host, args), env=env, start_new_session=True, **kwargs)
        self.procs.append(proc)
        return proc

    def run(self, host: Host, args: list[str], timeout: float = 60, **kwargs) -> subprocess.CompletedProcess:
        return subprocess.run(self.command(host, args), capture_output=True, text=True, timeout=timeout, **kwargs)

    def close(self) -> None:
        """End every process in the bed, delete its namespaces and their /etc/netns files; with a tunnel,
        stop each wireguard-go by its pid, remove its control socket and the keys."""
        for h, p in zip(self.hosts, self.wg_procs):
            _stop(p)
            _remove_socket(h.tunnel_ifname)
        for p in self.procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        for ns in [h.ns for h in self.hosts] + ([self.switch] if self.switch else []):
            delete_namespace(ns)
        for h in self.hosts:
            if h.tunnel_ifname:  # a wireguard-go that never started, or one the namespaces' end killed
                _remove_socket(h.tunnel_ifname)
        if self.keys is not None:
            shutil.rmtree(self.keys, ignore_errors=True)

    def __enter__(self) -> "Bed":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def delete_namespace(ns: str) -> None:
    """Kill what runs in `ns`, delete it and its /etc/netns files."""
    for _ in range(50):
        pids = ip("netns", "pids", ns, check=False).stdout.split()
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(int(pid), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass
        time.sleep(0.1)
    ip("netns", "del", ns, check=False)
    shutil.rmtree(NETNS_ETC / ns, ignore_errors=True)


def clean_stale() -> None:
    """Delete the namespaces of beds whose owning process is gone (a test run that was killed), with
    their wireguard-go (killed as a process of the namespace, or by its interface's name where the
    namespace is gone already), control sockets and keys."""
    for line in ip("netns", "list", check=False).stdout.splitlines():
        ns = line.split()[0] if line.split() else ""
        if not ns.startswith(PREFIX):
            continue
        owner = ns[len(PREFIX) :].split("x", 1)[0].split("probe", 1)[0]
        if owner.isdigit() and not Path(f"/proc/{owner}").exists():
            delete_namespace(ns)
    for pid, ifname in _wireguard_gos():
        if _dead_owner(ifname):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    for sock in WG_SOCKETS.glob("wg*.sock"):
        if _dead_owner(sock.name[: -len(".sock")]):
            sock.unlink(missing_ok=True)
    for keys in Path(tempfile.gettempdir()).glob(f"{PREFIX}*keys*"):
        owner = keys.name[len(PREFIX) :].split("x", 1)[0]
        if owner.isdigit() and not Path(f"/proc/{owner}").exists():
            shutil.rmtree(keys, ignore_errors=True)


def _dead_owner(ifname: str) -> bool:
    """Whether `ifname` is a bed's tunnel interface whose owner (the pid in its name) is gone."""
    found = WG_IFNAME.fullmatch(ifname)
    return found is not None and not Path(f"/proc/{found.group(1)}").exists()


def _wireguard_gos() -> list[tuple[int, str]]:
    """(pid, interface) of every wireguard-go running here, from /proc."""
    out = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            args = cmdline.read_bytes().split(b"\0")
        except OSError:  # it ended
            continue
        args = [a.decode(errors="replace") for a in args if a]
        if args and Path(args[0]).name == "wireguard-go":
            out.append((int(cmdline.parent.name), args[-1]))
    return out


def _start_wireguard_go(host: Host, logs: Path) -> subprocess.Popen:
    """wireguard-go in the foreground in `host`'s namespace (`ip netns exec` execs it: the Popen's pid
    is its own), once its control socket answers."""
    log = logs / f"{host.tunnel_ifname}.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            ["ip", "netns", "exec", host.ns, "wireguard-go", "-f", host.tunnel_ifname],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    sock = WG_SOCKETS / f"{host.tunnel_ifname}.sock"
    deadline = time.monotonic() + 10
    while not sock.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            _stop(proc)
            raise RuntimeError(f"wireguard-go for {host.name} did not start: {log.read_text()[-1000:].strip()}")
        time.sleep(0.01)
    return proc


def _stop(proc: subprocess.Popen, timeout: float = 5) -> None:
    """SIGTERM (wireguard-go then removes its socket and interface), SIGKILL after `timeout`; reaped."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
    proc.wait()


def _remove_socket(ifname: str | None) -> None:
    if ifname:
        (WG_SOCKETS / f"{ifname}.sock").unlink(missing_ok=True)


def _wg(*args: str, ns: str | None = None, input: str | None = None) -> subprocess.CompletedProcess:
    """`wg` (in namespace `ns`), its errors raised with what it said."""
    cmd = ["ip", "netns", "exec", ns, "wg", *args] if ns else ["wg", *args]
    done = subprocess.run(cmd, capture_output=True, text=True, input=input)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: {done.stderr.strip()}")
    return done


def tc(host: Host, *args: str) -> None:
    subprocess.run(["ip", "netns", "exec", host.ns, "tc", *args], check=True, capture_output=True, text=True)


def _root_qdisc(host: Host) -> str:
    """`host`'s root qdisc as "<kind> <handle>" (e.g. "htb 1:"), to change an htb in place."""
    out = subprocess.run(
        ["ip", "netns", "exec", host.ns, "tc", "qdisc", "show", "dev", host.ifname, "root"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.split()
    return " ".join(out[1:3])


def _htb_class(host: Host, classid: str, rate: str) -> None:
    """An htb class of `rate` that never borrows. tc's default buckets are a tick of the rate plus an
    MTU, a tick being a nanosecond on hrtimer kernels: 1.4 KB, under one of a veth's 64 KB GSO
    packets, which held a 1gbit class 3% short. Hence, as for `shape`, a millisecond at the rate and
    at least 32 KB, for both buckets (htb sends a packet bigger than them; it waits for the tokens
    after). A quantum of 64 KB: the default, rate/10, exceeds htb's range above 16 Mbit/s and only
    weighs borrowing."""
    burst = str(max(32 * 1024, int(_bits(rate) / 8 / 1000)))
    tc(
        host,
        "class",
        "replace",
        "dev",
        host.ifname,
        "parent",
        "1:",
        "classid",
        classid,
        "htb",
        "rate",
        rate,
        "ceil",
        rate,
        "burst",
        burst,
        "cburst",
        burst,
        "quantum",
        str(64 * 1024),
    )


_ECHO_SERVER = """
import socket, sys
with socket.create_server(("", int(sys.argv[1]))) as srv:
    conn, _ = srv.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    while data := conn.recv(1):
        conn.sendall(data)
"""

_ECHO_CLIENT = """
import socket, statistics, sys, time
for _ in range(200):
    try:
        conn = socket.create_connection((sys.argv[1], int(sys.argv[2])))
        break
    except OSError:
        time.sleep(0.02)
else:
    raise SystemExit("no echo server")
conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
rtts = []
for _ in range(60):
    t0 = time.perf_counter()
    conn.sendall(b"x")
    conn.recv(1)
    rtts.append(time.perf_counter() - t0)
conn.close()
print(statistics.median(rtts[10:]))
"""


def _bits(rate: str) -> float:
    units = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "bit": 1.0}
    for unit, scale in units.items():
        if rate.endswith(unit):
            return float(rate[: -len(unit)]) * scale
    raise ValueError(f"rate {rate!r}: expected a number with kbit, mbit or gbit")


TORCHRUN = Path(sys.executable).parent / "torchrun"
# torchrun's own variables and ours must come from the bed, not from the caller's environment
NOT_INHERITED = ("GLOO_", "MASTER_", "RANK", "WORLD_SIZE", "LOCAL_", "TORCHELASTIC_", "WANSYNC_", "OMP_", "NCCL_")


def host_env(*extra: dict[str, str]) -> dict[str, str]:
    """The environment of a command on a bed host: the caller's without torchrun's and wansync's own
    variables (`NOT_INHERITED`), then each of `extra` over it."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(NOT_INHERITED)}
    for more in extra:
        env.update(more)
    return env


def torchrun_wansync(
    endpoint: str, args: list[str], nnodes: int | None = None, nproc: int | None = None, python: str | None = None
) -> list[str]:
    """docs/multinode.md's command (`documented_torchrun`) for `wansync ARGS`, its endpoint at `endpoint`,
    `nnodes` and `nproc` per node where given; `python`: the interpreter torchrun runs with (its workers'
    too, through PYTHON_EXEC in the environment: tests/forked_python.py's stand-in)."""
    options = documented_torchrun(endpoint)
    for flag, value in (("--nnodes", nnodes), ("--nproc-per-node", nproc)):
        if value is not None:
            options[options.index(flag) + 1] = str(value)
    return [*([python] if python else []), str(TORCHRUN), *options, "-m", "wansync", *args]


def documented_torchrun(endpoint: str) -> list[str]:
    """The torchrun options of docs/multinode.md's multi-host command, with `endpoint`'s address in
    place of the page's: what the bed's hosts run."""
    text = (DOCS / "multinode.md").read_text().replace("\\\n", " ")
    found = re.search(r"^torchrun (--nnodes 2 .*?)-m wansync train", text, re.M | re.S)
    if found is None:
        raise AssertionError("docs/multinode.md lost its torchrun command")
    return [o.replace("10.0.0.1", endpoint) for o in shlex.split(found.group(1))]
