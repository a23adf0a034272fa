"""Links, presets, the --wan spec string, and the cost model's numbers worked out by hand."""

from __future__ import annotations

import math

import pytest

from wansync.errors import ConfigError
from wansync.net import PRESETS, Link, Topology, collective_duration, jitter_draw, parse_wan
from wansync.net.link import LAN_LINK, parse_rate, parse_time

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


@pytest.mark.parametrize(
    "text, seconds", [("16.6ms", 0.0166), ("2s", 2.0), ("250us", 250e-6), ("0ms", 0.0), ("1e2 ms", 0.1)]
)
def test_time_units(text, seconds):
    assert parse_time(text) == pytest.approx(seconds)


@pytest.mark.parametrize(
    "text, bps",
    [("1gbit", 1e9), ("800mbit", 800e6), ("10gbps", 10e9), ("100kbit", 1e5), ("5bit", 5.0),
     ("125MB/s", 1e9), ("1GB/s", 8e9), ("2kB/s", 16e3), ("1.5Gbit", 1.5e9)],
)
def test_rate_units(text, bps):
    assert parse_rate(text) == pytest.approx(bps)


@pytest.mark.parametrize(
    "text",
    [
        "", "nowhere", "rtt=16.6ms", "bw=1gbit", "rtt=16.6,bw=1gbit", "rtt=16.6ms,bw=1",
        "rtt=16.6ms,bw=0gbit", "rtt=-1ms,bw=1gbit", "rtt=1ms,bw=-5mbit", "rtt=1ms,bw=1gbit,color=red",
        "rtt=1ms,bw=1gbit,sites=0", "rtt=1ms,bw=1gbit,sites=1.5", "rtt=1ms,,bw=1gbit", "rtt=1ms,bw",
        "rtt=1ms,rtt=2ms,bw=1gbit", "two-site,bw=1mb/s", "lan,jitter=-1ms",
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


# -- cost model, by hand ------------------------------------------------------------------------

TWO_SITE = PRESETS["two-site"]  # inter: a = 8.3 ms, b = 1.25e9 B/s; intra: a = 0.1 ms, b = 1.25e9 B/s


def test_two_ranks_across_two_sites_is_one_ring_over_the_wan():
    # AR(2, 1 MB, inter) = 2·8.3 ms + 2·(1/2)·1e6/1.25e9 s = 16.6 ms + 0.8 ms
    assert collective_duration("allreduce", 1e6, 2, TWO_SITE) == pytest.approx(17.4 * MS)


def test_one_site_is_the_plain_ring():
    # AR(4, 1 MB, lan) = 2·3·0.1 ms + 2·(3/4)·1e6/1.25e9 s = 0.6 ms + 1.2 ms
    assert collective_duration("allreduce", 1e6, 4, PRESETS["lan"]) == pytest.approx(1.8 * MS)


def test_eight_ranks_on_two_sites_are_hierarchical():
    b = 100e6  # 4 ranks per site
    rs_intra = 3 * 0.1 * MS + 0.75 * b / 1.25e9  # 60.3 ms
    ar_inter = 2 * 8.3 * MS + 2 * 0.5 * (b / 4) / 1.25e9  # 36.6 ms
    rs_inter = 8.3 * MS + 0.5 * (b / 4) / 1.25e9  # 18.3 ms
    assert collective_duration("allreduce", b, 8, TWO_SITE) == pytest.approx(rs_intra + ar_inter + rs_intra)
    assert collective_duration("allreduce", b, 8, TWO_SITE) == pytest.approx(157.2 * MS)
    assert collective_duration("reduce_scatter", b, 8, TWO_SITE) == pytest.approx(rs_intra + rs_inter)
    assert collective_duration("allgather", b, 8, TWO_SITE) == pytest.approx(78.6 * MS)
    total = sum(collective_duration(op, b, 8, TWO_SITE) for op in ("reduce_scatter", "allgather"))
    assert total == pytest.approx(collective_duration("allreduce", b, 8, TWO_SITE))  # AR = RS + AG


def test_broadcast_barrier_and_point_to_point():
    # broadcast: 1·(8.3 ms + 0.8 ms) across sites + ceil(log2 4)=2·(0.1 ms + 0.8 ms) inside
    assert collective_duration("broadcast", 1e6, 8, TWO_SITE) == pytest.approx(10.9 * MS)
    # barrier: latency only, 2·3·0.1 ms + 2·1·8.3 ms
    assert collective_duration("barrier", 0, 8, TWO_SITE) == pytest.approx(17.2 * MS)
    # send across sites: 8.3 ms + 0.8 ms
    assert collective_duration("send", 1e6, 8, TWO_SITE, ranks=[0, 4]) == pytest.approx(9.1 * MS)


def test_a_group_inside_one_site_never_touches_the_wan():
    assert collective_duration("allreduce", 1e6, 8, TWO_SITE, ranks=[0, 1]) == pytest.approx(
        collective_duration("allreduce", 1e6, 2, PRESETS["lan"])
    )


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
