"""`wansync plan --strategies`: the team's question ("7B model, 3 regions of 8 GPUs, 1 Gbit/s and 80 ms:
which strategy and settings?") answered in one call, each strategy at its best H and codec, ranked; the
tokens of a step that follow a bare size, the memory checked against a stated accelerator, whole-run
figures for `--steps`, and one line for each input it cannot use. The chosen settings held to emulated
runs: tests/test_planner_validation.py."""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import pytest

from wansync.errors import ConfigError
from wansync.net.wan import PRESETS, parse_wan
from wansync.planner import of_name, of_params, predict, setting
from wansync.planner.choose import CODECS, Choice, choose, rank
from wansync.planner.memory import DEFAULT_GPU_MEMORY
from wansync.planner.prediction import H_CANDIDATES, smallest_h, takes_h
from wansync.planner.sizes import flops_step_s, tokens_per_step
from wansync.units import human_bytes

pytestmark = pytest.mark.timeout(120)

#: the question: 3 regions, each a worker of 8 GPUs on NVLink, 1 Gbit/s and 80 ms between them
QUESTION = [
    "--params",
    "7e9",
    "--workers",
    "3",
    "--ranks-per-worker",
    "8",
    "--wan",
    "rtt=80ms,bw=1gbit,sites=3,worker=nvlink",
    "--precision",
    "bf16",
]
ROW = re.compile(
    r"^\| (\d+) \| (\w+) \| ([^|]*) \| ([\d.]+) % \| ([\d.]+) %[^|]* \| ([^|]+) \| ([^|]+) \| ([^|]+) \| (.+) \|$"
)


def plan(capsys: Any, *argv: str) -> tuple[int, str, str]:
    from wansync.cli import main

    with pytest.raises(SystemExit) as done:
        main(["plan", *argv])
    out, err = capsys.readouterr()
    return done.value.code, out, err


def table(out: str) -> list[tuple[str, ...]]:
    return [m.groups() for line in out.splitlines() if (m := ROW.match(line))]


def test_the_7b_question_in_one_call_gives_a_ranked_table(capsys):
    """Strategies of every kind (per step, periodic, fragments, sparse): one table, best first, each with
    the flags of its chosen setting; the assumptions it needed are printed above it."""
    names = ["ddp", "diloco", "streaming", "sparseloco", "local_sgd"]
    code, out, err = plan(capsys, "--strategies", ",".join(names), *QUESTION)
    assert code == 0, err
    rows = table(out)
    assert [int(r[0]) for r in rows] == list(range(1, len(names) + 1))
    assert sorted(r[1] for r in rows) == sorted(names)
    fitting = [float(r[3]) for r in rows if r[8] == "yes"]
    assert fitting == sorted(fitting, reverse=True) and len(fitting) == len(names)  # FSDP inside fits each
    assert rows[-1][1] == "ddp" and float(rows[-1][3]) < 5  # a 28 GB all-reduce every step: last
    assert all("--inside fsdp" in r[2] for r in rows)  # DDP inside holds the whole 7B model: it does not fit
    assert next(r for r in rows if r[1] == "diloco")[2].startswith("--sync-every ")
    assert "ranked by predicted utilization (compute alone / wall clock)" in out
    assert "524,288 tokens per worker step (assumed for --params: 32 sequences of 2,048 tokens per accelerator" in out
    assert f"GPU memory: {human_bytes(DEFAULT_GPU_MEMORY)} (the default" in out
    assert "figures: wall clock per 1000 steps (steady state" in out


def test_the_memory_check_needs_no_flag_to_flag_a_7b_model_held_whole_on_each_gpu(capsys):
    code, out, _ = plan(capsys, "--strategy", "diloco", *QUESTION)
    assert code == 0
    assert re.search(
        r"^does not fit on 80 GB \(the default; --gpu-memory SIZE for another\): 2\d\d GB per GPU", out, re.M
    )
    code, out, _ = plan(capsys, "--strategy", "diloco", *QUESTION, "--gpu-memory", "1TB")
    assert re.search(r"^fits on 1 TB: ", out, re.M)


def test_a_bare_size_takes_the_stated_tokens_per_step_unless_told():
    """R x 32 sequences of 2,048 tokens (the large table's rule); the named models' batch is per rank."""
    assert tokens_per_step(8, 16, 128, bare=True, given=set())[0] == 8 * 32 * 2048
    assert tokens_per_step(8, 4, 4096, bare=True, given={"batch_size", "seq_len"})[0] == 8 * 4 * 4096
    assert tokens_per_step(2, 16, 128, bare=False, given=set())[0] == 2 * 16 * 128
    assert tokens_per_step(8, 16, 128, bare=True, given={"batch_size"}, tokens=1e6)[0] == 1e6
    with pytest.raises(ConfigError, match="--batch-size without --seq-len leaves the tokens of a step unknown"):
        tokens_per_step(8, 4, 128, bare=True, given={"batch_size"})


def test_the_7b_step_follows_the_model_and_says_so(capsys):
    code, out, _ = plan(capsys, "--strategy", "diloco", *QUESTION)
    step = flops_step_s(7e9, 8 * 32 * 2048, 8, 400e12)
    assert f"compute per step: {step:.4g} s (FLOPs rule" in out and step > 6  # not the tiny LM's 2,048 tokens


@pytest.mark.parametrize(
    "argv, says",
    [
        (["--strategies", "diloco,nesterov"], "unknown strategy 'nesterov' in --strategies (available: ddp"),
        (["--strategies", "all,ddp"], "--strategies all,ddp: all names every strategy, so it stands alone"),
        (["--strategies", "diloco", "--strategy", "ddp"], "--strategies and --strategy both name the strategy"),
        (["--strategies", "diloco,diloco"], "strategy listed twice in --strategies"),
        (["--strategy", "diloco", "--batch-size", "4"], "--batch-size without --seq-len leaves the tokens of a step"),
        (["--strategies", "all", "--seq-len", "4096"], "--seq-len without --batch-size leaves the tokens of a step"),
        (["--strategies", "all", "--table"], "plan --table prints its own settings and would ignore"),
        (
            ["--strategies", "all", "--sync-every", "2"],
            "plan --strategies: streaming: fragments (4) must be <= sync_every",
        ),
    ],
)
def test_what_plan_cannot_use_is_refused_in_one_line(argv, says, capsys):
    code, out, err = plan(capsys, *QUESTION, *argv)
    assert code == 1 and out == "" and err.count("\n") == 1 and says in err, err


def test_a_given_step_time_needs_no_tokens(capsys):
    code, out, err = plan(capsys, "--strategy", "diloco", *QUESTION, "--batch-size", "4", "--step-time", "7")
    assert code == 0, err


def test_steps_gives_the_whole_run_warm_up_and_finish_included():
    """A whole run of 100 steps at H = 10 is ten rounds: a tenth of the steady state per 1000 steps.
    Streaming DiLoCo's is not: its finish() syncs the fragments a merge left off their anchors."""
    base = dict(size=of_name("tiny"), workers=4, topology=PRESETS["cross-region"], step_s=0.05)
    diloco = setting("diloco", {"sync_every": 10}, **base)
    run, steady = predict(diloco, 100, finish=True), predict(diloco)
    assert run.whole and run.steps == 100 and not steady.whole and steady.steps == 1000
    assert run.wall_s == pytest.approx(steady.wall_s / 10, rel=1e-9)
    assert run.bytes_per_step == pytest.approx(steady.bytes_per_step, rel=1e-9)
    streaming = setting("streaming", {}, **base)
    run, steady = predict(streaming, 100, finish=True), predict(streaming)
    assert steady.exposed_pct == 0 and run.exposed_pct > 5  # finish(): every fragment's last sync, blocking
    assert run.wall_s > steady.wall_s / 10 * 1.05


def test_plan_steps_prints_the_whole_run(capsys):
    argv = ["--model", "tiny", "--workers", "4", "--wan", "cross-region", "--step-time", "0.05", "--steps", "100"]
    code, out, err = plan(capsys, "--strategy", "streaming", *argv)
    assert code == 0, err
    assert "wall clock of the whole run, 100 steps (step 1 to finish()'s last exchange): " in out
    code, out, err = plan(capsys, "--strategies", "diloco,streaming", *argv)
    assert code == 0 and "figures: wall clock of the whole run, 100 steps" in out, err
    assert all(int(r[2].split()[1]) <= 50 for r in table(out))  # two rounds at least: H <= steps / 2


def test_a_knob_given_is_kept_and_the_others_are_searched(capsys):
    argv = ["--model", "tiny", "--workers", "4", "--wan", "cross-region", "--step-time", "0.05"]
    code, out, err = plan(
        capsys, "--strategies", "diloco,streaming,ddp", *argv, "--sync-every", "50", "--codec", "int8"
    )
    assert code == 0, err
    settings = {r[1]: r[2] for r in table(out)}
    assert settings["diloco"] == "--sync-every 50 --codec int8"
    assert settings["streaming"].startswith("--sync-every 50 --codec int8 --fragments 4")
    assert settings["ddp"] == "-"


def _tiny(name: str, **options: Any):
    return setting(name, options, of_name("tiny"), 4, PRESETS["cross-region"], 0.05)


@pytest.mark.parametrize("name", ["local_sgd", "diloco", "streaming", "cocodc"])
def test_each_strategy_takes_the_smallest_h_reaching_the_target_then_the_codec_that_loses_least(name):
    c = choose(_tiny(name), DEFAULT_GPU_MEMORY)
    o = c.prediction.setting.options
    assert c.reached and c.fits and c.prediction.exposed_pct <= 10 and c.searched == ("sync_every", "codec")
    shorter = [h for h in H_CANDIDATES if h < o["sync_every"] and takes_h(o, h)]
    if shorter:  # no codec reaches the target at a shorter period
        lightest = {**o, "sync_every": shorter[-1], "codec": CODECS[-1]}
        assert predict(dataclasses.replace(c.prediction.setting, options=lightest)).exposed_pct > 10
    for codec in CODECS[: CODECS.index(o["codec"])]:  # nor one that loses less at this period
        assert predict(dataclasses.replace(c.prediction.setting, options={**o, "codec": codec})).exposed_pct > 10


@pytest.mark.parametrize(
    "name, options",
    [
        ("diloco", {}),
        ("diloco", {"codec": "int8"}),
        ("streaming", {}),
        ("cocodc", {}),
        ("local_sgd", {"codec": "fp4"}),
        ("sparseloco", {}),
        ("cpdp", {}),
    ],
)
@pytest.mark.parametrize("target", [1.0, 10.0, 40.0])
def test_the_bisected_search_finds_what_walking_every_period_finds(name, options, target):
    s = _tiny(name, **options)
    p, reached = smallest_h(s, target)
    walked = next(
        (
            h
            for h in H_CANDIDATES
            if takes_h(s.options, h)
            and predict(dataclasses.replace(s, options={**s.options, "sync_every": h})).exposed_pct <= target
        ),
        None,
    )
    assert (p.setting.options["sync_every"] if reached else None) == walked


def test_a_worker_of_several_ranks_holds_the_model_whole_where_it_fits_else_sharded():
    topology = parse_wan("rtt=80ms,bw=1gbit,sites=3,worker=nvlink")
    s = setting("diloco", {}, of_params(7e9), 3, topology, 6.88, ranks_per_worker=8)
    assert choose(s, DEFAULT_GPU_MEMORY).prediction.setting.inside == "fsdp"
    assert choose(s, 10e12).prediction.setting.inside == "ddp"
    kept = choose(s, DEFAULT_GPU_MEMORY, given=frozenset({"inside"}))
    assert kept.prediction.setting.inside == "ddp" and not kept.fits and "inside" not in kept.searched


def test_what_fits_ranks_first_then_the_higher_utilization():
    def choice(name: str, step_s: float, fits: bool) -> Choice:
        return Choice(predict(dataclasses.replace(_tiny(name), step_s=step_s)), True, fits, ())

    fast, slow, big = choice("diloco", 0.5, True), choice("local_sgd", 0.01, True), choice("streaming", 1.0, False)
    assert fast.prediction.utilization_pct > slow.prediction.utilization_pct
    assert big.prediction.utilization_pct >= fast.prediction.utilization_pct
    assert [c.strategy for c in rank([big, slow, fast])] == ["diloco", "local_sgd", "streaming"]


def test_plan_help_shows_the_planners_flags_and_its_defaults(capsys):
    from wansync.cli import main

    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for flag in ("--strategies", "--steps", "--params", "--tokens-per-step", "--gpu-memory", "--target-exposed"):
        assert f"{flag} " in text, flag
    assert f"checked against {human_bytes(DEFAULT_GPU_MEMORY)} per GPU unless --gpu-memory" in text
    assert "--outer-lr" not in text and "--eval-every" not in text
