"""One training run: validate everything, lay out the run directory, launch the workers.

Everything a user can get wrong is checked here, in the launching process, before a single
worker starts: errors arrive as one line within a second. A run directory is never destroyed by
accident: `train` refuses a non-empty directory that is not a wansync run, keeps an existing run
unless `force` (its files are replaced only once the new run has validated and holds the
directory), and holds an exclusive lock on the directory while it runs (`runlock`). The workers
get their configuration from the launcher, never from a file another process may rewrite.
"""

from __future__ import annotations

import codecs
import contextlib
import dataclasses
import fnmatch
import importlib.util
import os
import shutil
import sys
import tomllib
from pathlib import Path
from typing import Any

import tomli_w

from ..comm.robust import check_workers
from ..rundir import checkpoint, files
from . import launch, worker
from .agreement import agree, shared
from .torchrun import TorchrunEnv, join_network
from ..config import RUN_CONTROL_KEYS, Config, coerce, fingerprint, from_sections, replace, to_sections
from ..errors import ConfigError, DataError, StorageError, WansyncError, path_kind, user_text
from ..net import topology_file
from ..net.wan import is_file_spec
from ..workloads.factory import is_factory
from ..workloads.lm.corpus import corpus_files
from ..strategies.guards import regime_warnings
from ..trainer.sharding import check_precision
from ..telemetry import tensorboard
from ..rundir.layout import (
    CONFIG_FILE,
    LOGS_DIR,
    RUN_DIR_CONTENTS,
    RUN_FILES,
    SUMMARY_FILE,
    has_summary,
    read_summary,
    topology_copy_name,
)
from ..rundir.claim import Claim, claim
from ..rundir.lock import RunLock, check_unlocked
from ..strategies import resolve_options
from ..trust.settings import check_agents, check_range, listeners_needed, settle

SNIFF_BYTES = 1 << 20
LOCAL_PROCESSES_PER_CORE = 8
MIN_LOCAL_PROCESSES = 64


def check_data_path(cfg: Config) -> None:
    """Fail fast on a dataset that does not fit the model kind, or a local data path that does not exist."""
    from ..workloads import check_data_kind

    check_data_kind(cfg.model, cfg.data)
    if is_factory(cfg.data):  # a workload of the user's: its own data
        return
    data = cfg.data
    path = None
    for prefix in ("cifar100:", "cifar10:", "imagefolder:", "fashion-mnist:"):
        if data.startswith(prefix):
            path = data[len(prefix) :]
    if path is None and data not in ("shakespeare", "fashion-mnist") and not data.startswith("hf:"):
        path = data
    if path is not None:
        check_data_kind_of(Path(path), images=path != cfg.data)
    if path is not None and path == cfg.data:  # an LM corpus: a text file or a folder of them
        corpus = Path(path)
        for f in ([corpus] if corpus.is_file() else corpus_files(corpus))[:64]:
            check_text(f)


def check_data_kind_of(path: Path, images: bool) -> None:
    """What is at a data path can be read as data: a directory of images, or a text file or a
    directory of them; never a FIFO or a device, which would block or never end."""
    if not path.exists():
        raise DataError(f"data path not found: {path}")
    if images and not path.is_dir():
        raise DataError(f"data path {path} is {path_kind(path)}, not a directory of images")
    if not (path.is_file() or path.is_dir()):
        raise DataError(f"data path {path} is {path_kind(path)}, not a text file or a directory of them")


def check_text(path: Path) -> None:
    """A corpus file must be text: binary data (NUL bytes) is refused; bytes that are not UTF-8 are
    replaced, with a one-line warning (training on the rest makes sense)."""
    try:
        with open(path, "rb") as f:
            head = f.read(SNIFF_BYTES)
    except OSError as e:
        raise DataError(f"cannot read corpus {path}: {e.strerror or e}") from None
    if b"\0" in head:
        raise DataError(f"corpus {path} is binary (it holds NUL bytes), not text: pass a UTF-8 text file")
    try:
        codecs.getincrementaldecoder("utf-8")().decode(head, final=len(head) < SNIFF_BYTES)
    except UnicodeDecodeError as e:
        print(
            f"wansync: warning: corpus {path} is not valid UTF-8 (first bad byte at offset {e.start}); "
            f"undecodable bytes are replaced",
            file=sys.stderr,
        )


def check_run(cfg: Config) -> dict[str, Any]:
    """Everything about `cfg` a user can get wrong, checked without writing anything (used by every
    run and by `--dry-run`); returns the strategy's resolved options."""
    from ..workloads import check_model

    options = resolve_options(cfg.strategy, vars(cfg))
    check_model(cfg)  # the model's form, its factory's import, an hf: directory
    topology = cfg.topology  # parses --wan: a bad spec fails here, not in the workers
    if topology is not None:
        topology.check_workers(cfg.workers)
    if cfg.backend == "nccl":
        import torch

        if not torch.cuda.is_available():
            raise ConfigError("--backend nccl needs CUDA GPUs, and torch sees none here (use --backend gloo)")
    check_precision(cfg.precision, "cuda" if cfg.backend == "nccl" else "cpu")
    if "fragments" in options and not is_factory(cfg.data):  # a workload of the user's: its own model
        check_fragments(cfg.model, options["fragments"], options.get("partition", "strided"))
    if "chunk" in options and not is_factory(cfg.data):
        check_chunks(cfg.strategy, options, cfg.model)
    check_data_path(cfg)
    if cfg.data.startswith("hf:") and importlib.util.find_spec("datasets") is None:
        raise ConfigError(f"{cfg.data!r} needs the datasets package: install wansync[hf]")
    if cfg.tensorboard:
        tensorboard.check_available()
    check_adapt(cfg, options)
    if options.get("robust_mean") == "median":  # before the workers start: they would refuse it each
        check_workers(cfg.workers, options["robust_kappa"])
    return options


def check_adapt(cfg: Config, options: dict[str, Any]) -> None:
    """`--adapt`: its spec (`trainer.adapt.parse_adapt`), and what it needs around it."""
    from ..trainer.adapt import parse_adapt

    if parse_adapt(cfg.adapt, cfg.strategy, options) is None:
        return
    if not cfg.wan:
        raise ConfigError(
            "--adapt measures the link from the emulator's records: give --wan (on real links "
            "--wan lan, whose model adds nothing measurable)"
        )
    if cfg.fault_tolerant:
        raise ConfigError(
            "--adapt with --fault-tolerant: a quorum's exchanges are not timed on a link model; " "drop one of the two"
        )


def check_local_launch(cfg: Config) -> None:
    """The processes a local launch starts fit this machine: at most LOCAL_PROCESSES_PER_CORE per
    core (at least MIN_LOCAL_PROCESSES); each holds torch and the model, and thousands of them
    exhaust memory before the first step. More belong under torchrun across hosts."""
    limit = max(MIN_LOCAL_PROCESSES, LOCAL_PROCESSES_PER_CORE * (os.cpu_count() or 1))
    world = cfg.workers * cfg.ranks_per_worker
    if world > limit:
        raise ConfigError(
            f"--workers {cfg.workers} x --ranks-per-worker {cfg.ranks_per_worker} would start {world} "
            f"processes on this machine (at most {limit} here); start more under torchrun across hosts"
        )


def check_chunks(strategy: str, options: dict[str, Any], model: str) -> None:
    """A sparse exchange's chunk that cuts no tensor of the model fails here, in one line, before any
    worker starts: the strategy's own payload (`wire_codec`) of the model built on the meta device."""
    from ..strategies import make_options, strategy_class
    from ..workloads import meta_model

    on_meta = meta_model(model)
    if on_meta is not None:
        strategy_class(strategy).wire_codec(
            make_options(strategy, **options), [p.shape for p in on_meta.parameters() if p.requires_grad]
        )


def check_fragments(model: str, fragments: int, mode: str) -> None:
    """A fragment count the model cannot be cut into fails here, in one line, before any worker
    starts: the partition is the strategy's own (`fragments.partition`), of the model built on the
    meta device (no memory; its stages do not depend on the data, the vocabulary or `--width`). A
    model of the user's is built by its factory only in the workers, where the strategy checks it."""
    from ..strategies.fragments import partition
    from ..workloads import meta_model

    on_meta = meta_model(model)
    if on_meta is not None:
        partition(on_meta, fragments, mode)


def prepare(cfg: Config) -> tuple[Path, dict[str, Any]]:
    """Validate the whole config and write the fully resolved config.toml (no checks on what the
    directory holds: `train` makes those)."""
    options = check_run(cfg)
    run_dir = make_run_dir(Path(cfg.out))
    write_config(run_dir, config_text(cfg, options), cfg)
    return run_dir, options


def config_text(cfg: Config, options: dict[str, Any]) -> str:
    return tomli_w.dumps(to_sections(cfg, options))


def make_run_dir(run_dir: Path, what: str = "run directory") -> Path:
    """Create the run directory (or an experiment's: `what`), turning what the operating system
    refuses into one line."""
    if run_dir.exists() and not run_dir.is_dir():
        raise ConfigError(f"{what} {run_dir} exists and is not a directory")
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise StorageError(f"cannot create {what} {run_dir}: {e.strerror or e}") from None
    return run_dir


def write_config(run_dir: Path, text: str, cfg: Config | None = None) -> None:
    """config.toml, and beside it a copy of the topology file `cfg.wan` names (`keep_topology`)."""
    files.write_text(run_dir / CONFIG_FILE, text)
    if cfg is not None:
        keep_topology(run_dir, cfg)


def keep_topology(run_dir: Path, cfg: Config) -> None:
    """A copy of the topology file the run was started with (`topology.toml`, or `.yaml`): what the
    run's links were, and what `--resume` reads when the file has moved. Written atomically, as the
    file reads now: its content is what the run's fingerprint holds (`config.fingerprint`)."""
    if not cfg.wan or not is_file_spec(cfg.wan):
        return
    source = Path(cfg.wan.strip())
    target = run_dir / topology_copy_name(source)
    if source.resolve() == target.resolve():  # a resume from the copy itself
        return
    data = user_text(source, "topology file", topology_file.MAX_BYTES).encode()
    try:
        same = target.is_file() and target.read_bytes() == data
    except OSError as e:
        raise StorageError(f"cannot read {target}: {e.strerror or e}") from None
    if not same:
        files.write_bytes(target, data, durable=True)


def check_target(run_dir: Path, force: bool) -> bool:
    """Whether training into `run_dir` may go on (`rundir.claim`, the rule every writer of a run follows);
    True when an earlier run's files must be replaced (`force`)."""
    taken = claim(
        run_dir,
        action="train into",
        where="--out",
        replace=force,
        hints=f"--resume {run_dir} continues it, --force replaces it, ",
    )
    return taken is Claim.REPLACE


def clear_run(run_dir: Path) -> None:
    """Remove the files an earlier run wrote (RUN_FILES; inside its directories only the names it writes
    there, `RUN_DIR_CONTENTS`), nothing else: a link is removed, never followed; a directory that still
    holds something of the user's stays."""
    for name in RUN_FILES:
        p = run_dir / name
        if p.is_symlink() or not p.is_dir():
            p.unlink(missing_ok=True)
            continue
        for child in p.iterdir():
            if any(fnmatch.fnmatch(child.name, pattern) for pattern in RUN_DIR_CONTENTS.get(name, ())):
                if child.is_dir() and not child.is_symlink():
                    shutil.rmtree(child, ignore_errors=True)
                else:
                    child.unlink(missing_ok=True)
        with contextlib.suppress(OSError):
            p.rmdir()  # only when nothing of the user's is left


def check_run_files(run_dir: Path) -> None:
    """Before a resume writes again what the earlier run wrote (RUN_FILES; inside its directories the
    names it writes there): a file no one may replace (a hard link, another user's: `rundir.files`),
    or a link in place of its logs/, is refused in one line, before any work."""
    for name in RUN_FILES:
        p = run_dir / name
        if name not in RUN_DIR_CONTENTS:
            files.check(p)
            continue
        if name == LOGS_DIR and p.is_symlink():
            files.directory(p)  # refuses the link
        if not p.is_dir() or p.is_symlink():
            continue
        for child in p.iterdir():
            if any(fnmatch.fnmatch(child.name, pattern) for pattern in RUN_DIR_CONTENTS[name]) and not child.is_dir():
                files.check(child)


def resume_config(run_dir: str | Path, overrides: dict[str, Any]) -> Config:
    """The config of an earlier run, with only run-control keys changed (the math must not change):
    config.toml must still describe what the newest checkpoint recorded."""
    run_dir = Path(run_dir)
    check_unlocked(run_dir, "resume")
    step_dir = checkpoint.latest_step_dir(run_dir)  # one-line errors for a wrong directory
    try:
        control = {k: v for k, v in overrides.items() if k in RUN_CONTROL_KEYS}
        saved = from_sections(tomllib.loads((run_dir / "config.toml").read_text()), control)
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"cannot resume: {run_dir / 'config.toml'} is not valid TOML: {e}") from None
    except OSError as e:
        raise ConfigError(f"cannot resume: cannot read {run_dir / 'config.toml'}: {e.strerror or e}") from None
    if "out" in overrides and Path(overrides["out"]).resolve() != run_dir.resolve():
        raise ConfigError(f"--out cannot be given with --resume: the run stays in {run_dir}")
    # a flag repeated with the run's own value (a multi-node resume repeats the launch flags) is no change
    changes = {k: coerce(k, v) for k, v in overrides.items() if k != "out"}
    forbidden = [k for k, v in changes.items() if k not in RUN_CONTROL_KEYS and v != getattr(saved, k)]
    if forbidden:
        raise ConfigError(f"cannot change {forbidden[0]} when resuming (only {', '.join(RUN_CONTROL_KEYS)})")
    cfg = replace(saved, out=str(run_dir), **changes)
    kept = run_dir / topology_copy_name(Path(cfg.wan.strip())) if cfg.wan and is_file_spec(cfg.wan) else None
    if kept is not None and kept.is_file() and not Path(cfg.wan.strip()).is_file():
        cfg = replace(cfg, wan=str(kept))  # the file has moved: the run's own copy
    step = int(step_dir.name[4:])
    if cfg.steps < step:
        raise ConfigError(f"cannot resume: --steps {cfg.steps} is below the checkpoint's step {step}")
    recorded = checkpoint.recorded_config(step_dir)
    current = fingerprint(cfg, resolve_options(cfg.strategy, vars(cfg)))
    changed = sorted(k for k in set(recorded) | set(current) if recorded.get(k) != current.get(k))
    if changed:
        raise ConfigError(
            f"cannot resume {run_dir}: its config.toml no longer matches the checkpoint of step {step} "
            f"(changed: {', '.join(changed)}); restore those keys, or start a new run"
        )
    if cfg.steps == step and has_summary(run_dir):
        raise ConfigError(
            f"nothing to resume: {run_dir} already finished all {step} steps "
            f"(pass --steps above {step} to train further)"
        )
    return cfg


def train(
    cfg: Config, resume: bool = False, force: bool = False, torchrun: TorchrunEnv | None = None
) -> dict[str, Any] | None:
    """Train with cfg; returns rank 0's summary ({} on a non-zero rank under torchrun).
    `resume` continues from the run directory's newest complete checkpoint; `force` replaces an
    earlier run in the same directory; `torchrun` (the command read it, `runner.torchrun`): this
    process is one of torchrun's ranks, else the launcher starts the workers here."""
    if torchrun is not None:  # the launch says how many workers there are
        cfg = replace(cfg, workers=torchrun.world_size // cfg.ranks_per_worker)
        check_restarts_under_torchrun(cfg)
    options = check_run(cfg)
    check_trust(cfg, torchrun)
    run_dir = Path(cfg.out)
    if torchrun is None:
        check_local_launch(cfg)
    earlier = False  # an earlier run's files to replace
    if torchrun is not None:
        rank = torchrun.rank
        refused, earlier = refusal(run_dir, resume, force) if rank == 0 else (None, False)
        ours, torchrun = adopt(torchrun, cfg, options, run_dir, resume, refused)
        if rank != 0:
            run_rank(ours, run_dir, resume, torchrun, config_text(ours, options))
            return {}
        print(f"wansync: under torchrun: {torchrun.describe()}")
    for line in regime_warnings(cfg.strategy, options, steps=cfg.steps):
        print(f"wansync: warning: {line}", file=sys.stderr)
    try:
        check_unlocked(run_dir, "train into")
        if resume:
            check_run_files(run_dir)
        if not resume and torchrun is None:
            check_target(run_dir, force)  # before anything is written
        make_run_dir(run_dir)
    except OSError as e:  # a name too long, a path through a file
        raise StorageError(f"cannot use run directory {run_dir}: {e.strerror or e}") from None
    with RunLock(run_dir):
        # under torchrun the directory was judged before the agreement: since then another node's
        # first rank may have kept its config.toml in it (a shared --out), which is no earlier run
        if not resume and (earlier if torchrun is not None else check_target(run_dir, force)):
            clear_run(run_dir)
        text = config_text(cfg, options)
        write_config(run_dir, text, cfg)
        (run_dir / SUMMARY_FILE).unlink(missing_ok=True)
        if torchrun is not None:
            run_rank(ours, run_dir, resume, torchrun, config_text(ours, options))
            return read_summary(run_dir)
        code, message = launch.spawn(cfg, run_dir, text, resume=resume)
    if code != 0:
        raise WansyncError(message)
    return read_summary(run_dir)


def check_restarts_under_torchrun(cfg: Config) -> None:
    """Under torchrun an asynchronous learner is not restarted alone: torchrun's agent restarts every
    worker of every node when one fails (its own --max-restarts), so wansync's is refused in one line."""
    if cfg.max_restarts and not cfg.fault_tolerant:
        raise ConfigError(
            "--max-restarts: under torchrun a dead async_diloco learner is not restarted alone (torchrun's agent "
            "restarts every node's workers; use torchrun's --max-restarts, or wansync's own launcher on one host)"
        )


def check_trust(cfg: Config, torchrun: TorchrunEnv | None) -> None:
    """The run secret, --bind and --ports (`trust.settings`): read, checked against torchrun's agents,
    the range against what this host's listeners need, and passed on to every process started here."""
    trust = settle(cfg.secret_file, cfg.bind, cfg.ports)
    across = torchrun is not None and torchrun.nodes
    check_agents(trust, across)
    if torchrun is None:
        workers_here, rendezvous, lighthouse = cfg.workers, False, cfg.fault_tolerant and not cfg.lighthouse
    else:
        workers_here = max(1, torchrun.local_world_size // cfg.ranks_per_worker)
        rendezvous = lighthouse = torchrun.rank == 0
    check_range(
        trust, listeners_needed(workers_here, cfg.fault_tolerant, rendezvous, lighthouse and cfg.fault_tolerant)
    )


def refusal(run_dir: Path, resume: bool, force: bool) -> tuple[WansyncError | None, bool]:
    """Rank 0's objection to its run directory under torchrun (locked, or another run there), found
    before the agreement so that it reaches every rank: none is left waiting for rank 0. Also whether
    an earlier run's files are to be replaced (--force), judged now, before any rank writes."""
    try:
        check_unlocked(run_dir, "train into")
        return None, (not resume and check_target(run_dir, force))
    except WansyncError as e:
        return e, False


def adopt(
    torchrun: TorchrunEnv,
    cfg: Config,
    options: dict[str, Any],
    run_dir: Path,
    resume: bool,
    refused: WansyncError | None = None,
) -> tuple[Config, TorchrunEnv]:
    """This process is one of torchrun's ranks: reachable where torchrun told it to meet the others
    (`join_network`), in agreement with every other rank on what they train (`agree`), and, with
    --threads 0, on its share of the machine's cores. The first rank of a node other than rank 0's
    keeps the node's own copy of config.toml: its resume needs no shared file system. Returns the
    configuration its worker runs (threads resolved) and the environment with this run's round of
    torchrun's store. Rank 0's `refused` is told to every rank, then raised."""
    join_network(torchrun)
    start = checkpoint.checkpoint_step(run_dir) if resume else 0
    agreed = agree(
        torchrun,
        shared(fingerprint(cfg, options), cfg),
        start,
        cfg.peer_timeout,
        None if refused is None else str(refused),
    )
    if refused is not None:
        raise refused
    if torchrun.rejoined and not cfg.fault_tolerant:
        raise ConfigError(
            "this node took the place of one that was gone from a run in training (torchrun's rendezvous); only a "
            "--fault-tolerant run takes a node back: its workers heal from a live peer. Start the run again on "
            "every node, with --resume"
        )
    if torchrun.local_rank == 0 and torchrun.rank != 0:
        keep_config(run_dir, config_text(cfg, options))
        keep_topology(run_dir, cfg)
    ours = cfg if cfg.threads else replace(cfg, threads=agreed.threads)
    return ours, dataclasses.replace(torchrun, round=agreed.round)


def keep_config(run_dir: Path, text: str) -> None:
    """config.toml on a node that does not write the run directory: written when missing or
    different, atomically (on a shared file system rank 0 writes the same text at the same time)."""
    path = make_run_dir(run_dir) / CONFIG_FILE
    try:
        same = path.is_file() and path.read_bytes() == text.encode()
    except OSError as e:
        raise StorageError(f"cannot read {path}: {e.strerror or e}") from None
    if not same:
        files.write_bytes(path, text.encode(), durable=True)


def run_rank(cfg: Config, run_dir: Path, resume: bool, torchrun: TorchrunEnv, text: str) -> None:
    """One of torchrun's ranks: its worker, in this process; under --fault-tolerant, the process of a
    worker's first rank supervises the worker (`launch.spawn` of its ranks), restarting it whole as
    the local launcher would, and the worker's other ranks' processes have nothing left to do."""
    if cfg.fault_tolerant:
        if torchrun.rank % cfg.ranks_per_worker:
            return
        code, message = launch.spawn(cfg, run_dir, text, resume=resume, torchrun=torchrun)
        if code != 0:
            raise WansyncError(message)
    elif worker.run(cfg, run_dir, resume=resume) != 0:
        raise WansyncError((run_dir / LOGS_DIR / f"rank{torchrun.rank}.err").read_text().strip())
