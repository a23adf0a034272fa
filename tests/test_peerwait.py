"""Peer wait: the part of a rank's exposed communication spent waiting for later-arriving peers,
from durations on each rank's own clock (the last rank to arrive at an exchange waits for no one)."""

from __future__ import annotations

import json

import pytest

from wansync.telemetry.peerwait import PROFILE, peer_waits, record


def profile(exposed: dict[int, float], compute: float = 1.0, wall: float = 2.0) -> dict:
    return {
        "wall_clock_s": wall,
        "categories_s": {"compute": compute, "exposed_comm": sum(exposed.values())},
        "derived": {"exposed_comm_pct": 100 * sum(exposed.values()) / wall},
        "events": [{"step": s, "exposed_s": e} for s, e in exposed.items()],
    }


def test_ranks_taking_turns_to_arrive_late_each_wait_beyond_the_last_arrivers_time():
    waits = peer_waits({0: profile({5: 0.5, 10: 0.1}), 1: profile({5: 0.1, 10: 0.3})})
    assert waits == pytest.approx({0: 0.4, 1: 0.2})


def test_identical_ranks_wait_for_no_one():
    same = {5: 0.2, 10: 0.25}
    assert peer_waits({0: profile(same), 1: profile(same), 2: profile(same)}) == {0: 0.0, 1: 0.0, 2: 0.0}


def test_only_steps_every_rank_exchanged_at_count():
    waits = peer_waits({0: profile({5: 0.5, 7: 9.0}), 1: profile({5: 0.2}), 2: profile({5: 0.3, 7: 0.0})})
    assert waits == pytest.approx({0: 0.3, 1: 0.0, 2: 0.1})
    assert peer_waits({0: profile({5: 0.5})}) is None  # one rank: nothing to compare
    assert peer_waits({0: profile({5: 0.5}), 1: profile({6: 0.5})}) is None  # no exchange in common


def test_the_launcher_adds_every_ranks_split_to_profile_json(tmp_path):
    logs = tmp_path / "logs"
    logs.mkdir()
    ranks = [profile({5: 0.5, 10: 0.1}, compute=1.0), profile({5: 0.1, 10: 0.3}, compute=1.2)]
    (tmp_path / "profile.json").write_text(json.dumps(ranks[0]))
    for r, p in enumerate(ranks):
        (logs / PROFILE.format(r)).write_text(json.dumps(p))
    record(tmp_path, logs, world=2)
    out = json.loads((tmp_path / "profile.json").read_text())
    assert out["derived"]["peer_wait_s"] == pytest.approx(0.4)
    assert out["derived"]["peer_wait_pct"] == pytest.approx(20.0)
    assert [(r["rank"], r["compute_s"]) for r in out["ranks"]] == [(0, 1.0), (1, 1.2)]
    assert [r["peer_wait_s"] for r in out["ranks"]] == pytest.approx([0.4, 0.2])


def test_without_every_ranks_profile_nothing_is_added(tmp_path):
    logs = tmp_path / "logs"
    logs.mkdir()
    (tmp_path / "profile.json").write_text(json.dumps(profile({5: 0.5})))
    (logs / PROFILE.format(0)).write_text(json.dumps(profile({5: 0.5})))
    before = (tmp_path / "profile.json").read_text()
    record(tmp_path, logs, world=2)
    assert (tmp_path / "profile.json").read_text() == before


def test_an_unreadable_ranks_profile_leaves_profile_json_as_rank_0_wrote_it(tmp_path):
    logs = tmp_path / "logs"
    logs.mkdir()
    (tmp_path / "profile.json").write_text(json.dumps(profile({5: 0.5})))
    (logs / PROFILE.format(0)).write_text(json.dumps(profile({5: 0.5})))
    (logs / PROFILE.format(1)).write_text('{"events": [')  # cut off mid-write
    before = (tmp_path / "profile.json").read_text()
    record(tmp_path, logs, world=2)
    assert (tmp_path / "profile.json").read_text() == before
