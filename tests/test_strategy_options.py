"""Strategy options declared once: the registry derives the flags, config keys, help and checks."""

from __future__ import annotations

import dataclasses

import pytest

from wansync.cli import build_parser
from wansync.config import Config, build_config, load_toml, replace
from wansync.errors import ConfigError
from wansync.strategies import OPTIONS, STRATEGIES, make_options, option_names, resolve_options
from wansync.strategies.options import Options, at_least, collect, option


KEYS = {f.name: f for f in dataclasses.fields(Config)}


def _strategy_flags() -> dict[str, list[str]]:
    """flag -> help of every flag in the `[strategy]` group of `wansync train --help`."""
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    group = next(g for g in sub.choices["train"]._action_groups if g.title == "[strategy]")
    flags: dict[str, list[str]] = {}
    for action in group._group_actions:
        for flag in action.option_strings:
            flags.setdefault(flag, []).append(action.help)
    return flags


def test_the_registry_finds_every_strategy_module_with_ddp_first():
    assert set(STRATEGIES) >= {"ddp", "local_sgd", "post_local_sgd", "slowmo", "cpdp", "diloco", "streaming", "cocodc"}
    assert next(iter(STRATEGIES)) == "ddp" and option_names("ddp") == []


def test_every_strategy_class_of_the_package_is_in_the_catalog_with_the_catalogs_options():
    """The catalog (no torch) lists every strategy the package defines, each in the module of its name,
    and each class builds with the catalog's Options: the flags are the options the class takes."""
    import importlib
    import pkgutil

    from wansync import strategies
    from wansync.strategies.base import Strategy
    from wansync.strategies.catalog import OPTIONS_OF

    for module in pkgutil.iter_modules(strategies.__path__):
        importlib.import_module(f"wansync.strategies.{module.name}")
    found, todo = [], list(Strategy.__subclasses__())
    while todo:
        cls = todo.pop()
        todo += cls.__subclasses__()
        if cls.name and cls.__module__.startswith("wansync.strategies.") and cls not in found:
            found.append(cls)
    assert sorted(c.name for c in found) == sorted(OPTIONS_OF)  # none missing from the catalog, none twice
    assert {c.name: c for c in found} == dict(STRATEGIES)
    assert [
        c for c in found if c.Options is not OPTIONS_OF[c.name] or c.__module__ != f"wansync.strategies.{c.name}"
    ] == []


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_every_option_of_every_strategy_is_a_flag_and_a_config_key_with_help(name):
    flags = _strategy_flags()
    for key in option_names(name):
        assert KEYS[key].metadata["section"] == "strategy" and name in OPTIONS[key].strategies
        assert KEYS[key].metadata["help"] == OPTIONS[key].help
        assert flags["--" + key.replace("_", "-")] == [OPTIONS[key].help]  # listed once, with its help
        assert f"{name} " in OPTIONS[key].help  # the strategy and its default


def test_the_strategy_flags_are_exactly_the_registry_options():
    flags = {f for f in _strategy_flags() if not f.startswith("--no-")}
    assert flags == {"--" + key.replace("_", "-") for key in OPTIONS}


def test_the_help_of_a_shared_knob_lists_each_strategy_with_its_default():
    text = OPTIONS["sync_every"].help
    assert text.startswith("H (K in CPDP): inner steps between synchronizations (default: ")
    assert "local_sgd 8" in text and "cpdp 4" in text and "diloco 100" in text and "cocodc 100" in text
    both = OPTIONS["syncs_per_period"].help  # CoCoDC gives the knob another meaning
    assert "one per fragment" in both and "from gamma" in both


def test_an_option_with_two_types_in_two_strategies_is_refused():
    @dataclasses.dataclass
    class A(Options):
        knob: int = option(1, "a count")

    @dataclasses.dataclass
    class B(Options):
        knob: float = option(0.5, "a fraction")

    with pytest.raises(TypeError, match="option 'knob' is int in strategy a but float in strategy b"):
        collect({"a": A, "b": B})


def test_an_option_without_help_is_refused():
    @dataclasses.dataclass
    class A(Options):
        knob: int = 1

    with pytest.raises(TypeError, match="option 'knob' of strategy a has no help"):
        collect({"a": A})


def test_defaults_are_unchanged():
    assert vars(make_options("local_sgd")) == {
        "sync_every": 8,
        "sync_optimizer_state": False,
        "drift_telemetry": True,
        "codec": "fp32",
        "codec_collective": "auto",
        "error_feedback": False,
        "slow_policy": "wait",
        "deadline": 0.0,
        "robust_mean": "off",
        "robust_kappa": 2.0,
    }
    assert vars(make_options("streaming")) == {
        "sync_every": 100,
        "fragments": 4,
        "overlap": 5,
        "alpha": 0.5,
        "outer_lr": 0.7,
        "outer_momentum": 0.9,
        "outer_state_device": "model",
        "codec": "fp32",
        "codec_collective": "auto",
        "error_feedback": False,
        "partition": "strided",
        "syncs_per_period": 0,
        "eager": False,
        "slow_policy": "wait",
        "deadline": 0.0,
        "robust_mean": "off",
        "robust_kappa": 2.0,
    }
    assert vars(make_options("cocodc")) == {
        **vars(make_options("streaming")),
        "lam": 0.5,
        "gamma": 0.4,
        "schedule": "adaptive_fair",
        "compensation": "damped",
        "max_syncs_per_fragment": 2,
        "outer_scaling": "none",
    }


# One knob's check, written once, gives the same line in every strategy that has it.
@pytest.mark.parametrize("name", [s for s in STRATEGIES if "sync_every" in option_names(s)])
def test_sync_every_below_one_is_the_same_line_everywhere(name):
    with pytest.raises(ConfigError) as e:
        make_options(name, sync_every=0)
    assert str(e.value) == "sync_every must be >= 1, got 0"


OUTER_CHECKS = [
    (dict(outer_lr=0.0), "outer_lr must be > 0, got 0.0"),
    (dict(outer_lr=float("inf")), "outer_lr must be > 0, got inf"),
    (dict(outer_momentum=1.0), "outer_momentum must be in [0, 1), got 1.0"),
]


@pytest.mark.parametrize(
    "name, options, message",
    [(s, o, m) for s in STRATEGIES for o, m in OUTER_CHECKS if all(k in option_names(s) for k in o)],
)
def test_outer_optimizer_checks_are_the_same_lines_everywhere(name, options, message):
    with pytest.raises(ConfigError) as e:
        make_options(name, **options)
    assert str(e.value) == message


@pytest.mark.parametrize(
    "name, options, message",
    [
        ("streaming", dict(sync_every=4, fragments=5), "fragments (5) must be <= sync_every (4)"),
        ("cocodc", dict(sync_every=4, fragments=5), "fragments (5) must be <= sync_every (4)"),
        ("local_sgd", dict(sync_every="8"), "sync_every must be an integer, got '8'"),
        ("cpdp", dict(grad_phase=1), "grad_phase must be true or false, got 1"),
        ("diloco", dict(outer_lr=True), "outer_lr must be a number, got True"),
        ("cocodc", dict(lam=float("inf")), "lam must be >= 0, got inf"),
        *(
            (
                s,
                dict(codec_collective=c),
                f"codec_collective {c} is how a lossy codec's mean travels; an fp32 mean is one "
                "all-reduce, so it would be ignored: drop it, or choose a lossy codec (bf16, int8 or fp4)",
            )
            for s in ("local_sgd", "diloco", "streaming")
            for c in ("reduce_scatter", "allgather")
        ),
    ],
)
def test_bad_options_are_one_line_config_errors(name, options, message):
    with pytest.raises(ConfigError) as e:
        make_options(name, **options)
    assert str(e.value) == message


def test_an_integer_is_a_valid_float_option():
    assert make_options("diloco", outer_lr=1, outer_momentum=0).outer_lr == 1.0
    assert isinstance(make_options("diloco", outer_lr=1).outer_lr, float)


def test_a_subclass_that_changes_a_default_keeps_the_help_and_the_check():
    assert make_options("cpdp").slowmo_beta == 0.3 and make_options("slowmo").slowmo_beta == 0.5
    with pytest.raises(ConfigError, match=r"slowmo_beta must be in \[0, 1\), got 1.0"):
        make_options("cpdp", slowmo_beta=1.0)


def test_cross_field_rules_run_after_the_field_rules():
    @dataclasses.dataclass
    class Pair(Options):
        low: int = option(1, "low", at_least(0))
        high: int = option(2, "high")

        def cross_check(self) -> None:
            if self.low > self.high:
                raise ConfigError("low must be <= high")

    with pytest.raises(ConfigError, match="low must be >= 0, got -1"):
        Pair(low=-1)
    with pytest.raises(ConfigError, match="low must be <= high"):
        Pair(low=3)


def test_resolve_options_fills_defaults_and_ignores_keys_of_other_strategies():
    given = {"sync_every": 16, "overlap": 1, "slowmo_beta": None}
    assert resolve_options("slowmo", given) == {
        "sync_every": 16,
        "sync_optimizer_state": False,
        "drift_telemetry": True,
        "codec": "fp32",
        "codec_collective": "auto",
        "error_feedback": False,
        "slowmo_beta": 0.5,
        "slowmo_lr": 1.0,
        "outer_state_device": "model",
        "slow_policy": "wait",
        "deadline": 0.0,
        "robust_mean": "off",
        "robust_kappa": 2.0,
    }
    assert resolve_options("ddp", given) == {}


def test_the_config_has_one_key_per_registry_option_and_none_is_the_default():
    keys = {k: f for k, f in KEYS.items() if f.metadata["section"] == "strategy"}
    assert list(keys) == list(OPTIONS) and all(f.default is None for f in keys.values())
    cfg = build_config(overrides={"strategy": "cpdp", "sync_every": "2"})
    assert cfg.sync_every == 2 and cfg.slowmo_beta is None
    assert replace(cfg, sync_every=None).sync_every is None and replace(cfg, codec="bf16").codec == "bf16"
    assert resolve_options("cpdp", vars(cfg))["sync_every"] == 2


def test_config_files_type_strategy_keys_from_the_registry(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text("[strategy]\nsync_every = 3\nalpha = 1\ngrad_phase = false\n")
    assert load_toml(f) == {"sync_every": 3, "alpha": 1.0, "grad_phase": False}
    f.write_text("[run]\nsync_every = 3\n")
    with pytest.raises(ConfigError, match=r"key 'sync_every' belongs in \[strategy\], not \[run\]"):
        load_toml(f)
    f.write_text("[strategy]\nfragments = 'two'\n")
    with pytest.raises(ConfigError, match="fragments must be an integer, got 'two'"):
        load_toml(f)


@pytest.mark.parametrize("command", [None, "train", "compare", "sweep", "report", "demo", "results", "plan"])
def test_every_help_page_renders(command, capsys):
    """argparse formats help texts with %: a help that says `5%` must not turn --help into a traceback."""
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args([*([command] if command else []), "--help"])
    assert e.value.code == 0
    assert "usage:" in capsys.readouterr().out
