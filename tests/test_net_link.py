"""Links, presets, the --wan spec string, and the cost model's numbers worked out by hand."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from wansync.errors import ConfigError
from wansync.net import PRESETS, Link, Topology, collective_duration, jitter_draw, parse_wan
from wansync.net.link import LAN_LINK, NVLINK, parse_rate, parse_time

MS = 1e-3

# -- presets and the spec string ------------------------------------------------------------------


def test_presets_have_the_documented_links():
    assert PRESETS["lan"].sites == 1 and PRESETS["lan"].intra_link == Link(0.2 * MS, 10e9)
    assert PRESETS["two-site"].sites == 2 and PRESETS["two-site"].inter_link == Link(16.6 * MS, 10e9)
    assert PRESETS["cross-region"].inter_link == Link(100 * MS, 1e9)
    assert PRESETS["cross-continent"].inter_link == Link(200 * MS, 200e6)
    for name in ("two-site", "cross-region", "cross-continent"):
        assert PRESETS[name].intra_link == LAN_LINK


def test_a_preset_name_parses_to_the_preset():
    assert parse_wan("two-site") == PRESETS["two-site"]
    assert parse_wan(" Cross-Region ") == PRESETS["cross-region"]


def test_the_cli_example_parses():
    topo = parse_wan("rtt=16.6ms,bw=1gbit,sites=2,jitter=1ms")
    assert topo.sites == 2
    assert topo.inter_link.rtt_s == pytest.approx(16.6 * MS)
    assert topo.inter_link.bandwidth_bps == pytest.approx(1e9)
    assert topo.inter_link.jitter_s == pytest.approx(1 * MS)
    assert topo.intra_link == LAN_LINK  # inside a site: the LAN


def test_a_bare_link_joins_every_pair_of_ranks():
    topo = parse_wan("rtt=50ms,bw=800mbit")
    assert topo.sites == 1 and topo.intra_link == topo.inter_link == Link(50 * MS, 800e6)


def test_a_preset_takes_overrides():
    topo = parse_wan("two-site,bw=1gbit,jitter=2ms")
    assert topo.inter_link == Link(16.6 * MS, 1e9, 2 * MS) and topo.sites == 2


def test_the_link_inside_a_worker_is_the_sites_unless_the_spec_names_one():
    assert PRESETS["cross-region"].inside_worker == LAN_LINK and PRESETS["cross-region"].worker_link is None
    assert parse_wan("cross-region,worker=site") == replace(PRESETS["cross-region"], name="cross-region,worker=site")
    nvlink = parse_wan("cross-region,worker=nvlink")
    assert nvlink.inside_worker == NVLINK and nvlink.inter_link == PRESETS["cross-region"].inter_link
    custom = parse_wan("rtt=50ms,bw=1gbit,sites=2,worker=50us/100gbit")
    assert custom.inside_worker == Link(parse_time("50us"), 100e9) and custom.intra_link == LAN_LINK
    assert "inside a worker RTT 0.01 ms, 3200 Gbit/s" in nvlink.describe()
    with pytest.raises(ConfigError, match="worker='pcie': expected site, nvlink or RTT/BW"):
        parse_wan("lan,worker=pcie")
    with pytest.raises(ConfigError, match="missing rtt and bw"):
        parse_wan("worker=nvlink")


def test_a_group_inside_one_worker_runs_on_the_worker_link_and_its_hops_across_workers_do_not():
    topo = replace(parse_wan("two-site,worker=nvlink"), ranks_per_worker=2)  # 2 workers of 2 ranks
    lan = replace(PRESETS["two-site"], ranks_per_worker=2)
    inside = [collective_duration("allgather", 1e6, 4, t, [0, 1]) for t in (topo, lan)]
    assert inside[0] < inside[1] / 10
    # one rank per worker: no hop inside a worker, the same links either way
    assert collective_duration("allreduce", 1e6, 4, topo, [0, 2]) == collective_duration(
        "allreduce", 1e6, 4, lan, [0, 2]
    )
    # every rank: the ring's hops 0->1 and 2->3 are inside a worker (NVLink, not the site's LAN), 1->2
    # and 3->0 cross the sites, which pace the ring: NVLink saves a little latency, nothing more
    every = [collective_duration("allreduce", 1e6, 4, t) for t in (topo, lan)]
    assert every[0] < every[1] < every[0] * 1.05


@pytest.mark.parametrize(
    "text, seconds", [("16.6ms", 0.0166), ("2s", 2.0), ("250us", 250e-6), ("0ms", 0.0), ("1e2 ms", 0.1)]
)
def test_time_units(text, seconds):
    assert parse_time(text) == pytest.approx(seconds)


@pytest.mark.parametrize(
    "text, bps",
    [
        ("1gbit", 1e9),
        ("800mbit", 800e6),
        ("10gbps", 10e9),
        ("100kbit", 1e5),
        ("5bit", 5.0),
        ("125MB/s", 1e9),
        ("1GB/s", 8e9),
        ("2kB/s", 16e3),
        ("1.5Gbit", 1.5e9),
    ],
)
def test_rate_units(text, bps):
    assert parse_rate(text) == pytest.approx(bps)


@pytest.mark.parametrize(
    "text",
    [
        "",
        "nowhere",
        "rtt=16.6ms",
        "bw=1gbit",
        "rtt=16.6,bw=1gbit",
        "rtt=16.6ms,bw=1",
        "rtt=16.6ms,bw=0gbit",
        "rtt=-1ms,bw=1gbit",
        "rtt=1ms,bw=-5mbit",
        "rtt=1ms,bw=1gbit,color=red",
        "rtt=1ms,bw=1gbit,sites=0",
        "rtt=1ms,bw=1gbit,sites=1.5",
        "rtt=1ms,,bw=1gbit",
        "rtt=1ms,bw",
        "rtt=1ms,rtt=2ms,bw=1gbit",
        "two-site,bw=1mb/s",
        "lan,jitter=-1ms",
    ],
)
def test_bad_specs_are_one_line_config_errors(text):
    with pytest.raises(ConfigError) as err:
        parse_wan(text)
    assert "\n" not in str(err.value) and str(err.value)


def test_links_reject_impossible_values():
    with pytest.raises(ConfigError):
        Link(rtt_s=1e-3, bandwidth_bps=0)
    with pytest.raises(ConfigError):
        Link(rtt_s=-1e-3, bandwidth_bps=1e9)
    with pytest.raises(ConfigError):
        Topology(sites=0)


def test_ranks_spread_evenly_over_sites():
    topo = Topology(sites=2)
    assert [topo.site_of(r, 4) for r in range(4)] == [0, 0, 1, 1]
    assert [topo.site_of(r, 3) for r in range(3)] == [0, 0, 1]
    assert [Topology(sites=3).site_of(r, 6) for r in range(6)] == [0, 0, 1, 1, 2, 2]


def test_sites_get_whole_workers():
    # 3 workers of 2 ranks on 2 sites: workers 0, 1 in site 0, worker 2 in site 1 (rank by rank,
    # rank 3 of worker 1 would have gone to site 1)
    topo = Topology(sites=2, ranks_per_worker=2)
    assert [topo.site_of(r, 6) for r in range(6)] == [0, 0, 0, 0, 1, 1]
    assert [Topology(sites=2).site_of(r, 6) for r in range(6)] == [0, 0, 0, 1, 1, 1]
    assert [topo.site_of(r, 4) for r in range(4)] == [0, 0, 1, 1]
    assert [Topology(sites=2, ranks_per_worker=4).site_of(r, 4) for r in range(4)] == [0, 0, 0, 0]


def test_ranks_per_worker_is_checked_and_named_in_the_description():
    for bad in (0, -1, 1.5):
        with pytest.raises(ConfigError):
            Topology(sites=2, ranks_per_worker=bad)
    with pytest.raises(ConfigError, match="multiple"):
        Topology(sites=2, ranks_per_worker=2).site_of(0, 3)
    cross = PRESETS["cross-region"]
    assert replace(cross, ranks_per_worker=1).describe() == cross.describe()
    assert "2 ranks per worker" in replace(cross, ranks_per_worker=2).describe()
    assert parse_wan("cross-region").ranks_per_worker == 1


# -- cost model, by hand ------------------------------------------------------------------------

# A line's payload share at MTU 1500: (1500 - 52 bytes of IP and TCP headers) / (1500 + 14 of Ethernet),
# and in a ring, whose lines also carry a 66-byte acknowledgement per segment of the flow coming back,
# 1448 / (1514 + 66)
F, F_RING = 1448 / 1514, 1448 / 1580
B10G, B1G = 1.25e9 * F_RING, 1.25e8 * F_RING  # payload bytes/s of a ring's phase on a 10 and a 1 Gbit/s line
O10G, O1G = 1.25e9 * F, 1.25e8 * F  # the same one way (a broadcast's tree, send/recv)
TWO_SITE = PRESETS["two-site"]  # inter: a = 8.3 ms, b = B10G; intra: a = 0.1 ms, b = B10G


def test_the_bandwidth_is_the_line_rate_and_tcp_moves_its_framed_share():
    assert Link(0.0, 1e9).bytes_per_s == pytest.approx(1.25e8 * 0.9564, rel=1e-4)  # 956 Mbit/s of payload
    assert Link(0.0, 1e9).ring_bytes_per_s == pytest.approx(1.25e8 * 0.9165, rel=1e-4)  # and the ACKs coming back
    assert Link(0.0, 1e9, mtu=9000).payload_share == pytest.approx(8948 / 9014)  # jumbo frames: 99.3 %
    assert parse_wan("rtt=1ms,bw=1gbit,mtu=9000").inter_link.mtu == 9000
    for bad in ("mtu=12", "mtu=big"):
        with pytest.raises(ConfigError, match="mtu"):
            parse_wan(f"rtt=1ms,bw=1gbit,{bad}")


def test_two_ranks_across_two_sites_is_one_ring_over_the_wan():
    # AR(2, 1 MB, inter) = 2·8.3 ms + 2·(1/2)·1e6/B10G s = 16.6 ms + 0.87 ms
    assert collective_duration("allreduce", 1e6, 2, TWO_SITE) == pytest.approx(16.6 * MS + 1e6 / B10G)
    assert collective_duration("allreduce", 1e6, 2, TWO_SITE) == pytest.approx(17.47 * MS, abs=0.01 * MS)


def test_one_site_is_the_plain_ring():
    # AR(4, 1 MB, lan) = 2·3·0.1 ms + 2·(3/4)·1e6/O10G s = 0.6 ms + 1.25 ms: each rank's line carries its
    # data one way (to the rank before it), the acknowledgements come back on a line that carries none
    assert collective_duration("allreduce", 1e6, 4, PRESETS["lan"]) == pytest.approx(0.6 * MS + 1.5e6 / O10G)
    # two ranks: each line carries one hop's data and the other's acknowledgements
    assert collective_duration("allreduce", 1e6, 2, PRESETS["lan"]) == pytest.approx(0.2 * MS + 1e6 / B10G)


def test_eight_ranks_on_two_sites_are_one_flat_ring_crossing_the_sites_twice():
    # ranks 0-3 in one site, 4-7 in the other; the ring's hops 4->3 and 0->7 cross (the link's two
    # directions: each line also carries the other's acknowledgements), the other six stay inside.
    # Each of the 2·7 steps moves B/8 per hop: a crossing hop carries 14 of them at B10G, and a chain
    # of hops pays the WAN's latency on each crossing it passes (at least one, at most every step)
    b = 100e6
    ar = collective_duration("allreduce", b, 8, TWO_SITE)
    assert 14 * b / 8 / B10G + 8.3 * MS < ar < 14 * (b / 8 / B10G + 8.3 * MS)
    rs = collective_duration("reduce_scatter", b, 8, TWO_SITE)
    assert rs == pytest.approx(collective_duration("allgather", b, 8, TWO_SITE))
    assert 7 * b / 8 / B10G + 8.3 * MS < rs < 7 * (b / 8 / B10G + 8.3 * MS)


def test_a_ring_of_identical_hops_is_the_textbook_ring():
    # one site of 4: AR(4, B, lan) = 2·3·a + 2·3/4·B/b, and the same over four sites of one rank each
    for topo in (PRESETS["lan"], parse_wan("rtt=0.2ms,bw=10gbit,sites=4")):
        assert collective_duration("allreduce", 1e6, 4, topo) == pytest.approx(6 * 0.1 * MS + 1.5e6 / O10G)
        assert collective_duration("allgather", 1e6, 4, topo) == pytest.approx(3 * 0.1 * MS + 0.75e6 / O10G)


def test_a_ring_is_paced_by_its_slowest_hop():
    from wansync.net.cost import _Hop, ring_phase

    fast, slow = Link(2 * MS, 1e9), Link(40 * MS, 100e6)
    b_fast, b_slow = fast.bytes_per_s, slow.bytes_per_s  # one way: no flow back on their lines
    chunk = 1e6
    # three hops, one slow: 2 steps (a reduce-scatter over 3): every chunk crosses the slow hop in turn
    # (2·chunk at its rate), and a chain of 2 hops pays its latency once
    t = ring_phase(2, chunk, [_Hop(fast, 1), _Hop(fast, 1), _Hop(slow, 1)])
    assert t >= 2 * chunk / b_slow + slow.latency_s
    assert t == pytest.approx(slow.latency_s + chunk / b_slow + max(chunk / b_slow, fast.latency_s + chunk / b_fast))
    # a hop shared by two flows moves at half its rate
    shared = ring_phase(1, chunk, [_Hop(fast, 1), _Hop(slow, 2)])
    assert shared == pytest.approx(slow.latency_s + 2 * chunk / b_slow)


def test_broadcast_barrier_and_point_to_point():
    # a binomial tree from rank 0: 0->4 crosses the sites, then 0->2, 4->6, then 0->1, 2->3, ... inside:
    # 1·(8.3 ms + 1e6/O10G) + 2·(0.1 ms + 1e6/O10G)
    assert collective_duration("broadcast", 1e6, 8, TWO_SITE) == pytest.approx(8.5 * MS + 3e6 / O10G)
    # barrier: latency only, the ring's 2·7 steps over a chain that crosses the WAN twice per phase
    assert collective_duration("barrier", 0, 8, TWO_SITE) == pytest.approx(2 * (2 * 8.3 * MS + 5 * 0.1 * MS))
    # send across sites: 8.3 ms + 1e6/O10G
    assert collective_duration("send", 1e6, 8, TWO_SITE, ranks=[0, 4]) == pytest.approx(8.3 * MS + 1e6 / O10G)


def test_a_group_inside_one_site_never_touches_the_wan():
    assert collective_duration("allreduce", 1e6, 8, TWO_SITE, ranks=[0, 1]) == pytest.approx(
        collective_duration("allreduce", 1e6, 2, PRESETS["lan"])
    )


# -- the site's uplink is shared ---------------------------------------------------------------------

CROSS_R2 = replace(PRESETS["cross-region"], ranks_per_worker=2)  # inter: a = 50 ms, b = B1G
MODEL = 10e6  # bytes
ACROSS = 100 * MS + MODEL / B1G  # the model all-reduced by one rank per site: 100 ms + 87.3 ms


def test_one_rank_per_site_is_the_ring_over_the_uplink_as_before():
    # AR(2, 10 MB, inter) = 2·50 ms + 2·(1/2)·1e7/B1G s = 100 ms + 87.3 ms
    assert collective_duration("allreduce", MODEL, 2, PRESETS["cross-region"]) == pytest.approx(ACROSS)


def test_parallel_cross_worker_groups_share_the_uplink_like_one_rank_sending_the_model():
    # 2 workers of 2 ranks, one per site; {0, 2} and {1, 3} each all-reduce half the model at once:
    # 2·50 ms + 2·(1/2)·2·5e6/B1G s = 100 ms + 87.3 ms (per-rank links would have said 100 + 43.6 ms)
    for group in ([0, 2], [1, 3]):
        half = collective_duration("allreduce", MODEL / 2, 4, CROSS_R2, ranks=group, parallel=2)
        assert half == pytest.approx(ACROSS)
    whole = collective_duration("allreduce", MODEL, 2, PRESETS["cross-region"])
    assert collective_duration("allreduce", MODEL / 2, 4, CROSS_R2, [0, 2], parallel=2) == pytest.approx(whole)
    alone = collective_duration("allreduce", MODEL / 2, 4, CROSS_R2, [0, 2])
    assert alone == pytest.approx(100 * MS + MODEL / 2 / B1G)


def test_all_ranks_of_two_sites_all_reducing_flat_cross_the_uplink_on_every_step():
    # 2 workers of 2 ranks, one per site: the ring 0->1->2->3->0 crosses at 1->2 and 3->0, each step
    # moving B/4 over the 1 Gbit/s link: 2·3 steps of 2.5 MB = 1.5·B over it, more than one rank
    # all-reducing the whole model across (B): the hierarchical all-reduce (inside, across, back) wins
    from wansync.net.cost import allreduce_algorithm, hierarchical_seconds

    flat = collective_duration("allreduce", MODEL, 4, CROSS_R2)
    chunk = MODEL / 4 / B1G
    # pipelined, not in lockstep: at least every chunk over a crossing hop and a chain of 6 steps
    # crossing the WAN every other hop (3 latencies), at most 6 steps of both
    assert max(6 * chunk + 50 * MS, 3 * (50 * MS + chunk)) < flat < 6 * (chunk + 50 * MS)
    hier = hierarchical_seconds(MODEL, 4, CROSS_R2)
    inside = 2 * 0.1 * MS + MODEL / B10G  # AR(2, B, lan)
    back = 0.1 * MS + MODEL / O10G  # a broadcast inside
    assert hier == pytest.approx(inside + ACROSS + back)
    assert allreduce_algorithm(MODEL, 4, CROSS_R2) == "hierarchical"
    assert allreduce_algorithm(MODEL, 4, CROSS_R2, [0, 2]) == "flat"  # one rank per site: nothing to gain
    rs_across = 50 * MS + 0.5 * MODEL / B1G
    assert collective_duration("allgather", MODEL / 2, 4, CROSS_R2, [0, 2], parallel=2) == pytest.approx(rs_across)


def test_broadcast_and_point_to_point_share_the_uplink_only_with_parallel_copies():
    # one rank per site crosses, one way: 50 ms + p·1e7/O1G s (+ 0.1 ms + 1e7/O10G inside a site of 2)
    inside = 0.1 * MS + MODEL / O10G
    assert collective_duration("broadcast", MODEL, 4, CROSS_R2) == pytest.approx(50 * MS + MODEL / O1G + inside)
    assert collective_duration("broadcast", MODEL, 4, CROSS_R2, [0, 2], parallel=2) == pytest.approx(
        50 * MS + 2 * MODEL / O1G
    )
    sent = collective_duration("send", MODEL, 4, CROSS_R2, [0, 2], parallel=2)
    assert sent == pytest.approx(50 * MS + 2 * MODEL / O1G)
    assert collective_duration("send", MODEL, 4, CROSS_R2, [0, 1], parallel=2) == pytest.approx(inside)
    assert collective_duration("barrier", 0, 4, CROSS_R2, [0, 2], parallel=2) == pytest.approx(100 * MS)


def test_parallel_copies_inside_one_site_never_touch_the_uplink():
    assert collective_duration("allreduce", MODEL, 4, CROSS_R2, [0, 1], parallel=2) == pytest.approx(
        collective_duration("allreduce", MODEL, 2, PRESETS["lan"])
    )
    with pytest.raises(ConfigError):
        collective_duration("allreduce", MODEL, 4, CROSS_R2, parallel=0)


def test_one_rank_costs_nothing_and_names_are_checked():
    assert collective_duration("allreduce", 1e9, 1, PRESETS["cross-continent"]) == 0.0
    assert collective_duration("all_reduce", 1e6, 2, TWO_SITE) == collective_duration("allreduce", 1e6, 2, TWO_SITE)
    with pytest.raises(ConfigError):
        collective_duration("teleport", 1, 2, TWO_SITE)


def test_jitter_is_shared_by_seed_group_and_sequence_number():
    topo = parse_wan("rtt=100ms,bw=1gbit,jitter=10ms")
    draws = [jitter_draw(topo, 2, seed=5, group_key=0, seq=i) for i in range(2000)]
    assert draws[:20] == [jitter_draw(topo, 2, seed=5, group_key=0, seq=i) for i in range(20)]
    assert draws[:20] != [jitter_draw(topo, 2, seed=6, group_key=0, seq=i) for i in range(20)]
    assert min(draws) >= 0
    assert sum(draws) / len(draws) == pytest.approx(0.01 * math.sqrt(2 / math.pi), rel=0.1)  # half-normal
    assert jitter_draw(PRESETS["two-site"], 2, seed=5, group_key=0, seq=3) == 0.0
