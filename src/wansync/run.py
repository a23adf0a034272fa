"""One training run: validate everything, lay out the run directory, launch the workers.

Everything a user can get wrong is checked here, in the launching process, before a single
worker starts: errors arrive as one line within a second.
"""
from __future__ import annotations

import importlib.util
import json
import shutil
import tomllib
from pathlib import Path
from typing import Any

import tomli_w

from . import checkpoint, launch, worker
from .config import Config, from_sections, replace, to_sections
from .errors import ConfigError, DataError, WansyncError
from .strategies import resolve_options


def check_data_path(cfg: Config) -> None:
    """Fail fast on a dataset that does not fit the model kind, or a local data path that does not exist."""
    from .workloads import check_data_kind
    check_data_kind(cfg.model, cfg.data)
    data = cfg.data
    path = None
    for prefix in ("cifar100:", "cifar10:", "imagefolder:", "fashion-mnist:"):
        if data.startswith(prefix):
            path = data[len(prefix):]
    if path is None and data not in ("shakespeare", "fashion-mnist") and not data.startswith("hf:"):
        path = data
    if path is not None and not Path(path).exists():
        raise DataError(f"data path not found: {path}")


def validate(cfg: Config) -> dict[str, Any]:
    """Everything about `cfg` a user can get wrong, checked without writing anything (used by every
    run and by `--dry-run`); returns the strategy's resolved options."""
    from .workloads import VISION_MODELS, lm_model_names
    options = resolve_options(cfg.strategy, vars(cfg))
    if cfg.model not in VISION_MODELS and cfg.model not in lm_model_names():
        raise ConfigError(f"unknown model '{cfg.model}' (LM: {', '.join(lm_model_names())}; "
                          f"vision: {', '.join(VISION_MODELS)})")
    cfg.topology                              # parses --wan: a bad spec fails here, not in the workers
    check_data_path(cfg)
    if cfg.data.startswith("hf:") and importlib.util.find_spec("datasets") is None:
        raise ConfigError(f"{cfg.data!r} needs the datasets package: install wansync[hf]")
    return options


def prepare(cfg: Config) -> tuple[Path, dict[str, Any]]:
    """Validate the whole config and write the fully resolved config.toml."""
    options = validate(cfg)
    run_dir = Path(cfg.out)
    if run_dir.exists() and not run_dir.is_dir():
        raise ConfigError(f"run directory {run_dir} exists and is not a directory")
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.toml").write_text(tomli_w.dumps(to_sections(cfg, options)))
    return run_dir, options


RESUME_CHANGEABLE = ("steps", "checkpoint_every", "eval_every", "log_every", "quiet", "peer_timeout", "threads")


def resume_config(run_dir: str | Path, overrides: dict[str, Any]) -> Config:
    """The config of an earlier run, with only run-control keys changed (the math must not change)."""
    run_dir = Path(run_dir)
    checkpoint.latest_step_dir(run_dir)                  # one-line errors for a wrong directory
    try:
        saved = from_sections(tomllib.loads((run_dir / "config.toml").read_text()))
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"cannot resume: {run_dir / 'config.toml'} is not valid TOML: {e}") from None
    changes = {k: v for k, v in overrides.items() if k != "out"}
    forbidden = [k for k, v in changes.items() if k not in RESUME_CHANGEABLE and v != getattr(saved, k)]
    if forbidden:
        raise ConfigError(f"cannot change {forbidden[0]} when resuming (only {', '.join(RESUME_CHANGEABLE)})")
    cfg = replace(saved, out=str(run_dir), **changes)
    step = checkpoint.checkpoint_step(run_dir)
    if cfg.steps < step:
        raise ConfigError(f"cannot resume: --steps {cfg.steps} is below the checkpoint's step {step}")
    return cfg


def train(cfg: Config, resume: bool = False) -> dict[str, Any] | None:
    """Train with cfg; returns rank 0's summary (None on a non-zero rank under torchrun).
    `resume` continues from the run directory's latest checkpoint."""
    adopted = launch.torchrun_env()
    if adopted is not None:
        cfg, rank, run_dir = replace(cfg, workers=adopted.world_size), adopted.rank, Path(cfg.out)
        if rank == 0:
            print(f"wansync: under torchrun: {adopted.describe()}")
            run_dir, _ = prepare(cfg)
        if worker.run(cfg, run_dir, resume=resume) != 0:
            raise WansyncError((run_dir / "logs" / f"rank{rank}.err").read_text().strip())
        return read_summary(run_dir) if rank == 0 else {}
    run_dir, _ = prepare(cfg)
    (run_dir / "summary.json").unlink(missing_ok=True)
    if not resume:
        shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
    code, message = launch.spawn(cfg, run_dir, resume=resume)
    if code != 0:
        raise WansyncError(message)
    return read_summary(run_dir)


def read_summary(run_dir: Path) -> dict[str, Any]:
    return json.loads((Path(run_dir) / "summary.json").read_text())
