"""Topology files, link schedules and the uneven world's cost model: what a file says, what a run
gets from it, and one line for every way a file can be wrong."""

from __future__ import annotations

import math
import os
from dataclasses import replace
from pathlib import Path

import pytest

from wansync.errors import ConfigError
from wansync.net import Link, collective_duration, parse_wan
from wansync.net.cost import allreduce_algorithm, hierarchical_seconds
from wansync.net.link import LAN_LINK, NVLINK
from wansync.net.schedule import LinkSchedule, Step, Traffic
from wansync.net.topology import Topology
from wansync.net.topology_file import parse
from wansync.net.wan import FILE_PRESETS, is_file_spec

MS = 1e-3

UNEVEN = """
name = "three"
[sites.a]
workers = 2
speeds = [1.0, 0.5]
[sites.b]
workers = 1
link = { rtt = "1ms", bw = "1gbit" }
ports = "worker"
[sites.c]
workers = 1
[[links]]
sites = ["a", "b"]
rtt = "80ms"
bw = "1gbit"
jitter = "1ms"
[[links]]
sites = ["b", "c"]
rtt = "160ms"
bw = "300mbit"
[[links]]
from = "a"
to = "c"
rtt = "220ms"
bw = "200mbit"
mtu = 9000
[[links]]
from = "c"
to = "a"
rtt = "220ms"
bw = "400mbit"
[worker]
link = "nvlink"
[[schedules]]
links = [["a", "b"]]
steps = [{ at = "10s", scale = 0.1 }, { at = "20s", bw = "2gbit", rtt = "40ms" }]
[[schedules]]
links = "all"
traffic = { seed = 3, every = "5s", low = 0.5 }
"""

UNEVEN_YAML = """
name: three
sites:
  a: {workers: 2, speeds: [1.0, 0.5]}
  b: {workers: 1, link: {rtt: 1ms, bw: 1gbit}, ports: worker}
  c: {workers: 1}
links:
  - {sites: [a, b], rtt: 80ms, bw: 1gbit, jitter: 1ms}
  - {sites: [b, c], rtt: 160ms, bw: 300mbit}
  - {from: a, to: c, rtt: 220ms, bw: 200mbit, mtu: 9000}
  - {from: c, to: a, rtt: 220ms, bw: 400mbit}
worker: {link: nvlink}
schedules:
  - links: [[a, b]]
    steps: [{at: 10s, scale: 0.1}, {at: 20s, bw: 2gbit, rtt: 40ms}]
  - links: all
    traffic: {seed: 3, every: 5s, low: 0.5}
"""


def write(tmp_path: Path, text: str, name: str = "t.toml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


# -- what a file says -------------------------------------------------------------------------------


def test_a_file_gives_named_sites_their_workers_links_speeds_and_schedules(tmp_path):
    topo = parse_wan(write(tmp_path, UNEVEN))
    assert topo.name == "three" and topo.sites == 3 and topo.site_names == ("a", "b", "c")
    assert topo.site_workers == (2, 1, 1) and topo.workers == 4
    assert [topo.site_of(r, 4) for r in range(4)] == [0, 0, 1, 2]  # workers fill sites in file order
    assert topo.base_link(0, 0) == LAN_LINK and topo.base_link(1, 1) == Link(1 * MS, 1e9)
    assert topo.base_link(0, 1) == topo.base_link(1, 0) == Link(80 * MS, 1e9, 1 * MS)
    assert topo.base_link(0, 2) == Link(220 * MS, 200e6, mtu=9000)  # asymmetric: each direction
    assert topo.base_link(2, 0) == Link(220 * MS, 400e6)
    assert topo.shared_port(1) and not topo.shared_port(0)
    assert topo.speeds == (1.0, 0.5, 1.0, 1.0) and topo.slowdown(1) == 2.0 and topo.slowdown(0) == 1.0
    assert topo.worker_link == NVLINK and topo.varies and len(topo.schedules) == 2
    assert "a (2 workers" in topo.describe() and "a-c RTT 220 ms, 0.2 Gbit/s, MTU 9000 (back" in topo.describe()


def test_yaml_says_the_same_as_toml(tmp_path):
    assert parse_wan(write(tmp_path, UNEVEN_YAML, "t.yaml")) == parse_wan(write(tmp_path, UNEVEN))


def test_the_shipped_presets_parse_and_are_named_like_any_preset():
    assert {"uneven-3-region", "intellect-1-usa", "intellect-1-usa-europe", "intellect-1-global"} <= set(FILE_PRESETS)
    for name in FILE_PRESETS:
        topo = parse_wan(name)
        assert topo.workers and topo.describe()
    assert parse_wan("uneven-3-region").site_workers == (2, 1, 1)
    assert not is_file_spec("two-site") and not is_file_spec("rtt=1ms,bw=1gbit,worker=50us/100gbit")
    assert is_file_spec("sites.toml") and is_file_spec("./mine") and not is_file_spec("uneven-3-region")


def test_a_run_must_have_the_files_workers():
    topo = parse_wan("uneven-3-region")
    topo.check_workers(4)
    with pytest.raises(ConfigError, match=r"has 4 workers \(us-east 2, eu-west 1, ap-southeast 1\) but the run has 3"):
        topo.check_workers(3)
    with pytest.raises(ConfigError, match="has 3 sites but the run has 2 workers"):
        parse_wan("rtt=1ms,bw=1gbit,sites=3").check_workers(2)


# -- schedules ----------------------------------------------------------------------------------------


def test_a_schedule_changes_its_links_at_its_steps_and_no_others(tmp_path):
    topo = replace(parse_wan(write(tmp_path, UNEVEN)), schedules=parse_wan(write(tmp_path, UNEVEN)).schedules[:1])
    assert topo.link(0, 1, 5.0).bandwidth_bps == 1e9
    assert topo.link(0, 1, 10.0).bandwidth_bps == pytest.approx(1e8)  # scale 0.1 from 10 s
    assert topo.link(1, 0, 15.0).bandwidth_bps == pytest.approx(1e8)  # both directions of the pair
    late = topo.link(0, 1, 25.0)
    assert late.bandwidth_bps == 2e9 and late.rtt_s == pytest.approx(40 * MS) and late.jitter_s == 1 * MS
    assert topo.link(0, 2, 15.0) == topo.base_link(0, 2)  # another pair: untouched
    assert topo.phase_start(12.0) == 10.0 and topo.phase_start(3.0) == 0.0


def test_other_traffic_is_a_seeded_share_per_period_the_same_for_every_reader():
    traffic = Traffic(seed=3, period_s=5.0, low=0.5, high=0.9)
    shares = [traffic.share((0, 1), t) for t in (0.0, 1.0, 4.9, 5.0, 12.0)]
    assert shares[0] == shares[1] == shares[2] and shares[3] != shares[0]
    assert all(0.5 <= s <= 0.9 for s in shares)
    assert shares == [Traffic(seed=3, period_s=5.0, low=0.5, high=0.9).share((0, 1), t) for t in (0, 1, 4.9, 5, 12)]
    assert traffic.share((1, 0), 1.0) != shares[0]  # each direction its own traffic
    sched = LinkSchedule(traffic=traffic)
    assert sched.phase_start(12.0) == 10.0


def test_the_cost_model_reads_the_links_at_the_run_time_it_is_asked():
    topo = Topology(
        sites=2, inter_link=Link(50 * MS, 1e9), schedules=(LinkSchedule(steps=(Step(at_s=30.0, scale=0.1),)),)
    )
    before = collective_duration("allreduce", 1e8, 2, topo, at_s=10.0)
    after = collective_duration("allreduce", 1e8, 2, topo, at_s=31.0)
    assert after - 0.05 == pytest.approx(10 * (before - 0.05), rel=1e-6)  # the bandwidth term 10x


# -- the cost model on uneven links ---------------------------------------------------------------------


def test_a_ring_across_three_sites_is_paced_by_its_slowest_hop():
    def three(bc: float) -> Topology:
        fast = Link(10 * MS, 1e9)
        return Topology(sites=3, inter_link=fast, pair_links=((2, 1, Link(10 * MS, bc)),))  # on the ring 2->1->0->2

    b = 1e8
    even = collective_duration("allreduce", b, 3, three(1e9))
    slow = collective_duration("allreduce", b, 3, three(1e8))
    slow_rate = Link(10 * MS, 1e8).bytes_per_s  # a ring of three: each line one way
    assert slow >= 4 * b / 3 / slow_rate  # 2(k-1) chunks of B/k over the slow hop
    assert slow > 5 * even
    # gloo's ring sends from each rank to the one before it: 2->1->0->2 uses the slow direction 2->1,
    # the ring of the group [2, 1, 0] (1->2->0->1) never does
    back = Topology(sites=3, inter_link=Link(10 * MS, 1e9), pair_links=((2, 1, Link(10 * MS, 1e8)),))
    assert (
        collective_duration("allreduce", b, 3, back, ranks=[2, 1, 0])
        < collective_duration("allreduce", b, 3, back, ranks=[0, 1, 2]) / 5
    )
    ahead = Topology(sites=3, inter_link=Link(10 * MS, 1e9), pair_links=((1, 2, Link(10 * MS, 1e8)),))
    assert collective_duration("allreduce", b, 3, ahead, ranks=[0, 1, 2]) == pytest.approx(even)


def test_the_model_picks_hierarchical_where_sites_hold_several_workers_behind_slow_links():
    topo = parse_wan("uneven-3-region")
    assert allreduce_algorithm(7.28e6, 4, topo) == "hierarchical"
    assert hierarchical_seconds(7.28e6, 4, topo) < collective_duration("allreduce", 7.28e6, 4, topo)
    # one worker per site: nothing to gather first, flat
    one_each = Topology(sites=3, inter_link=Link(80 * MS, 1e9))
    assert allreduce_algorithm(7.28e6, 3, one_each) == "flat"
    # a slow LAN inside the big site and a fast WAN: gathering inside first costs more than it saves
    slow_lan = replace(
        topo,
        site_links=(Link(5 * MS, 100e6), LAN_LINK, LAN_LINK),
        pair_links=tuple((a, b, Link(1 * MS, 10e9)) for a, b, _ in topo.pair_links),
    )
    assert allreduce_algorithm(7.28e6, 4, slow_lan) == "flat"


def test_a_sites_shared_port_is_shared_by_a_workers_parallel_rings():
    open_ports = Topology(sites=1, intra_link=Link(20 * MS, 1e9), site_workers=(3,), ranks_per_worker=2)
    shared = replace(open_ports, site_ports=("worker",))
    one = collective_duration("allreduce", 1e8, 6, open_ports, [0, 2, 4], parallel=2)
    two = collective_duration("allreduce", 1e8, 6, shared, [0, 2, 4], parallel=2)
    assert two - 4 * 10 * MS == pytest.approx(2 * (one - 4 * 10 * MS), rel=1e-3)


# -- one line for every way a file can be wrong -----------------------------------------------------------

BAD = [
    (
        "a pair with no link",
        UNEVEN.replace('[[links]]\nfrom = "c"\nto = "a"\nrtt = "220ms"\nbw = "400mbit"\n', ""),
        r"no link from 'c' to 'a' \(only a to c is given\)",
    ),
    (
        "a site with no workers",
        UNEVEN.replace("workers = 2", "workers = 0"),
        r"\[sites.a\] workers: a site with no workers",
    ),
    (
        "a site without its workers",
        UNEVEN.replace("[sites.c]\nworkers = 1", "[sites.c]"),
        r"\[sites.c\] workers: missing",
    ),
    ("workers that are not whole", UNEVEN.replace("workers = 2", "workers = 1.5"), "whole number of workers"),
    ("a zero speed", UNEVEN.replace("[1.0, 0.5]", "[1.0, 0]"), "speed must be positive"),
    ("a negative speed", UNEVEN.replace("[1.0, 0.5]", "[-1.0, 0.5]"), "speed must be positive"),
    ("speeds that miss a worker", UNEVEN.replace("[1.0, 0.5]", "[1.0]"), "1 speeds for 2 workers"),
    ("a speed that is a word", UNEVEN.replace("[1.0, 0.5]", '[1.0, "fast"]'), r"speeds\[1\]: expected a finite number"),
    ("a schedule going back in time", UNEVEN.replace('at = "20s"', 'at = "5s"'), "go back in time: 5 s after 10 s"),
    ("a step at the same time", UNEVEN.replace('at = "20s"', 'at = "10s"'), "go back in time"),
    ("an unknown top-level key", 'colour = "red"\n' + UNEVEN, "the top level: unknown key 'colour'"),
    ("an unknown site key", UNEVEN.replace("[sites.c]\n", "[sites.c]\ngpus = 8\n"), r"\[sites.c\]: unknown key 'gpus'"),
    (
        "an unknown link key",
        UNEVEN.replace('jitter = "1ms"', 'latency = "1ms"'),
        r"\[\[links\]\] #1: unknown key 'latency'",
    ),
    ("an unknown step key", UNEVEN.replace("scale = 0.1", "factor = 0.1"), r"steps\[0\]: unknown key 'factor'"),
    ("an unknown traffic key", UNEVEN.replace("low = 0.5", "low = 0.5, mean = 0.7"), "traffic: unknown key 'mean'"),
    (
        "a file that does not parse",
        UNEVEN.replace('bw = "300mbit"', "bw = 300mbit"),
        "does not parse: line %d: " % (UNEVEN.splitlines().index('bw = "300mbit"') + 1),
    ),
    ("a link to an unknown site", UNEVEN.replace('sites = ["b", "c"]', 'sites = ["b", "d"]'), "unknown site 'd'"),
    (
        "a pair given twice",
        UNEVEN.replace('from = "c"\nto = "a"', 'from = "a"\nto = "c"'),
        "a second link from 'a' to 'c'",
    ),
    ("a link from a site to itself", UNEVEN.replace('sites = ["b", "c"]', 'sites = ["b", "b"]'), "to itself"),
    ("a link without a bandwidth", UNEVEN.replace('rtt = "160ms"\nbw = "300mbit"', 'rtt = "160ms"'), "missing bw"),
    ("a time without a unit", UNEVEN.replace('rtt = "160ms"', 'rtt = "160"'), "expected a number with a unit"),
    ("a time that is a number", UNEVEN.replace('rtt = "160ms"', "rtt = 160"), "expected a non-empty string"),
    ("a rate without a unit", UNEVEN.replace('bw = "300mbit"', 'bw = "300"'), "expected a rate"),
    ("a zero bandwidth", UNEVEN.replace('bw = "300mbit"', 'bw = "0mbit"'), "bandwidth must be a positive"),
    ("a bad mtu", UNEVEN.replace("mtu = 9000", "mtu = 12"), "mtu must be an integer in"),
    ("both sites and from", UNEVEN.replace('sites = ["b", "c"]', 'sites = ["b", "c"]\nfrom = "b"'), "not both"),
    ("a step that changes nothing", UNEVEN.replace('{ at = "10s", scale = 0.1 }', '{ at = "10s" }'), "changes nothing"),
    ("a step without its time", UNEVEN.replace('at = "10s", ', ""), "missing at"),
    ("a step with bw and scale", UNEVEN.replace("scale = 0.1", 'scale = 0.1, bw = "1gbit"'), "bw or scale, not both"),
    ("traffic that takes everything", UNEVEN.replace("low = 0.5", "low = 0"), "0 < low <= high <= 1"),
    ("traffic without a period", UNEVEN.replace('every = "5s", ', ""), "missing every"),
    ("a schedule of unknown links", UNEVEN.replace('links = "all"', 'links = "some"'), "expected an array"),
    (
        "a schedule of nothing",
        UNEVEN.replace('traffic = { seed = 3, every = "5s", low = 0.5 }', ""),
        "needs steps or traffic",
    ),
    ("a worker link that is unknown", UNEVEN.replace('link = "nvlink"', 'link = "pcie"'), r"\[worker\] link: expected"),
    (
        "ports that are unknown",
        UNEVEN.replace('ports = "worker"', 'ports = "node"'),
        "ports: expected 'rank' or 'worker'",
    ),
    ("no sites at all", 'name = "x"\n', r"no \[sites\]"),
    ("sites that are not tables", "sites = 3\n", "expected a table of sites"),
]


@pytest.mark.parametrize("text, match", [(t, m) for _, t, m in BAD], ids=[i for i, _, _ in BAD])
def test_a_bad_file_is_one_line_naming_the_file(tmp_path, text, match):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError, match=match) as err:
        parse_wan(path)
    assert "\n" not in str(err.value) and f"topology file {path}" in str(err.value)


def test_a_yaml_file_that_does_not_parse_names_its_line(tmp_path):
    with pytest.raises(ConfigError, match=r"does not parse: line 3: found character '\\t'"):
        parse_wan(write(tmp_path, "name: x\nsites:\n\ta: {workers: 2}\n", "t.yaml"))
    with pytest.raises(ConfigError, match="expected a mapping"):
        parse_wan(write(tmp_path, "- 1\n- 2\n", "t.yml"))


def test_paths_that_are_not_topology_files_are_one_line(tmp_path):
    with pytest.raises(ConfigError, match="topology file not found"):
        parse_wan(str(tmp_path / "missing.toml"))
    (tmp_path / "dir.toml").mkdir()
    with pytest.raises(ConfigError, match="is a directory, not a regular file"):
        parse_wan(str(tmp_path / "dir.toml"))
    fifo = tmp_path / "pipe.toml"
    os.mkfifo(fifo)  # a reader would block on it for ever
    with pytest.raises(ConfigError, match="is a FIFO, not a regular file"):
        parse_wan(str(fifo))
    (tmp_path / "bin.toml").write_bytes(b"name = \xff\xfe\n")
    with pytest.raises(ConfigError, match="is not UTF-8 text"):
        parse_wan(str(tmp_path / "bin.toml"))
    (tmp_path / "big.toml").write_text("#" * (1 << 21))
    with pytest.raises(ConfigError, match="too large"):
        parse_wan(str(tmp_path / "big.toml"))
    with pytest.raises(ConfigError, match="expected a .toml, .yaml or .yml file"):
        parse_wan(write(tmp_path, UNEVEN, "sites.json"))
    link = tmp_path / "link.toml"
    link.symlink_to(write(tmp_path, UNEVEN))  # read through a link: it is only read
    assert parse_wan(str(link)).workers == 4


def test_a_preset_file_takes_no_overrides():
    with pytest.raises(ConfigError, match="is a topology file and takes no overrides"):
        parse_wan("uneven-3-region,bw=1gbit")


def test_parse_reports_the_source_it_is_given():
    with pytest.raises(ConfigError, match="topology file <inline>: "):
        parse("sites = 1", "<inline>")
    assert math.isclose(parse(UNEVEN, "<inline>").base_link(1, 2).bandwidth_bps, 300e6)


def test_a_users_loop_with_a_file_of_other_workers_is_refused_before_the_group_comes_up():
    import wansync as ws

    with pytest.raises(ConfigError, match="has 4 workers .* but the run has 1"):
        ws.init(wan="uneven-3-region")
    import torch.distributed as dist

    assert not dist.is_initialized()


def test_nodes_and_checkpoints_compare_what_a_file_says_not_where_it_lies(tmp_path):
    from wansync.config import build_config, fingerprint

    a, b = tmp_path / "a.toml", tmp_path / "b.toml"
    a.write_text(UNEVEN)
    b.write_text(UNEVEN.replace("# nothing", ""))
    other = tmp_path / "c.toml"
    other.write_text(UNEVEN.replace('bw = "300mbit"', 'bw = "301mbit"'))

    def print_of(path: Path) -> dict:
        return fingerprint(build_config(overrides={"wan": str(path), "workers": 4, "strategy": "diloco"}), {})

    assert print_of(a) == print_of(b)  # the same links from another path: the same run
    assert print_of(a)["wan"] != print_of(other)["wan"]  # another bandwidth: nodes refuse, a resume refuses
