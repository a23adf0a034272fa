"""Checkpoints that resume bit-exactly and survive the crash they exist for.

Layout: RUN_DIR/checkpoints/step00000040/rank{R}.pt, one file per rank per step, each with a
rank{R}.json beside it (SHA-256, size, world size, and the resolved configuration of what the
run computes: a resume under a different one is refused). A rank writes its .pt to a temporary name,
fsyncs it, renames it into place, does the same for its .json and fsyncs the directory, all
before the barrier that ends the save: once any rank goes on, every rank's file is on disk. A
checkpoint is complete when every rank's pair is in place; resume takes the newest complete one
and checks each file against its checksum, so a crash of any rank at any moment costs at most
the checkpoint being written. After the barrier one rank per host (each host's own copy of the
directory: no shared file system needed) marks the step complete (DONE) and prunes: the two newest
complete steps are kept; older ones, incomplete leftovers and temporary files of writers that died
go. A host holds only its own ranks' files, so it judges a step by its mark, never by files it
cannot see. Files
hold only tensors, numbers, strings, lists and dicts and load with
`torch.load(weights_only=True)`: nothing is unpickled.
"""

from __future__ import annotations

import warnings
import hashlib
import io
import json
import shutil
from pathlib import Path
from typing import Any, Callable

import torch

from ..errors import ConfigError, DataError, StorageError
from . import files
from .files import TMP, fsync_dir

KEEP = 2
DONE = "DONE"  # in a step directory: every rank's file was durable (the barrier passed)


def ckpt_root(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints"


def meta_path(path: Path) -> Path:
    return path.with_suffix(".json")


def map_tensors(x: Any, fn: Callable[[torch.Tensor], Any], leaf: Callable[[Any], Any] = lambda v: v) -> Any:
    """`x` (dicts, lists and tuples of tensors and plain values) rebuilt with `fn` applied to every
    tensor and `leaf` to every other value; a dict keeps its type and a state_dict's `_metadata`."""
    if torch.is_tensor(x):
        return fn(x)
    if isinstance(x, dict):
        out = type(x)((k, map_tensors(v, fn, leaf)) for k, v in x.items())
        if hasattr(x, "_metadata"):
            out._metadata = x._metadata
        return out
    if isinstance(x, list):
        return [map_tensors(v, fn, leaf) for v in x]
    if type(x) is tuple:
        return tuple(map_tensors(v, fn, leaf) for v in x)
    return leaf(x)


def compact(state: Any) -> Any:
    """`state` with every tensor whose storage lies mostly outside the state's tensors replaced by a
    copy of its own elements. torch.save (and a deepcopy) writes a view's whole storage: a local_sgd
    model lives in one row of a two-row block, the other holding the buffer its next average lands
    in, and would be written twice. Views that together fill their storage (a model in its flat
    buffer, with at most a few side-band values beside it) are written as they are, without a copy."""
    covered: dict[int, dict[tuple[int, int], int]] = {}

    def count(t: torch.Tensor) -> torch.Tensor:
        if t.layout != torch.strided:
            return t
        nbytes = t.numel() * t.element_size()
        covered.setdefault(t.untyped_storage().data_ptr(), {})[(t.data_ptr(), nbytes)] = nbytes
        return t

    map_tensors(state, count)

    def own(t: torch.Tensor) -> torch.Tensor:
        if t.layout != torch.strided:
            return t
        storage = t.untyped_storage().nbytes()
        used = sum(covered[t.untyped_storage().data_ptr()].values())
        return t.clone() if storage > used + max(used // 8, 4096) else t

    return map_tensors(state, own)


def save_rank(
    run_dir: Path,
    step: int,
    rank: int,
    state: dict[str, Any],
    config: dict[str, Any] | None = None,
    sharded: dict[str, str] | None = None,
) -> Path:
    """Write this rank's state for `step`, durably, with its checksum and `config` (what the run
    computes, checked on resume); `sharded`: the SHA-256 of the files this rank wrote into its worker's
    DCP checkpoint (`save_sharded`), checked with its own. A failure (a full disk) leaves nothing of this
    rank's file behind and raises StorageError."""
    d = ckpt_root(run_dir) / f"step{step:08d}"
    path = d / f"rank{rank}.pt"
    buf = io.BytesIO()
    torch.save(compact(state), buf)
    data = buf.getvalue()
    meta = {
        "sha256": hashlib.sha256(data).hexdigest(),
        "bytes": len(data),
        "world_size": state["world_size"],
        "config": config,
        **({"sharded": sharded} if sharded else {}),
    }
    files.directory(d)
    try:
        fsync_dir(d.parent)
        files.write_bytes(path, data, durable=True, what="checkpoint")
        files.write_bytes(meta_path(path), json.dumps(meta).encode(), durable=True, what="checkpoint")
    except (OSError, StorageError) as e:
        path.unlink(missing_ok=True)
        meta_path(path).unlink(missing_ok=True)
        if isinstance(e, StorageError):
            raise
        raise StorageError(f"cannot write checkpoint {path}: {e.strerror or e}") from None
    return path


def step_dirs(run_dir: Path) -> list[Path]:
    """Every step directory, oldest first."""
    root = ckpt_root(run_dir)
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith("step") and p.name[4:].isdigit())


def is_complete(d: Path) -> bool:
    """The step was marked complete after the barrier (its ranks' files may be on other hosts), or
    every rank's file and checksum are in place (their contents are checked on load)."""
    if (d / DONE).is_file():
        return True
    try:
        world = int(json.loads((d / "rank0.json").read_text())["world_size"])
        metas = [json.loads((d / f"rank{r}.json").read_text()) for r in range(world)]
    except (OSError, ValueError, KeyError, TypeError):
        return False
    return all(m.get("world_size") == world for m in metas) and all((d / f"rank{r}.pt").is_file() for r in range(world))


def prune(run_dir: Path, step: int) -> None:
    """One rank per host, once every rank saved `step` (the barrier passed): mark `step` complete;
    keep the KEEP newest complete checkpoints up to `step`; remove older steps, later ones (left by
    the run a resume abandoned) and temporary files. The mark is written in place, not renamed: on a
    shared file system the hosts mark and prune the same directory at once."""
    d = ckpt_root(run_dir) / f"step{step:08d}"
    try:
        files.touch(d / DONE)
        fsync_dir(d)
    except OSError as e:
        raise StorageError(f"cannot mark checkpoint {d} complete: {e.strerror or e}") from None
    dirs = step_dirs(run_dir)
    _sweep(dirs, [d for d in dirs if int(d.name[4:]) <= step and is_complete(d)][-KEEP:], lambda d: True)


def prune_unmarked(run_dir: Path) -> None:
    """`prune` for learners that never meet (`async_diloco`): each saves its step when it reaches it, so no
    step is marked complete; complete is every rank's file in place (`is_complete`). Keep the KEEP
    newest complete checkpoints and every step newer than them (a slower learner writes there later);
    remove the rest. Nothing a learner may still write is removed: every learner is past a complete step."""
    dirs = step_dirs(run_dir)
    kept = [d for d in dirs if is_complete(d)][-KEEP:]
    if kept:
        _sweep(dirs, kept, lambda d: int(d.name[4:]) < int(kept[-1].name[4:]))


def _sweep(dirs: list[Path], kept: list[Path], removable: Callable[[Path], bool]) -> None:
    """Remove the step directories of `dirs` not `kept` that are `removable`, and the temporary files
    left in the kept ones."""
    for d in dirs:
        if d in kept:
            for leftover in d.glob(f"*{TMP}*"):
                leftover.unlink(missing_ok=True)
        elif removable(d):
            shutil.rmtree(d, ignore_errors=True)


def latest_step_dir(run_dir: Path) -> Path:
    """The newest complete checkpoint of a run directory (one-line errors otherwise)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ConfigError(f"cannot resume: {run_dir} is not a directory")
    if not (run_dir / "config.toml").is_file():
        raise ConfigError(f"cannot resume: {run_dir} is not a wansync run directory (no config.toml)")
    dirs = step_dirs(run_dir)
    if not dirs:
        raise ConfigError(f"cannot resume: no checkpoint in {run_dir} (train with --checkpoint-every N)")
    for d in reversed(dirs):
        if is_complete(d):
            return d
    raise DataError(
        f"cannot resume: no complete checkpoint in {ckpt_root(run_dir)} "
        f"(a rank's file or checksum is missing from each of {', '.join(d.name for d in dirs)})"
    )


def recorded_config(step_dir: Path) -> dict[str, Any]:
    """The configuration the checkpoint in `step_dir` was written under (the record of the lowest
    rank whose file is on this host: every rank records the same)."""
    metas = sorted(Path(step_dir).glob("rank*.json"), key=lambda p: (len(p.name), p.name))
    try:
        config = json.loads(metas[0].read_text()).get("config")
    except (IndexError, OSError, ValueError, AttributeError):
        config = None
    if not isinstance(config, dict):
        raise DataError(f"cannot resume: {step_dir} does not record the configuration it was written under")
    return config


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def damage(step_dir: Path, rank: int) -> str | None:
    """Why this rank's files of the checkpoint in `step_dir` cannot be used (None: they are intact): its
    file against its checksum, then every file of its worker's sharded checkpoint it recorded."""
    path = step_dir / f"rank{rank}.pt"
    if not path.is_file():
        return f"{path} is missing"
    try:
        meta = json.loads(meta_path(path).read_text())
    except (OSError, ValueError):
        return f"{meta_path(path)} is missing or unreadable"
    if not isinstance(meta, dict) or path.stat().st_size != meta.get("bytes") or _sha256(path) != meta.get("sha256"):
        return f"{path} is corrupted or truncated (checksum mismatch)"
    for name, digest in (meta.get("sharded") or {}).items():
        shard = step_dir / name
        if not shard.is_file():
            return f"{shard} is missing"
        if _sha256(shard) != digest:
            return f"{shard} is corrupted or truncated (checksum mismatch)"
    return None


def resume_dir(run_dir: Path, rank: int, lowest: Callable[[int], int] = lambda step: step) -> tuple[Path, list[str]]:
    """The checkpoint every rank resumes from: the newest complete one whose files are intact on every
    rank, and what was passed over (`damage`'s words for each newer one this rank found damaged).
    `lowest(step)`: the lowest of every rank's `step` (an all-reduce MIN; alone: itself), so that all
    ranks settle on the same checkpoint: each proposes its newest intact one at or below the last
    proposal until every rank holds the one proposed. DataError when none is intact everywhere."""
    latest_step_dir(run_dir)  # one-line errors: no directory, no checkpoint
    complete = [d for d in reversed(step_dirs(run_dir)) if is_complete(d)]
    verdicts = {int(d.name[4:]): (d, damage(d, rank)) for d in complete}
    intact = sorted((s for s, (_, why) in verdicts.items() if why is None), reverse=True)
    proposal = intact[0] if intact else -1
    while True:
        step = lowest(proposal)
        if step < 0:
            break
        if lowest(1 if step in intact else 0) == 1:
            return verdicts[step][0], [why for s, (_, why) in verdicts.items() if s > step and why is not None]
        proposal = next((s for s in intact if s < step), -1)
    mine = [why for _, why in verdicts.values() if why is not None]
    raise DataError(
        f"cannot resume: {mine[0] if mine else 'another rank found every checkpoint damaged'}"
        + (" (and no older checkpoint is intact on every rank)" if len(verdicts) > 1 else "")
    )


def load_rank(run_dir: Path, rank: int, world_size: int, step_dir: Path | None = None) -> dict[str, Any]:
    """This rank's state from `step_dir` (default: the newest complete checkpoint), checked against its
    checksum."""
    d = latest_step_dir(run_dir) if step_dir is None else step_dir
    path = d / f"rank{rank}.pt"
    if not path.is_file():
        raise DataError(f"cannot resume: checkpoint {path} is missing")
    data = path.read_bytes()
    try:
        meta = json.loads(meta_path(path).read_text())
    except (OSError, ValueError):
        meta = {}
    if len(data) != meta.get("bytes") or hashlib.sha256(data).hexdigest() != meta.get("sha256"):
        raise DataError(f"cannot resume: checkpoint {path} is corrupted or truncated (checksum mismatch)")
    try:
        state = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any unreadable file is the same user-facing problem
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise DataError(f"cannot resume: checkpoint {path} is corrupted or truncated ({first[:200]})") from None
    if not isinstance(state, dict) or "step" not in state:
        raise DataError(f"cannot resume: {path} is not a wansync checkpoint")
    if state.get("world_size") != world_size:
        raise ConfigError(
            f"cannot resume: checkpoint was written by {state.get('world_size')} processes, "
            f"this run has {world_size}"
        )
    return state


def checkpoint_step(run_dir: Path) -> int:
    return int(latest_step_dir(run_dir).name[4:])


# ---- a worker sharded inside (FSDP): its model and optimizer through torch.distributed.checkpoint
SHARDED_DIR = "worker{worker}"  # in a step directory: one DCP checkpoint per worker


def save_sharded(run_dir: Path, step: int, worker: int, model: Any, optimizer: Any, group: Any) -> dict[str, str]:
    """The model and inner optimizer of a worker sharded with FSDP2, written by its ranks together
    with torch.distributed.checkpoint (each rank its own shards; sharded state dicts) into the step
    directory, before the ranks' own files: a rank's file on disk means its worker's shards are.
    Workers write apart because their models differ between synchronizations. Returns the SHA-256 of
    the files this rank wrote (its shards, `__<its rank in the worker>_*.distcp`, and the first rank
    the metadata), by their path in the step directory, for its own file's record (`save_rank`)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer)
    d = files.directory(ckpt_root(run_dir) / f"step{step:08d}" / SHARDED_DIR.format(worker=worker))
    try:
        with warnings.catch_warnings():  # a step saved again (a resume fell back past it) is overwritten on purpose
            warnings.filterwarnings("ignore", message="Detected an existing checkpoint", category=UserWarning)
            dcp.save({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=str(d), process_group=group)
        me = dist.get_rank(group) if group is not None else 0
        mine = sorted(d.glob(f"__{me}_*.distcp")) + ([d / ".metadata"] if me == 0 else [])
        return {f"{d.name}/{f.name}": _sha256(f) for f in mine}
    except OSError as e:
        raise StorageError(f"cannot write checkpoint {d}: {e.strerror or e}") from None
    except dcp.api.CheckpointException as e:  # a BaseException: what failed on which rank, a full disk among them
        raise StorageError(f"cannot write checkpoint {d}: {dcp_failure(e)}") from None


def dcp_failure(e: Any) -> str:
    """What a DCP CheckpointException's ranks met, in words: a file system's error first (ENOSPC)."""
    failures = [(rank, exc) for rank, (exc, _) in sorted(e.failures.items())]
    cause = next(((r, x) for r, x in failures if isinstance(x, OSError)), failures[0] if failures else None)
    if cause is None:
        return "torch.distributed.checkpoint failed"
    rank, exc = cause
    text = exc.strerror if isinstance(exc, OSError) and exc.strerror else (str(exc).strip().splitlines() or [""])[0]
    return f"{text or type(exc).__name__} (rank {rank} of the worker; {len(failures)} of its ranks failed)"


def load_sharded(
    run_dir: Path, worker: int, model: Any, optimizer: Any, group: Any, step_dir: Path | None = None
) -> None:
    """Restore what `save_sharded` wrote for this worker in `step_dir` (default: the newest complete
    checkpoint); its files were checked against their digests with the rank's own (`damage`)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    d = (latest_step_dir(run_dir) if step_dir is None else step_dir) / SHARDED_DIR.format(worker=worker)
    if not (d / ".metadata").is_file():
        raise DataError(f"cannot resume: {d} holds no sharded checkpoint (was the run started with --inside fsdp?)")
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optimizer": optim_sd}
    try:
        dcp.load(state, checkpoint_id=str(d), process_group=group)
    except Exception as e:  # noqa: BLE001 - an unreadable checkpoint is one user-facing problem
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise DataError(f"cannot resume: sharded checkpoint {d} is unreadable ({first[:200]})") from None
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
