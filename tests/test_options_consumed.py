"""Every option either changes the run or is refused (issue 61).

The enumeration: every strategy x every one of its options, each given a value other than its
default in a setting where its declared `needs` hold, trained for a few rounds in a 3-rank gloo group
beside the strategy's own defaults. What a run does (its parameters at every step, the bytes and
collectives of each exchange, the events it reports without their timings) must differ. The few
options whose effect is not on those numbers here (where the outer state lives on a CPU-only machine;
the slow-worker policies among workers of one speed) are named below with the test that holds them,
and the list checks itself: an option in it that did change the run fails the test.

Then the refusals: each option of the declared table, given where it does nothing, is refused in one
line naming it; in the CLI, in a TOML config and in the Python API alike.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import pytest
import torch
from torch import nn

import wansync as ws
from wansync.config import build_config, check_options_apply
from wansync.errors import ConfigError
from wansync.runner.localgroup import run_ranks
from wansync.strategies import STRATEGIES, make_options
from strategy_harness import deep_model, flat_params, rank_batch, tiny_model

pytestmark = pytest.mark.timeout(300)

# the setting each strategy is enumerated in: rounds every few steps, a model of enough blocks
BASE: dict[str, dict[str, Any]] = {
    "ddp": {},
    "demo": {},
    "local_sgd": {"sync_every": 2},
    "post_local_sgd": {"sync_every": 2, "switch_step": 2},
    "slowmo": {"sync_every": 2},
    "cpdp": {"sync_every": 2},
    "diloco": {"sync_every": 2},
    "sparseloco": {"sync_every": 2, "chunk": 4},
    "streaming": {"sync_every": 8, "overlap": 1},
    "cocodc": {"sync_every": 8, "overlap": 1, "syncs_per_period": 4},  # N given: not from measured times
    # every learner in every merge: the same merges whatever the timing (a smaller quorum depends on it)
    "async_diloco": {"sync_every": 2, "merge_quorum": 3, "grace": math.inf},
}
STEPS = {"streaming": 12, "cocodc": 12}  # a round of the alternative sync_every 12; every option acts by step 8
# a value other than the default, where the heuristic (flip, halve, double) would not be valid
ALT: dict[str, Any] = {
    "sync_every": 3,
    "codec": "int8",
    "codec_collective": "allgather",  # auto, with 3 workers and no link model: reduce_scatter
    "slow_policy": "balanced",
    "robust_mean": "median",
    "outer_state_device": "cpu",
    "aggregate": "all",
    "partition": "sequential",
    "schedule": "round_robin",
    "compensation": "taylor",
    "outer_scaling": "interval",
    "fragments": 2,
    "overlap": 2,
    "syncs_per_period": 8,  # cocodc's base gives 4
    "switch_step": 4,
    "quant_range": 0.5,
    "bits": 4,
    "density": 0.25,
    "topk": 2,
    "chunk": 8,
    "deadline": 5.0,
    "max_syncs_per_fragment": 1,
    "robust_kappa": 0.5,
    "staleness_rule": "polynomial",
}
# the other options an option needs to act at all (its declared `needs`): by option, or by (strategy, option)
CONTEXT: dict[Any, dict[str, Any]] = {
    "codec_collective": {"codec": "int8"},
    "error_feedback": {"codec": "int8"},
    "deadline": {"slow_policy": "deadline"},
    "robust_kappa": {"robust_mean": "median"},
    # DeMo steps by the sign of the mean: a clip moves it only where workers send values at the same indices
    "quant_range": {"bits": 4, "density": 0.5},
    "partition": {"fragments": 2},  # 4 fragments of 4 blocks are the same, strided or sequential
    "gamma": {"syncs_per_period": 0},
    "max_syncs_per_fragment": {"syncs_per_period": 0},
    # async_diloco's sparse payload's knobs act where its learners send it
    **{
        ("async_diloco", k): {"sparse": True} for k in ("error_decay", "density", "chunk", "bits", "quant_range", "dct")
    },
}
# options whose effect is not on this test's numbers, each with where it is held
ELSEWHERE = {
    ("*", "outer_state_device"): "on a CPU-only machine the model's device is the CPU: test_outer.py holds placement",
}
# options whose effect follows the measured speed of each worker, not run here (it would differ by load)
TIMED = {
    "slow_policy": "balanced and deadline set a round from measured step times: test_slow_policies.py",
    "deadline": "a deadline closes a round by the clock: test_slow_policies.py",
    "gamma": "CoCoDC's automatic N follows measured compute and send times: test_cocodc.py (N from gamma)",
    "max_syncs_per_fragment": "caps that automatic N: test_cocodc.py",
    "merge_quorum": "who is in a merge follows when learners arrive: test_async_diloco.py (quorum, grace window)",
    "grace": "the grace window closes a merge by the clock: test_async_diloco.py",
    "max_staleness": "a round is stale only when others merged while it trained: test_async_diloco.py (dropped)",
    "dynamic_h": "a round's length follows the learners' measured speeds: test_async_diloco.py (half speed)",
}


def alt_value(strategy: str, name: str, default: Any) -> Any:
    if strategy in ("streaming", "cocodc") and name == "sync_every":
        return 12  # at least its 4 fragments
    if name in ALT:
        return ALT[name]
    if isinstance(default, bool):
        return not default
    return default / 2 if isinstance(default, float) else default * 2 or 2


# options a strategy has whose every other value it refuses (a DDP step cannot wait for no one)
REFUSED_WHEN_CHANGED = {
    ("post_local_sgd", "slow_policy"): "post_local_sgd takes slow_policy wait only",
    ("post_local_sgd", "deadline"): "post_local_sgd takes slow_policy wait only",
    ("cpdp", "slow_policy"): "cpdp takes slow_policy wait only",
    ("cpdp", "deadline"): "cpdp takes slow_policy wait only",
}


def all_cases() -> list[tuple[str, str, dict[str, Any]]]:
    """(strategy, option, options to train with) for every option of every strategy."""
    out = []
    for name, cls in STRATEGIES.items():
        for f in dataclasses.fields(cls.Options):
            if f.name == "topk":
                continue  # density's other spelling (`check_sparse_options`): density stands for both
            context = {**CONTEXT.get(f.name, {}), **CONTEXT.get((name, f.name), {})}
            options = {**BASE[name], **context, f.name: alt_value(name, f.name, f.default)}
            out.append((name, f.name, options))
    return out


def refused(name: str, options: dict[str, Any]) -> str | None:
    try:
        make_options(name, **options)
    except ConfigError as e:
        return str(e)
    return None


def cases() -> list[tuple[str, str, dict[str, Any]]]:
    """The cases a strategy takes (the others: `REFUSED_WHEN_CHANGED`), but for the TIMED options."""
    return [c for c in all_cases() if c[1] not in TIMED and refused(c[0], c[2]) is None]


def test_an_option_a_strategy_takes_only_at_its_default_is_refused_at_any_other():
    found = {(n, o): msg for n, o, options in all_cases() if (msg := refused(n, options)) is not None}
    assert set(found) == set(REFUSED_WHEN_CHANGED), found
    assert all(REFUSED_WHEN_CHANGED[k] in msg for k, msg in found.items())


def observed(rank: int, name: str, options: dict[str, Any], steps: int) -> tuple[Any, ...]:
    """What a run does: parameters at every step, each exchange's calls and bytes, its events without timings."""
    model = (deep_model if name in ("streaming", "cocodc") else tiny_model)(0)
    plain = name == "demo"  # DeMo takes plain SGD for its learning rate; the rest an optimizer with state
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.0 if plain else 0.9)
    sync = ws.strategy(name, model, opt, **options)
    events: list[dict[str, Any]] = []
    sync.on_event(events.append)
    params = []
    for step in range(steps):
        x, y = rank_batch(rank, step)
        nn.functional.mse_loss(sync.model(x), y).backward()
        sync.step()
        sync.zero_grad()
        params.append(flat_params(model))
    sync.finish()
    params.append(flat_params(model))
    comm = {k: (v["calls"], v["bytes"], v["sent"]) for k, v in sync.comm.snapshot().items()}
    timeless = [{k: v for k, v in e.items() if not k.endswith("_s") and "time" not in k} for e in events]
    return torch.stack(params), comm, repr(timeless)


def enumerate_runs(rank: int, world: int) -> dict[tuple[str, str], bool]:
    """(strategy, option) -> whether the option changed what the run does, against the strategy's defaults."""
    import warnings

    warnings.simplefilter("ignore")  # the regime warnings of short rounds: this test reads numbers
    base = {name: observed(rank, name, BASE[name], STEPS.get(name, 6)) for name in STRATEGIES}
    for name in STRATEGIES:  # a run that differs from itself would make every option seem to act
        again = observed(rank, name, BASE[name], STEPS.get(name, 6))
        assert torch.equal(again[0], base[name][0]) and again[1:] == base[name][1:], f"{name} is not repeatable"
    changed = {}
    refs: dict[str, tuple[Any, ...]] = {}  # the runs of a context several options share, run once
    for name, option, options in cases():
        steps = STEPS.get(name, 6)
        ref = base[name] if set(options) - {option} <= set(BASE[name]) else None
        if ref is None:  # the option's context differs from the defaults: compare within that context
            context = {k: v for k, v in options.items() if k != option}
            key = f"{name} {sorted(context.items())}"
            if key not in refs:
                refs[key] = observed(rank, name, context, steps)
            ref = refs[key]
        got = observed(rank, name, options, steps)
        changed[(name, option)] = not (torch.equal(got[0], ref[0]) and got[1:] == ref[1:])
    return changed


@pytest.fixture(scope="module")
def changed() -> dict[tuple[str, str], bool]:
    return run_ranks(enumerate_runs, 3, timeout=240)[0]  # 3: a robust mean of 2 clips nothing


def test_every_option_of_every_strategy_changes_what_the_run_does(changed):
    assert len(changed) > 80  # every strategy's options, not a few
    unchanged = sorted(k for k, did in changed.items() if not did)
    unexplained = [(s, o) for s, o in unchanged if ("*", o) not in ELSEWHERE and (s, o) not in ELSEWHERE]
    assert not unexplained, f"accepted but changing nothing: {unexplained}"


def test_the_options_held_elsewhere_do_change_nothing_here(changed):
    """The list of exceptions checks itself: an option named there that changed the run belongs out of it."""
    listed = {(s, o) for s, o in changed if ("*", o) in ELSEWHERE or (s, o) in ELSEWHERE}
    assert listed and not [k for k in listed if changed[k]]


# ---- the refusals: one per declared `needs`, on every surface -----------------------------------
IDLE = [  # (overrides, the key given, what the line says)
    ({"strategy": "demo", "quant_range": 3.0}, "quant_range", "quant_range 3 spans the quantizer's bins, and bits 32"),
    ({"strategy": "sparseloco", "bits": 32, "quant_range": 6.0}, "quant_range", "bits 32 sends float32 values"),
    ({"strategy": "diloco", "error_feedback": True}, "error_feedback", "error_feedback needs a lossy codec"),
    ({"strategy": "diloco", "codec_collective": "allgather"}, "codec_collective", "is how a lossy codec's mean"),
    ({"strategy": "diloco", "deadline": 3.0}, "deadline", "deadline 3 s does nothing under slow_policy wait"),
    ({"strategy": "diloco", "robust_kappa": 2.0}, "robust_kappa", "robust_kappa 2 is the robust mean's clip"),
    ({"strategy": "cocodc", "syncs_per_period": 8, "gamma": 0.4}, "gamma", "gamma 0.4 sets the automatic"),
    ({"strategy": "async_diloco", "density": 0.25}, "density", "density shapes the sparse payload, and sparse is off"),
    ({"strategy": "async_diloco", "sparse": True, "codec": "fp32"}, "codec", "codec fp32 encodes the dense payload"),
    ({"strategy": "cocodc", "compensation": "alpha", "lam": 0.5}, "lam", "lam 0.5 is the Taylor term's"),
    ({"strategy": "diloco", "momentum": 0.9}, "momentum", "momentum 0.9 is SGD's, and the optimizer is adamw"),
    ({"strategy": "demo", "momentum": 0.9}, "momentum", "demo replaces the inner optimizer's update"),
    ({"lighthouse": "127.0.0.1:29510"}, "lighthouse", "--lighthouse apply to fault-tolerant runs only"),
    ({"model": "cnn", "seq_len": 64}, "seq_len", "seq_len 64 is the language models', and --model cnn"),
    ({"model": "tiny", "augment": False}, "augment", "augment is the images' augmentation"),
    ({"model": "vit_s", "width": 2.0}, "width", "width 2 scales the channels of the CNN and the ResNets"),
    ({"model": "tiny", "width": 2.0}, "width", "and --model tiny has none"),
    ({"tokenizer": "byte", "bpe_vocab": 4096}, "bpe_vocab", "bpe_vocab 4096 sizes the BPE vocabulary"),
]


@pytest.mark.parametrize("overrides,key,says", IDLE, ids=[f"{c[1]}-{i}" for i, c in enumerate(IDLE)])
def test_an_option_given_where_it_does_nothing_is_refused_in_one_line(overrides, key, says):
    """As `train`, `compare` and `plan` check what was given (a flag or a config file's key): the default
    value given is refused too, for it is recorded and ignored all the same."""
    try:
        cfg = build_config(overrides=overrides)  # a value other than the default: refused while building
    except ConfigError as e:
        message = str(e)
    else:
        with pytest.raises(ConfigError) as e:
            check_options_apply([cfg], set(overrides))
        message = str(e.value)
    assert says in message and "\n" not in message


def test_a_key_that_acts_in_one_run_of_a_grid_is_taken():
    """compare/sweep: a key is refused only when no run of the grid reads it."""
    runs = [build_config(overrides={"strategy": "diloco", "codec": c}) for c in ("fp32", "int8")]
    check_options_apply(runs, {"codec_collective"})
    lm, vision = build_config(overrides={"model": "tiny"}), build_config(overrides={"model": "cnn"})
    check_options_apply([lm, vision], {"seq_len", "augment"})
    with pytest.raises(ConfigError, match="seq_len 128 is the language models'"):
        check_options_apply([vision], {"seq_len"})


def test_the_cli_and_a_toml_config_refuse_alike(tmp_path, capsys):
    from wansync.cli import main

    config = tmp_path / "c.toml"
    config.write_text('[optim]\nmomentum = 0.9\n[run]\nstrategy = "diloco"\n')
    for argv in (
        ["train", "--out", str(tmp_path / "a"), "--momentum", "0.9"],
        ["train", "--out", str(tmp_path / "b"), "--config", str(config)],
    ):
        with pytest.raises(SystemExit) as e:
            main(argv)
        err = capsys.readouterr().err
        assert e.value.code == 1 and err.count("\n") == 1 and "is SGD's, and the optimizer is adamw" in err
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_the_python_api_refuses_alike():
    """`ws.strategy` (and the Trainer integration, which builds through it) checks what its caller gave."""
    model = tiny_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ConfigError, match="quant_range 6 spans the quantizer's bins, and bits 32"):
        ws.strategy("demo", model, opt, quant_range=6.0)  # the default, given: still refused
    with pytest.raises(ConfigError, match="error_feedback needs a lossy codec"):
        ws.strategy("diloco", model, opt, error_feedback=False)


PLAN = [  # a plan reads neither what a run learns nor what it writes or survives
    ("--fault-tolerant", "plan would ignore --fault-tolerant"),
    ("--eval-every=5", "plan would ignore --eval-every"),
    ("--checkpoint-every=5", "plan would ignore --checkpoint-every"),
    ("--seed=3", "plan would ignore --seed"),
    ("--out=x", "plan would ignore --out"),
    ("--adapt=exposed=5%", "plan would ignore --adapt: --adapt changes H and the codec while a run goes"),
    ("--outer-lr=0.5", "--outer-lr changes what a run learns"),
    ("--robust-mean=median", "the planner does not model the robust mean"),
]


@pytest.mark.parametrize("flag,says", PLAN, ids=[p[0] for p in PLAN])
def test_plan_refuses_what_would_leave_its_answer_unchanged(flag, says, capsys):
    from wansync.cli import main

    with pytest.raises(SystemExit) as e:
        main(["plan", "--wan", "cross-region", "--strategy", "diloco", flag])
    err = capsys.readouterr().err
    assert e.value.code == 1 and err.count("\n") == 1 and says in err


def test_every_option_a_plan_takes_changes_its_prediction():
    """The planner's side of the enumeration: each strategy option a plan accepts moves the predicted wall
    clock, exposed share, bytes or memory, in a setting where it acts (a codec that loses, workers of
    two speeds, a slow link)."""
    from wansync.net.wan import parse_wan
    from wansync.planner.keys import LEARNING_ONLY, NOT_MODELLED
    from wansync.planner.prediction import predict, setting
    from wansync.planner.sizes import of_name

    def figures(strategy: str, options: dict[str, Any], wan: str, model: str) -> tuple[Any, ...]:
        p = predict(setting(strategy, options, of_name(model, 256), 4, parse_wan(wan), 0.05))
        return p.wall_per_1000_s, p.exposed_pct, p.bytes_per_step, p.sent_per_step, sorted(p.memory.items())

    # where an option moves a prediction: its link, model, value (as `cases`' otherwise)
    plan_context: dict[str, dict[str, Any]] = {
        "slow_policy": {"wan": "half-speed"},  # a worker at half speed
        "deadline": {"slow_policy": "deadline", "wan": "half-speed"},
        "codec_collective": {"value": "reduce_scatter"},  # auto, 4 workers on this link: allgather
        "partition": {"model": "resnet18"},  # blocks of unequal sizes: strided and sequential differ
        "gamma": {"syncs_per_period": 0, "wan": "two-site"},
        "max_syncs_per_fragment": {"syncs_per_period": 0, "wan": "lan"},
        # a quorum and a grace window act once learners arrive apart (four of unequal speeds); a quorum
        # only before a grace window closes (an unbounded one waits for every learner)
        "merge_quorum": {"wan": "uneven-speeds", "grace": 0.5},
        "grace": {"wan": "uneven-speeds", "merge_quorum": 2},
        "dynamic_h": {"wan": "uneven-speeds"},  # rounds by speed: only where the learners' speeds differ
    }
    unchanged = []
    for name, option, options in all_cases():
        if option in LEARNING_ONLY or option in NOT_MODELLED:
            continue
        if refused(name, options) is not None and option not in TIMED:
            continue
        ctx = dict(plan_context.get(option, {}))
        wan, model = ctx.pop("wan", "cross-region"), ctx.pop("model", "tiny")
        value = ctx.pop("value", options[option])
        base = {k: v for k, v in {**options, **ctx}.items() if k != option}
        if refused(name, {**base, option: value}) is not None:
            continue  # cpdp, post_local_sgd: slow policies (REFUSED_WHEN_CHANGED)
        if figures(name, {**base, option: value}, wan, model) == figures(name, base, wan, model):
            unchanged.append((name, option))
    assert not unchanged, f"plan accepts these and predicts the same: {unchanged}"


def test_plan_help_lists_what_a_plan_reads_and_nothing_it_refuses(capsys):
    from wansync.cli import main
    from wansync.planner.keys import READS

    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    text = capsys.readouterr().out
    for key in READS:
        assert f"--{key.replace('_', '-')} " in text or f"--{key.replace('_', '-')}\n" in text, key
    for refused in ("--outer-lr", "--eval-every", "--fault-tolerant", "--checkpoint-every", "--seed", "--adapt"):
        assert refused not in text
