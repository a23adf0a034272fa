"""Typed run configuration: dataclass defaults < TOML file < command-line flags.

One flat namespace of keys (so `sweep --grid any_key=...` and `--any-key` just work), grouped
into TOML sections for readability. The run/model/data/optim keys are declared here; the
`[strategy]` keys are the strategies' own options, one per option name in the registry
(`wansync.strategies.OPTIONS`), with its type and help. They default to None, meaning "the chosen
strategy's own default"; the training loop resolves them and writes the fully resolved config to
the run directory. Validation errors are one line: `sync_every must be >= 1, got 0`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Iterable, get_type_hints

from .errors import ConfigError, check, user_text
from .ft import support as ft_support
from .rules import Rule, at_least, at_most_cores, host_port, in_range, not_blank, one_of, port_range, positive
from .strategies import OPTIONS, make_options, option_names, strategy_class
from .strategies.catalog import OPTIONS_OF
from .strategies.options import Needs

if TYPE_CHECKING:
    from .net.topology import Topology


def _f(default: Any, section: str, help: str, *rules: Rule, needs: tuple[Needs, ...] = ()) -> Any:
    """A config key: its default, its TOML section, one line of help, the rules its value obeys, and
    `needs`: the settings in which it acts at all (each must hold; see `check_options_apply`)."""
    return field(default=default, metadata={"section": section, "help": help, "rules": rules, "needs": needs})


# ---- when a general key acts (the declared table `check_options_apply` and `validate` read) ---------------
def _builtin(c: Any) -> bool:
    """A built-in model on built-in data: a model or workload of the user's may read any key."""
    from .workloads.factory import is_factory

    return not is_factory(c.model) and not is_factory(c.data)


WIDE_MODELS = ("cnn", "resnet18", "resnet50")  # the models `width` scales (`workloads.vision.models`)


def _vision(c: Any) -> bool:
    from .workloads import model_kind

    return model_kind(c.model, c.data) == "vision"


def _text_only(key: str) -> Needs:
    return Needs(
        lambda c: not _builtin(c) or not _vision(c),
        f"{key} {{{key}}} is the language models', and --model {{model}} trains on images, so it would be "
        f"ignored: drop it",
    )


_FAULT_TOLERANT = "apply to fault-tolerant runs only: add --fault-tolerant, or drop it"
_STEPS_OPTIMIZER = Needs(
    lambda c: strategy_class(c.strategy).steps_optimizer,
    "{strategy} replaces the inner optimizer's update (sign descent on its own momentum, momentum_decay), "
    "so --{key} would be ignored: drop it (the learning rate and weight decay still apply)",
)


INSIDE = ("ddp", "fsdp")
PRECISIONS = ("fp32", "bf16")


MAX_RESTARTS = 1000  # a worker that fails at once every time must not be restarted for ever


@dataclass
class GeneralKeys:
    """The keys of every run, whatever the strategy; `Config` adds the strategies' options."""

    # [run]
    strategy: str = _f("ddp", "run", "synchronization strategy")
    workers: int = _f(2, "run", "workers (model replicas; each averages with the others by the strategy)", at_least(1))
    ranks_per_worker: int = _f(
        1,
        "run",
        "processes per worker (one per GPU): DDP inside a worker every step, "
        "the strategy between workers; the world size is workers x this",
        at_least(1),
    )
    steps: int = _f(300, "run", "training steps (the total budget, also when resuming)", at_least(1))
    seed: int = _f(0, "run", "seed for model init, data order and jitter", at_least(0))
    out: str = _f("runs/latest", "run", "run directory", not_blank("a run directory"))
    threads: int = _f(0, "run", "torch threads per worker; 0 = cores // workers", at_least(0), at_most_cores)
    eval_every: int = _f(50, "run", "evaluate every N steps (and at the end)", at_least(1))
    log_every: int = _f(10, "run", "print a log line every N steps", at_least(1))
    quiet: bool = _f(False, "run", "plain log lines, no progress bar")
    tensorboard: bool = _f(
        False,
        "run",
        "TensorBoard scalars in the run directory's tensorboard/ (loss, evaluation, "
        "exposed communication, bytes, drift, sync events; needs wansync[tensorboard])",
    )
    wan: str = _f(
        "",
        "run",
        "emulated link: a preset (lan, two-site, cross-region, cross-continent) or a spec "
        "like rtt=16.6ms,bw=1gbit,sites=2; empty = no emulation",
    )
    adapt: str = _f(
        "",
        "run",
        "diloco, sparseloco: before each round, the H and compression whose predicted exposed "
        "communication stays under a target on the link the run measures: exposed=5%[,h=8..64]"
        "[,codec=fp32..fp4 | ,density=0.008..0.001] (needs --wan; docs/adapt.md)",
    )
    checkpoint_every: int = _f(0, "run", "write a checkpoint every N steps (0 = only at the end)", at_least(0))
    on_nonfinite: str = _f(
        "abort",
        "run",
        "what to do with a NaN/Inf loss, gradient or pseudo-gradient: abort|skip",
        one_of(("abort", "skip")),
    )
    peer_timeout: float = _f(
        60.0,
        "run",
        "seconds before a silent peer is declared dead; a step's data or compute "
        "stuck twice as long ends the run (1 to 86400)",
        in_range(1, 86400, high_included=True),
    )
    secret_file: str = _f(
        "",
        "run",
        "the run secret: a file of 32+ bytes only you can read, the same on every host; peers "
        "must prove they hold it (docs/security.md; or WANSYNC_SECRET_FILE)",
    )
    bind: str = _f(
        "",
        "run",
        "the address or interface every listener binds (the tunnel's between sites; or WANSYNC_BIND)",
    )
    ports: str = _f(
        "",
        "run",
        "LOW-HIGH: the port range every wansync listener takes its port from (or WANSYNC_PORTS)",
        port_range,
    )
    fault_tolerant: bool = _f(
        False,
        "run",
        "keep training when a worker fails: quorum exchanges through torchft, "
        f"a restarted worker heals from a live peer ({', '.join(ft_support.STRATEGIES)}; "
        "needs wansync[ft]; see docs/fault_tolerance.md)",
    )
    lighthouse: str = _f(
        "",
        "run",
        "fault-tolerant runs: torchft lighthouse HOST:PORT; empty = the launcher " "starts one on 127.0.0.1",
        host_port,
        needs=(Needs(lambda c: c.fault_tolerant, f"--lighthouse {_FAULT_TOLERANT}"),),
    )
    max_restarts: int = _f(
        0,
        "run",
        "fault-tolerant runs: the launcher restarts a dead worker (all its ranks) up to N times; "
        "async_diloco: a dead learner, which rejoins the running run",
        in_range(0, MAX_RESTARTS, high_included=True),
        needs=(
            Needs(
                lambda c: c.fault_tolerant or c.strategy == "async_diloco",
                "--max-restarts applies to fault-tolerant runs and to async_diloco's learners: "
                "add --fault-tolerant, or drop it",
            ),
        ),
    )
    backend: str = _f(
        "gloo", "run", "torch.distributed backend under the strategy: gloo|nccl", one_of(("gloo", "nccl"))
    )
    inside: str = _f(
        "ddp",
        "run",
        "how a worker's ranks hold its model: ddp (each the whole model, DDP every "
        "step) | fsdp (sharded with FSDP2; the strategy exchanges each rank's shard)",
        one_of(INSIDE),
    )
    precision: str = _f(
        "fp32",
        "run",
        "compute precision: fp32 | bf16 (bf16 compute, fp32 master parameters, " "gradient reduction and outer state)",
        one_of(PRECISIONS),
    )
    target_loss: float | None = _f(
        None,
        "run",
        "validation loss target: summary.json and the report give the "
        "step and second each run first reached it (default in compare/sweep: "
        "DDP's final x 1.01; a single run without it: none)",
        positive,
    )
    target_acc: float | None = _f(
        None,
        "run",
        "test accuracy target in percent (vision), like target_loss " "(default in compare/sweep: DDP's final x 0.99)",
        in_range(0, 100, low_included=False, high_included=True),
    )
    # [model]
    model: str = _f(
        "tiny",
        "model",
        "model: micro|tiny|small|150m (LM), cnn|resnet18|resnet50|vit_s (vision), "
        "pkg.module:factory or file.py:factory (yours), hf:PATH (a Hugging Face causal LM; "
        "docs/your_model.md)",
        not_blank("a model (tiny, pkg.module:factory, hf:PATH, ...)"),
    )
    width: float = _f(
        1.0,
        "model",
        "channel-width multiplier of the CNN and the ResNets",
        positive,
        needs=(
            Needs(
                lambda c: not _builtin(c) or c.model in WIDE_MODELS,
                "width {width:g} scales the channels of the CNN and the ResNets, and --model {model} has none, so "
                "it would be ignored: drop it",
            ),
        ),
    )
    # [data]
    data: str = _f(
        "shakespeare",
        "data",
        "LM: shakespeare | PATH | hf:NAME; vision: fashion-mnist | "
        "cifar100:PATH | imagefolder:PATH; your whole workload: pkg.module:factory (default: "
        "shakespeare for LM models, fashion-mnist for vision models)",
        not_blank("a dataset (shakespeare, a path, hf:NAME, ...)"),
    )
    batch_size: int = _f(
        16,
        "data",
        "per-rank batch size (sequences or images; vision default 64); a worker of " "R ranks trains on R x this",
        at_least(1),
    )
    seq_len: int = _f(128, "data", "LM context length in tokens", at_least(2), needs=(_text_only("seq_len"),))
    tokenizer: str = _f(
        "byte", "data", "LM tokenizer: byte|bpe", one_of(("byte", "bpe")), needs=(_text_only("tokenizer"),)
    )
    bpe_vocab: int = _f(
        2048,
        "data",
        "vocabulary size of the locally trained BPE",
        at_least(257),
        needs=(
            _text_only("bpe_vocab"),
            Needs(
                lambda c: c.tokenizer == "bpe",
                "bpe_vocab {bpe_vocab} sizes the BPE vocabulary, and the tokenizer is {tokenizer}, so it would "
                "be ignored: drop it, or give --tokenizer bpe",
            ),
        ),
    )
    val_fraction: float = _f(
        0.05,
        "data",
        "held-out fraction of the LM corpus",
        in_range(0, 1, low_included=False),
        needs=(_text_only("val_fraction"),),
    )
    eval_batches: int = _f(8, "data", "validation batches per evaluation", at_least(1))
    augment: bool = _f(
        True,
        "data",
        "training augmentation for images",
        needs=(
            Needs(
                lambda c: not _builtin(c) or _vision(c),
                "augment is the images' augmentation, and --model {model} trains on text, so it would be "
                "ignored: drop it",
            ),
        ),
    )
    # [optim]
    optimizer: str = _f(
        "adamw",
        "optim",
        "inner optimizer: adamw|sgd|muon (vision default sgd; muon: Muon on the hidden matrices, AdamW on the "
        "rest, as MuLoCo; docs/muon.md)",
        one_of(("adamw", "sgd", "muon")),
        needs=(_STEPS_OPTIMIZER,),
    )
    lr: float = _f(
        3e-3,
        "optim",
        "inner learning rate (peak; vision+sgd default 0.1); under --lr-scaling "
        "linear the base lr at global batch 256",
        positive,
    )
    lr_scaling: str = _f(
        "none",
        "optim",
        "LR rule: none (lr as given, fixed) | linear (peak lr = lr x " "workers x batch_size / 256)",
        one_of(("none", "linear")),
    )
    lr_schedule: str = _f("cosine", "optim", "constant|cosine (with linear warmup)", one_of(("constant", "cosine")))
    warmup_steps: int = _f(20, "optim", "linear warmup steps (vision default 0)", at_least(0))
    weight_decay: float = _f(
        0.0, "optim", "decoupled (adamw, muon) or L2 (sgd) weight decay (vision+sgd default 5e-4)", at_least(0)
    )
    momentum: float = _f(
        0.9,
        "optim",
        "SGD momentum",
        in_range(0, 1),
        needs=(
            _STEPS_OPTIMIZER,
            Needs(
                lambda c: c.optimizer == "sgd",
                "momentum {momentum:g} is SGD's, and the optimizer is {optimizer}, so --momentum would be "
                "ignored: drop it, or give --optimizer sgd",
            ),
        ),
    )
    grad_clip: float = _f(1.0, "optim", "clip the local gradient norm (0 = off)", at_least(0))

    @functools.cached_property
    def topology(self) -> Topology | None:
        """The emulated link `wan` names, parsed once (None without --wan); a bad spec is a ConfigError."""
        from .net.wan import parse_wan

        if not self.wan:
            return None
        return dataclasses.replace(parse_wan(self.wan), ranks_per_worker=self.ranks_per_worker)


# [strategy]: one key per strategy option in the registry; None means the chosen strategy's default.
if clash := sorted({f.name for f in fields(GeneralKeys)} & set(OPTIONS)):
    raise TypeError(f"strategy options may not reuse general config keys: {', '.join(clash)}")
if TYPE_CHECKING:

    class Config(GeneralKeys):
        """What a type checker sees of the class made below: the general keys, typed; every strategy
        option (made from the registry at import) as Any."""

        def __init__(self, **keys: Any) -> None: ...
        def __getattr__(self, name: str) -> Any: ...
else:
    Config = dataclasses.make_dataclass(
        "Config",
        [(name, spec.type | None, _f(None, "strategy", spec.help)) for name, spec in OPTIONS.items()],
        bases=(GeneralKeys,),
        namespace={"__module__": __name__, "__doc__": "Every key of a run (see the module)."},
    )

SECTIONS = ("run", "model", "data", "optim", "strategy")
_TYPES = get_type_hints(Config)
_FIELDS = MappingProxyType({f.name: f for f in fields(Config)})


def key_names() -> list[str]:
    return [f.name for f in fields(Config)]


def base_type(name: str) -> type:
    """The scalar type of a key (`int | None` -> int)."""
    t = _TYPES[name]
    args = getattr(t, "__args__", None)
    if args:
        t = next(a for a in args if a is not type(None))
    return t


def coerce(name: str, value: Any, where: str = "") -> Any:
    """Convert a TOML/CLI value to the key's type, or raise a one-line ConfigError."""
    if name not in _TYPES:
        raise ConfigError(f"unknown config key '{name}'{where} (valid keys: {', '.join(key_names())})")
    t = base_type(name)
    if value is None:
        return None
    if isinstance(value, str) and value.strip().lower() == "none" and getattr(Config, name, None) == "":
        return ""  # a key unset by default (wan, lighthouse): "none" unsets it
    if isinstance(value, str) and t is not str:
        return parse_scalar(name, value, t)
    if t is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if t is bool and not isinstance(value, bool):
        raise ConfigError(f"{name} must be true or false, got {value!r}{where}")
    if t is int and (isinstance(value, bool) or not isinstance(value, int)):
        raise ConfigError(f"{name} must be an integer, got {value!r}{where}")
    if not isinstance(value, t):
        raise ConfigError(f"{name} must be a {t.__name__}, got {value!r}{where}")
    return value


def parse_scalar(name: str, text: str, t: type | None = None) -> Any:
    t = t or base_type(name)
    if t is str:
        return text
    if text.lower() in ("none", "default") and _TYPES[name] != t:
        return None
    try:
        if t is bool:
            if text.lower() in ("1", "true", "yes", "on"):
                return True
            if text.lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError
        if t is int:
            return int(text)
        return float(text)
    except ValueError:
        kind = {int: "an integer", float: "a number", bool: "true or false"}[t]
        raise ConfigError(f"{name} must be {kind}, got {text!r}") from None


MAX_CONFIG_BYTES = 1 << 20


def config_text(p: Path) -> str:
    """A config file's text, or one line that names why it cannot be one (`errors.user_text`)."""
    return user_text(p, "config file", MAX_CONFIG_BYTES)


def load_toml(path: str | Path) -> dict[str, Any]:
    """Read a config file: keys at top level or inside [run]/[model]/[data]/[optim]/[strategy]."""
    check(bool(str(path).strip()), "config must name a TOML file, got an empty value")  # Path("") is "."
    p = Path(path)
    try:
        raw = tomllib.loads(config_text(p))
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {p} is not valid TOML: {e}") from None
    flat: dict[str, Any] = {}
    sections = {f.name: f.metadata["section"] for f in fields(Config)}
    for k, v in raw.items():
        if isinstance(v, dict):
            if k not in SECTIONS:
                raise ConfigError(f"unknown section [{k}] in {p} (valid: {', '.join(SECTIONS)})")
            for kk, vv in v.items():
                if kk in sections and sections[kk] != k:
                    raise ConfigError(f"key '{kk}' belongs in [{sections[kk]}], not [{k}] ({p})")
                flat[kk] = coerce(kk, vv, f" in [{k}] of {p}")
        else:
            flat[k] = coerce(k, v, f" in {p}")
    return flat


# Defaults that follow the model kind, for keys the user (file, preset, flags) did not give.
# The LM keeps the dataclass defaults; `lr`/`weight_decay` apply only when the optimizer is SGD.
VISION_DEFAULTS = MappingProxyType({"data": "fashion-mnist", "batch_size": 64, "optimizer": "sgd", "warmup_steps": 0})
VISION_SGD_DEFAULTS = MappingProxyType({"lr": 0.1, "weight_decay": 5e-4})


def kind_defaults(values: dict[str, Any]) -> dict[str, Any]:
    """The model-kind defaults for the keys `values` lacks (empty for LM models)."""
    from .workloads import model_kind

    if model_kind(values.get("model", Config.model), values.get("data", "")) != "vision":
        return {}
    out = {k: v for k, v in VISION_DEFAULTS.items() if k not in values}
    if values.get("optimizer", out.get("optimizer")) == "sgd":
        out.update({k: v for k, v in VISION_SGD_DEFAULTS.items() if k not in values})
    return out


def build_config(file: str | Path | None = None, overrides: dict[str, Any] | None = None) -> Config:
    """Defaults (the model kind's for vision), then the TOML file, then explicit overrides."""
    values: dict[str, Any] = {}
    if file is not None:  # --config '' is refused, not ignored
        values.update(load_toml(file))
    for k, v in (overrides or {}).items():
        values[k] = coerce(k, v)
    values.update(kind_defaults(values))
    cfg = Config(**values)
    validate(cfg)
    return cfg


def validate(cfg: Config) -> None:
    """Every key's declared rules (a strategy's options are checked by the strategy itself), the
    bounds of any number, then the rules that relate keys: all of them here, each one line."""
    for f in fields(Config):
        value = getattr(cfg, f.name)
        if value is None:
            continue
        check_key(f.name, value)
    check(
        cfg.workers * cfg.ranks_per_worker <= MAX_PROCESSES,
        f"workers x ranks_per_worker is too large: "
        f"{cfg.workers} x {cfg.ranks_per_worker} processes (at most {MAX_PROCESSES})",
    )
    if cfg.fault_tolerant:
        ft_support.check_fault_tolerant(cfg)
    if cfg.strategy == "async_diloco":
        check_asynchronous(cfg)
    idle = idle_keys(cfg, [f.name for f in fields(Config) if getattr(cfg, f.name) != f.default], [cfg])
    check(not idle, idle[0][1] if idle else "")


def check_asynchronous(cfg: Config) -> None:
    """What async_diloco's learners, each on its own clock, cannot do yet (`strategies/async_diloco.py`):
    nothing that makes every rank meet in the middle of the run."""
    check(
        cfg.ranks_per_worker == 1,
        f"async_diloco runs one rank per learner: --ranks-per-worker {cfg.ranks_per_worker} is not supported yet",
    )
    check(not cfg.adapt, "--adapt tunes lock-step rounds; async_diloco's learners have none to tune (drop --adapt)")
    quorum = getattr(cfg, "merge_quorum", None)
    check(
        quorum is None or quorum <= cfg.workers,
        f"merge_quorum {quorum} is more than the run's {cfg.workers} workers (learners)",
    )


def check_key(name: str, value: Any) -> None:
    """One key's value against its bounds and declared rules (also for a flag that sets a key
    outside a Config: `report --target-loss`)."""
    f = next(f for f in fields(Config) if f.name == name)
    check_bounds(f, value)
    for rule in f.metadata["rules"]:
        rule(name, value)


def check_bounds(f: dataclasses.Field, value: Any) -> None:
    """What any number must be: a float finite, an integer within what C++ (torch, gloo) takes."""
    t = base_type(f.name)
    if t is float:
        unbounded = value == math.inf and f.name in UNBOUNDED
        check(math.isfinite(value) or unbounded, f"{f.name} must be a finite number, got {value}")
    elif t is int:
        limit = INT64_MAX if f.name == "seed" or f.metadata["section"] == "strategy" else INT32_MAX
        check(-limit <= value <= limit, f"{f.name} is too large: {value} (at most {limit})")


# Keys that may be infinite: a strategy option whose rules allow it (`rules.positive_or_inf`: async_diloco's
# grace window that never closes), or a key of the run's whose own rules do.
UNBOUNDED = frozenset(
    f.name
    for cls in OPTIONS_OF.values()
    for f in dataclasses.fields(cls)
    if any(getattr(r, "allows_inf", False) for r in f.metadata.get("rules", ()))
)

# Integers go to C++ (torch, gloo): counts and sizes as 32-bit, seeds and strategy counters as 64-bit.
INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1
MAX_PROCESSES = 4096  # workers x ranks_per_worker: the processes of one run
# Keys that control how a run is carried out, not what it computes: --resume may change them, and
# they are left out of the configuration a checkpoint records.
RUN_CONTROL_KEYS = (
    "steps",
    "checkpoint_every",
    "eval_every",
    "log_every",
    "quiet",
    "tensorboard",
    "peer_timeout",
    "threads",
    "lighthouse",
    "secret_file",
    "bind",
    "ports",
    "max_restarts",
    "target_loss",
    "target_acc",
)


def check_combinations(cfg: Config, given: Iterable[str]) -> None:
    """Combinations of keys the user gave (`given`) that make no sense together."""
    if "warmup_steps" in given:
        check(
            cfg.warmup_steps <= cfg.steps,
            f"warmup_steps ({cfg.warmup_steps}) must not exceed steps ({cfg.steps}): "
            f"the learning rate would never reach its peak",
        )


def idle_keys(cfg: Config, keys: Iterable[str], runs: list[Config]) -> list[tuple[str, str]]:
    """(key, one line) for each general key of `keys` that acts in none of `runs` (its declared
    `needs`); `cfg` words the line."""
    out = []
    for key in keys:
        f = _FIELDS.get(key)
        for needs in f.metadata["needs"] if f else ():
            if not any(needs.when(run) for run in runs):
                out.append((key, needs.message(cfg, key)))
                break
    return out


def check_options_apply(runs: Iterable[Config], given: Iterable[str]) -> None:
    """Every key the user gave (a flag, a config file's key) acts in some run of the command: a general
    key's declared `needs` hold there, and a strategy option is one that run's strategy has and that
    acts in its setting (`Options.idle`). Any other is refused in one line, naming it, rather than
    recorded and ignored (`ddp --sync-every 4`, `--quant-range` at bits 32, `--momentum` beside adamw)."""
    runs = list(runs)
    names = list(dict.fromkeys(r.strategy for r in runs))
    given = list(given)
    idle = idle_keys(runs[0], given, runs)
    check(not idle, idle[0][1] if idle else "")
    for key in given:
        if key not in OPTIONS:
            continue
        having = [r for r in runs if key in option_names(r.strategy)]
        if not having:
            raise ConfigError(
                f"{' and '.join(names)} {'has' if len(names) == 1 else 'have'} no option {key} "
                f"(it would be ignored): drop --{key.replace('_', '-')}, or choose a strategy that "
                f"has it ({', '.join(OPTIONS[key].strategies)})"
            )
        settings = [strategy_options_of(r) for r in having]
        built = [opts for opts in settings if not isinstance(opts, ConfigError)]
        if not built:  # invalid in every run: that is the line (a grid's runs say it one by one, labelled)
            raise settings[0]
        found = [idle for opts in built if (idle := opts.idle([key])) is not None]
        if len(found) == len(built):
            raise ConfigError(found[0][1])


def strategy_options_of(cfg: Config) -> Any:
    """The run's strategy Options: what the config gives, the strategy's defaults for the rest; the
    ConfigError when they are invalid."""
    own = option_names(cfg.strategy)
    try:
        return make_options(cfg.strategy, **{k: v for k in own if (v := getattr(cfg, k)) is not None})
    except ConfigError as e:
        return e


def fingerprint(cfg: Config, strategy_options: dict[str, Any]) -> dict[str, Any]:
    """Every resolved key that changes what a run computes (all but RUN_CONTROL_KEYS and out), flat."""
    flat = {k: v for sec in to_sections(cfg, strategy_options).values() for k, v in sec.items()}
    if cfg.wan and cfg.topology is not None and cfg.topology.workers is not None:  # a topology file: what
        flat["wan"] = f"topology {cfg.topology.digest()}"  # it says, not where it was read from
    return {k: v for k, v in sorted(flat.items()) if k not in RUN_CONTROL_KEYS and k != "out"}


def to_sections(cfg: Config, strategy_options: dict[str, Any] | None = None) -> dict[str, dict[str, Any]]:
    """The config grouped by section, strategy section replaced by the resolved options (for TOML)."""
    out: dict[str, dict[str, Any]] = {s: {} for s in SECTIONS}
    for f in fields(Config):
        sec = f.metadata["section"]
        if sec == "strategy" or getattr(cfg, f.name) is None:  # TOML has no null: absent = unset
            continue
        out[sec][f.name] = getattr(cfg, f.name)
    out["strategy"] = dict(strategy_options or {k: v for k in OPTIONS if (v := getattr(cfg, k)) is not None})
    return out


def from_sections(data: dict[str, dict[str, Any]], overrides: dict[str, Any] | None = None) -> Config:
    """Inverse of to_sections (used by resume and report); `overrides` replace keys before the
    values are checked (a resume's run-control flags: `--threads` on a machine of fewer cores)."""
    flat: dict[str, Any] = {}
    for sec in data.values():
        flat.update(sec)
    return build_config(overrides={**flat, **(overrides or {})})


def replace(cfg: Config, **changes: Any) -> Config:
    """A copy with `changes`; when the model changes kind (a --grid over model) and the data is the
    old kind's default dataset, the data follows to the new kind's default."""
    if "model" in changes and "data" not in changes:
        from .workloads import DEFAULT_DATA, model_kind

        old, new_kind = model_kind(cfg.model, cfg.data), model_kind(str(changes["model"]), cfg.data)
        if old != new_kind and cfg.data == DEFAULT_DATA[old]:
            changes = {**changes, "data": DEFAULT_DATA[new_kind]}
    new = dataclasses.replace(cfg, **{k: coerce(k, v) for k, v in changes.items()})
    validate(new)
    return new
