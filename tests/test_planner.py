"""The planner predicts from the strategies' real schedules: for the same knobs, the transfers it
plans (which step, which purpose, which fragment, how many bytes, when waited for) are the ones the
strategy makes on a real 2-rank gloo group. No timing is asserted."""

from __future__ import annotations

import dataclasses
import json
from collections import Counter
from typing import Any

import pytest
import torch
from torch import nn

import wansync as ws
from wansync.errors import ConfigError
from wansync.runner.localgroup import run_ranks
from wansync.net.wan import PRESETS
from wansync.planner import of_params, predict, setting
from wansync.planner.schedule import trace
from wansync.planner.sizes import ddp_buckets, flops_step_s, of_module
from wansync.strategies import STRATEGIES

from strategy_harness import deep_model as model

pytestmark = pytest.mark.timeout(300)

STEPS = 13
CASES: list[tuple[str, dict[str, Any]]] = [
    ("ddp", {}),
    ("local_sgd", {"sync_every": 3, "sync_optimizer_state": True}),
    ("slowmo", {"sync_every": 4}),
    ("cpdp", {"sync_every": 3}),
    ("post_local_sgd", {"switch_step": 4, "sync_every": 3}),
    ("diloco", {"sync_every": 5, "drift_telemetry": False}),
    ("diloco", {"sync_every": 5, "overlap_rounds": True, "codec": "int8", "codec_collective": "reduce_scatter"}),
    ("streaming", {"sync_every": 6, "fragments": 3, "overlap": 2, "codec": "int8"}),
    ("streaming", {"sync_every": 4, "fragments": 2, "overlap": 3, "syncs_per_period": 4}),
    ("cocodc", {"sync_every": 6, "fragments": 2, "overlap": 1, "syncs_per_period": 4, "schedule": "round_robin"}),
    ("sparseloco", {"sync_every": 4}),
    ("sparseloco", {"sync_every": 4, "overlap_rounds": True}),
    ("sparseloco", {"sync_every": 3, "chunk": 4, "density": 0.25, "bits": 4, "dct": True}),
    ("demo", {"chunk": 8, "topk": 5}),
]


def _ledger(sync: Any) -> Counter:
    return Counter({k: v["bytes"] for k, v in sync.comm.snapshot().items() if k != "init"})


def run_cases(rank: int, world: int) -> list[dict[str, Any]]:
    out = []
    for name, options in CASES:
        m = model()
        opt = (torch.optim.SGD if name == "demo" else torch.optim.AdamW)(m.parameters(), lr=1e-2)  # demo: a carrier
        sync = ws.strategy(name, m, opt, **options)
        events: list[dict[str, Any]] = []
        sync.on_event(events.append)
        per_step, before = [], _ledger(sync)
        for step in range(STEPS):
            g = torch.Generator().manual_seed(97 * rank + step)
            nn.functional.mse_loss(
                sync.model(torch.randn(8, 6, generator=g)), torch.randn(8, 3, generator=g)
            ).backward()
            sync.step()
            sync.zero_grad()
            now = _ledger(sync)
            per_step.append(dict(now - before))
            before = now
        sync.finish()
        finish = dict(_ledger(sync) - before)
        frags = sorted(
            (e["started"], e["fragment"], e["bytes"], e["step"])
            for e in events
            if e["type"] == "sync" and e.get("kind") == "fragment"
        )
        finals = sorted((e["fragment"], e["bytes"]) for e in events if e["type"] == "sync" and e.get("kind") == "final")
        out.append({"per_step": per_step, "finish": finish, "fragments": frags, "finals": finals})
    return out


@pytest.fixture(scope="module")
def measured() -> list[dict[str, Any]]:
    return run_ranks(run_cases, 2)[0]


def planned(name: str, options: dict[str, Any]) -> dict[str, Any]:
    tr = trace(name, options, of_module("test", model()), 2, STEPS, finish=True)

    def payloads(actions) -> dict[str, int]:
        c = Counter()
        for a in actions:
            if a.kind in ("issue", "book"):
                c[a.transfer.purpose] += a.transfer.payload
        return dict(+c)

    waited = {id(a.transfer): t for t, acts in enumerate(tr.steps, 1) for a in acts if a.kind == "wait"}
    frags = sorted(
        (a.transfer.step, a.transfer.fragment, a.transfer.payload, waited.get(id(a.transfer), STEPS))
        for acts in tr.steps
        for a in acts
        if a.kind == "issue" and a.transfer.fragment is not None
    )
    finals = sorted(
        (a.transfer.fragment, a.transfer.payload)
        for a in tr.finish
        if a.kind == "issue" and a.transfer.fragment is not None
    )
    return {
        "per_step": [payloads(acts) for acts in tr.steps],
        "finish": payloads(tr.finish),
        "fragments": frags,
        "finals": finals,
    }


def test_every_strategy_has_a_case():
    """async_diloco makes no collectives: its learners' messages to the syncer, planned by
    `planner/asynchronous.py`, are held to the strategy's own in tests/test_plan_async.py."""
    assert {name for name, _ in CASES} == set(STRATEGIES) - {"async_diloco"}


@pytest.mark.parametrize("case", range(len(CASES)), ids=[f"{n}-{i}" for i, (n, _) in enumerate(CASES)])
def test_the_planned_transfers_are_the_ones_the_strategy_makes(measured, case):
    name, options = CASES[case]
    got, want = measured[case], planned(name, options)
    assert got["per_step"] == want["per_step"]  # every step's bytes, by purpose
    assert got["fragments"] == want["fragments"]  # (start step, fragment, bytes, merge step)
    assert got["finals"] == want["finals"]
    assert got["finish"] == want["finish"]


def test_ddp_buckets_close_at_their_caps_in_backward_order():
    assert ddp_buckets([10, 20, 30], first_cap=100, cap=100) == [120, 120]  # bytes: 4 per element
    assert ddp_buckets([5, 1, 300_000], first_cap=8, cap=100) == [1_200_000, 24]


def test_the_flops_rule_is_six_n_tokens_over_throughput():
    assert flops_step_s(1e9, tokens=1e6, accelerators=2, flops=3e14) == pytest.approx(6e15 / 6e14)


def test_a_longer_period_exposes_no_more_communication():
    base = dict(size=of_params(1e9), workers=8, topology=PRESETS["cross-region"], step_s=0.5)
    pcts = [predict(setting("diloco", {"sync_every": h}, **base)).exposed_pct for h in (1, 10, 100)]
    assert pcts[0] >= pcts[1] >= pcts[2]


def test_an_exchange_sharded_over_a_workers_ranks_moves_the_whole_model_over_the_uplink():
    from wansync.net import Topology, collective_duration
    from wansync.planner.schedule import Transfer
    from wansync.net import NVLINK
    from wansync.planner.simulate import transfer_seconds

    link, b = dataclasses.replace(PRESETS["cross-region"], worker_link=NVLINK), 10_000_000
    exchange = Transfer(0, "params", "allreduce", b, b)
    in_worker = Topology(sites=1, intra_link=NVLINK, inter_link=NVLINK)
    for r in (2, 4):  # R shards at once share the uplink: the across part is one rank sending B
        whole = collective_duration("allreduce", b, 2, link) + collective_duration("allgather", b, r, in_worker)
        assert transfer_seconds(link, 2, r)(exchange) == pytest.approx(whole)
    # 100 ms + 1e7 B at a ring's TCP payload rate of a 1 Gbit/s line (1.25e8 B/s x 1448/1580)
    assert transfer_seconds(link, 2, 1)(exchange) == pytest.approx(0.1 + 1e7 / (1.25e8 * 1448 / 1580))


def test_cocodc_picks_its_automatic_n_within_its_caps():
    base = dict(size=of_params(1e9), workers=8, topology=PRESETS["cross-region"], step_s=0.5, ranks_per_worker=8)
    n = predict(setting("cocodc", {}, **base)).syncs_per_period  # defaults: P = 4, c = 2, H = 100
    assert 4 <= n <= 8


def test_plan_rejects_a_missing_link():
    from wansync.config import build_config
    from wansync.planner import plan_command

    with pytest.raises(ConfigError, match="--wan"):
        plan_command(
            build_config(None, {}),
            params=1e6,
            step_s=0.1,
            measure=False,
            target_pct=None,
            tokens_per_step=None,
            flops=4e14,
        )


def test_plan_prints_one_screen_with_the_recommended_period(capsys):
    from wansync.cli import main

    with pytest.raises(SystemExit) as done:
        main(
            [
                "plan",
                "--model",
                "tiny",
                "--workers",
                "4",
                "--wan",
                "cross-region",
                "--strategy",
                "diloco",
                "--sync-every",
                "50",
                "--step-time",
                "0.3",
                "--target-exposed",
                "10",
            ]
        )
    out = capsys.readouterr().out
    assert done.value.code == 0
    assert "wall clock per 1000 steps" in out and "exposed communication" in out
    assert "smallest H (sync_every) with exposed communication <= 10 %" in out
    assert "stragglers: none (identical workers" in out


def _ddp_buckets_by_step(rank: int, world: int) -> list[list[int]]:
    """The byte sizes of the gradient buckets DDP's backward used in each of 3 steps (its reducer's)."""
    m = wide_model()
    sync = ws.strategy("ddp", m, torch.optim.SGD(m.parameters(), lr=1e-3))
    seen = []
    for step in range(3):
        g = torch.Generator().manual_seed(rank + step)
        sync.model(torch.randn(4, 512, generator=g)).sum().backward()  # a rebuild happens in forward
        seen.append([4 * b.buffer().numel() for b in sync.model.reducer._get_zeros_like_grad_buckets()])
        sync.step()
        sync.zero_grad()
    return seen


def wide_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(512, 2048),
        nn.Tanh(),
        nn.Linear(2048, 2048),
        nn.Tanh(),
        nn.Linear(2048, 2048),
        nn.Tanh(),
        nn.Linear(2048, 8),
    )


def test_the_planned_ddp_buckets_are_ddps_own_in_every_step():
    """DDP starts with every gradient in one bucket and rebuilds its buckets (1 MiB first, then
    25 MiB caps, in backward order) after the first backward; the planner's bucket transfers are
    the same, step by step (38 MB of gradients: one bucket, then two; not two 25 MiB ones at first)."""
    seen = run_ranks(_ddp_buckets_by_step, 2)[0]
    tr = trace("ddp", {}, of_module("wide", wide_model()), 2, 3)
    planned = [
        [a.transfer.payload for a in acts if a.kind == "issue" and a.transfer.purpose == "grads"] for acts in tr.steps
    ]
    assert planned == seen and len(seen[0]) == 1 and len(seen[1]) == 2


# -- replayed step times: workers that arrive apart ----------------------------------------------------


def test_replaying_identical_workers_predicts_what_identical_workers_do():
    base = dict(size=of_params(1e8), workers=4, topology=PRESETS["two-site"], step_s=0.2, other_s=0.01)
    for name in ("ddp", "local_sgd", "diloco", "streaming", "cocodc"):
        plain = predict(setting(name, {}, **base), steps=60, finish=True).timeline
        same = ((0.2, 0.01),) * 60
        replayed = predict(setting(name, {}, **base, step_times=(same,) * 4), steps=60, finish=True).timeline
        assert replayed.wall_s == pytest.approx(plain.wall_s, rel=1e-12), name
        assert replayed.exposed_s == pytest.approx(plain.exposed_s, rel=1e-12, abs=1e-12), name
        assert replayed.payload_bytes == plain.payload_bytes


def test_an_early_worker_waits_for_the_straggler_and_then_for_the_transfer():
    """As on the emulator: a transfer starts when its last member has issued it. Worker 1 computes
    0.05 s longer per step, so at each of diloco's exchanges (H = 5) worker 0 is blocked for 5 x 0.05 s
    plus the transfer itself."""
    from wansync.planner.prediction import run_trace, seconds_of

    s = setting("diloco", {"sync_every": 5}, of_params(1e7), 2, PRESETS["cross-region"], 0.1)
    transfer = sum(map(seconds_of(s), run_trace(s, 20).transfers())) / 4
    fast, slow = ((0.1, 0.0),) * 20, ((0.15, 0.0),) * 20
    tl = predict(dataclasses.replace(s, step_times=(fast, slow)), steps=20).timeline
    assert tl.exposed_s == pytest.approx(4 * (5 * 0.05 + transfer))
    assert tl.wall_s == pytest.approx(20 * 0.15 + 4 * transfer)  # the straggler sets the pace
    late = predict(dataclasses.replace(s, step_times=(slow, fast)), steps=20).timeline
    assert late.exposed_s == pytest.approx(4 * transfer)  # the last to arrive waits for no one


def test_plan_replays_a_runs_step_times_and_rejects_a_directory_without_them(tmp_path, capsys):
    from wansync.cli import main

    logs = tmp_path / "run" / "logs"
    logs.mkdir(parents=True)
    for rank, step in enumerate((0.1, 0.12)):
        (logs / f"profile_rank{rank}.json").write_text(
            json.dumps({"steps_s": {"compute": [step] * 10, "other": [0.001] * 10}})
        )
    flags = [
        "plan",
        "--model",
        "tiny",
        "--workers",
        "2",
        "--wan",
        "two-site",
        "--strategy",
        "diloco",
        "--sync-every",
        "5",
    ]
    with pytest.raises(SystemExit) as done:
        main([*flags, "--step-times", str(tmp_path / "run")])
    out = capsys.readouterr().out
    assert done.value.code == 0 and "2 rank(s), 10 steps each" in out and "stragglers: the run's, replayed" in out
    with pytest.raises(SystemExit) as done:
        main([*flags, "--step-times", str(tmp_path)])
    err = capsys.readouterr().err
    assert done.value.code != 0 and "no profile_rank0.json under" in err and "Traceback" not in err


def _fake_run(tmp_path, model: str, compute: list[float]) -> str:
    """A run directory as `wansync plan --step-times` reads it: its config and rank 0's step times."""
    import json

    run = tmp_path / f"run-{model}"
    (run / "logs").mkdir(parents=True)
    (run / "config.toml").write_text(f'[model]\nmodel = "{model}"\n')
    (run / "logs" / "profile_rank0.json").write_text(
        json.dumps({"steps_s": {"compute": compute, "other": [0.0] * len(compute)}})
    )
    return str(run)


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--params", "0"], "--params must be in [1, 1e+15], got 0.0"),
        (["--params", "-3"], "--params must be in [1, 1e+15], got -3.0"),
        (["--params", "nan"], "--params must be a finite number, got nan"),
        (["--params", "1e30"], "--params must be in [1, 1e+15], got 1e+30"),
        (["--throughput", "0"], "--throughput must be > 0, got 0.0"),
        (["--throughput=-4e14"], "--throughput must be > 0, got -400000000000000.0"),
        (["--target-exposed", "0"], "--target-exposed must be in (0, 100], got 0.0"),
        (["--target-exposed", "101"], "--target-exposed must be in (0, 100], got 101.0"),
        (["--step-time", "inf"], "--step-time must be a finite number, got inf"),
    ],
)
def test_plan_refuses_numbers_out_of_range_in_one_line(flags, message, capsys):
    from wansync.cli import main

    with pytest.raises(SystemExit) as e:
        main(["plan", "--strategy", "diloco", "--wan", "cross-region", *flags])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 1 and err == [f"wansync: error: {message}"]


def test_plan_refuses_replayed_times_it_cannot_trust_in_one_line(tmp_path, capsys):
    from wansync.cli import main

    cases = [
        (_fake_run(tmp_path, "micro", [0.1, -0.2]), ["--model", "micro"], "holds a step time of -0.2 s at step 2"),
        (
            _fake_run(tmp_path, "small", [0.1, 0.1]),
            ["--model", "micro"],
            "is a run of model 'small', this plan is for 'micro'",
        ),
    ]
    for run, flags, message in cases:
        with pytest.raises(SystemExit) as e:
            main(["plan", "--strategy", "diloco", "--wan", "cross-region", "--step-times", run, *flags])
        err = capsys.readouterr().err.strip().splitlines()
        assert e.value.code == 1 and len(err) == 1 and message in err[0], err


def test_the_planner_replays_intellect_1s_reported_utilization_within_a_point_from_its_files_alone():
    """INTELLECT-1's three sets of sites are topology files (arXiv:2412.01152; `--wan intellect-1-usa`, ...):
    on each file alone, the planner's int8 mean takes the reported all-reduce time and DiLoCo H = 100
    with int8 gives the reported compute utilization; an overlapped configuration gives more."""
    from wansync.net import parse_wan
    from wansync.planner.published import CONFIGS, REGIONS, all_reduce_seconds, predicted, utilization_pct

    label, strategy, options = CONFIGS[0]
    for region in REGIONS:
        topology = parse_wan(region.preset)
        assert topology.workers == 14 and topology.name == region.preset
        assert all_reduce_seconds(topology) == pytest.approx(region.all_reduce_s, rel=0.01)
        assert utilization_pct(predicted(topology, strategy, options)) == pytest.approx(region.utilization_pct, abs=1)
    best = dict((c[0], c) for c in CONFIGS)["Streaming DiLoCo H=100, P=4, τ=10, int8"]
    assert utilization_pct(predicted(parse_wan(REGIONS[-1].preset), best[1], best[2])) >= 95


def test_plan_on_the_intellect_1_file_from_the_command_line(capsys):
    """`wansync plan --wan intellect-1-global` with INTELLECT-1's setting prints its utilization."""
    from wansync.cli import main

    with pytest.raises(SystemExit) as e:
        main(
            [
                "plan",
                "--wan",
                "intellect-1-global",
                "--strategy",
                "diloco",
                "--sync-every",
                "100",
                "--codec",
                "int8",
                "--codec-collective",
                "reduce_scatter",
                "--params",
                "10e9",
                "--step-time",
                "22.8",
                "--workers",
                "14",
                "--ranks-per-worker",
                "8",
                "--inside",
                "fsdp",
            ]
        )
    out = capsys.readouterr().out
    assert e.value.code == 0, out
    assert "intellect-1-global" in out


def test_the_large_tables_summary_sentences_follow_from_its_rows():
    """The "Read:" lines under `plan --table` are computed from the rows: change a row and the
    sentence about it changes."""
    from wansync.planner.scale_table import TableRow, render_table, table_summary

    gb = 10**9
    rows = [
        TableRow("7B", 8, "lan", "ddp", 6.9, 7e3, 21.0, 28 * gb, 140 * gb, 28 * gb, ("fsdp",), None),
        TableRow("7B", 8, "cross-region", "ddp", 6.9, 9e4, 97.0, 28 * gb, 140 * gb, 28 * gb, ("fsdp",), None),
        TableRow("7B", 8, "cross-region", "diloco", 6.9, 7.5e3, 9.3, 280 * 10**6, 259 * gb, 30 * gb, ("fsdp",), 100),
        TableRow("7B", 64, "cross-continent", "diloco", 6.9, 9e3, 2.4, 280 * 10**6, 259 * gb, 30 * gb, ("fsdp",), 8),
    ]
    read = table_summary(rows)
    assert read[1] == (
        "- ddp: exposed 97.0 % across sites, 21.0 % on lan (most: 7B, 8 workers, cross-region); "
        "28 GB per worker per step."
    )
    assert read[2] == (
        "- diloco: exposed 2.4–9.3 % across sites (most: 7B, 8 workers, cross-region); smallest H for "
        "<= 10 %: 8–100; 280 MB per worker per step."
    )
    assert read[3] == (
        "- 7B on 80 GB: DDP inside fits in 0 of 4 rows (140 GB–259 GB per GPU), FSDP inside in 4 "
        "(28 GB–30 GB); every row fits one way or the other."
    )
    rows[3] = dataclasses.replace(rows[3], exposed_pct=62.6, smallest_h=None, mem_fsdp=90 * gb, fits=())
    changed = table_summary(rows)
    assert changed[2] == (
        "- diloco: exposed 9.3–62.6 % across sites (most: 7B, 64 workers, cross-continent); "
        "smallest H for <= 10 %: 100 (none up to 5000 in 1 of 2 rows); 280 MB per worker per step."
    )
    assert changed[3].endswith("FSDP inside in 3 (28 GB–90 GB); 1 of them fit neither way.")
    assert (
        "| 7B | 64 | cross-continent | diloco | 6.9 | 2.5 h | 62.6 | 280 MB | 259 GB | 90 GB | no | > 5000 |"
        in render_table(rows)
    )


@pytest.mark.parametrize(
    "argv, words",
    [
        (
            ["--intellect-1", "--gpu-memory", "24GB"],
            "plan --intellect-1 prints its own settings and would ignore --gpu-memory",
        ),
        (["--intellect-1", "--strategy", "ddp", "--params", "1e9"], "would ignore --params, --strategy: drop them"),
        (["--table", "--workers", "4"], "plan --table prints its own settings and would ignore --workers"),
        (["--table", "--gpu-memory", "80GB"], "would ignore --gpu-memory"),
        (["--intellect-1", "--table"], "--intellect-1 and --table are two tables"),
    ],
)
def test_a_flag_the_fixed_tables_would_ignore_is_refused(argv, words, capsys):
    from wansync.cli import main

    with pytest.raises(SystemExit) as e:
        main(["plan", *argv])
    err = capsys.readouterr().err
    assert e.value.code == 1 and words in err and err.count("\n") == 1, err


def test_plan_table_prints_each_row_as_it_is_predicted(monkeypatch, capsys):
    """`plan --table` took minutes in silence, then printed everything: now the count first (stderr),
    the head, each row as it comes, then the summary; the same text as the table `published` quotes."""
    from wansync.planner import scale_table as tables

    monkeypatch.setattr(tables, "TABLE_SIZES", tables.TABLE_SIZES[:1])
    monkeypatch.setattr(tables, "TABLE_WORKERS", tables.TABLE_WORKERS[:1])
    monkeypatch.setattr(tables, "PRESETS", {k: v for k, v in list(tables.PRESETS.items())[:2]})
    printed = []
    real_print = print

    def noting(*args, **kwargs):
        printed.append(" ".join(map(str, args)))
        real_print(*args, **kwargs)

    monkeypatch.setattr("builtins.print", noting)
    tables.print_large_table()
    out, err = capsys.readouterr()
    count = len(tables.TABLE_STRATEGIES) * 2
    assert err == f"plan --table: {count} settings, each row printed as it is predicted\n"
    assert out == tables.large_table() + "\n"
    assert len(printed) == 1 + 1 + count + 1  # the count, the head, a print a row, the summary
