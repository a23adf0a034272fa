"""One rule for run directories (`rundir.claim`, issue 61): `train --out`, `ws.Run(out=...)` and the
Trainer's `run_dir` take the same directories and refuse the same ones, and a run is continued only
where its caller says so, and only when it is the same run (strategy, options, world)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

from wansync.errors import ConfigError
from wansync.rundir.claim import Claim, claim
from wansync.runner.localgroup import run_ranks
from wansync.strategies import make_options

pytestmark = pytest.mark.timeout(180)

OPTIONS = {"sync_every": 2}
USERS = "not empty and not a wansync run (it holds 'notes.txt')"
FINISHED = "already holds a wansync run (finished: its summary.json)"


def finished_run(d: Path, workers: int = 2, **options: Any) -> Path:
    """A run as `ws.Run` leaves it: local_sgd on `workers` workers, its summary and metrics."""
    d.mkdir(parents=True)
    opts = dataclasses.asdict(make_options("local_sgd", **{**OPTIONS, **options}))
    summary = {"strategy": "local_sgd", "steps": 2, "workers": workers, "ranks_per_worker": 1, "options": opts}
    (d / "summary.json").write_text(json.dumps(summary))
    (d / "metrics.jsonl").write_text(json.dumps({"type": "step", "step": 1, "loss": 1.0}) + "\n")
    return d


def users_dir(d: Path) -> Path:
    d.mkdir(parents=True)
    (d / "notes.txt").write_text("mine\n")
    return d


def identity(**changes: Any) -> dict[str, Any]:
    opts = dataclasses.asdict(make_options("local_sgd", **OPTIONS))
    return {"strategy": "local_sgd", "workers": 2, "ranks_per_worker": 1, "options": opts, **changes}


def test_the_rule(tmp_path):
    take = dict(action="train into", where="--out")
    assert claim(tmp_path / "new", **take) is Claim.FRESH
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / ".lock").write_text("")
    assert claim(tmp_path / "empty", **take) is Claim.FRESH  # a lock is no content
    with pytest.raises(ConfigError, match="not empty and not a wansync run"):
        claim(users_dir(tmp_path / "users"), **take, replace=True)  # --force never takes a user's files
    with pytest.raises(ConfigError, match="not empty and not a wansync run"):
        claim(tmp_path / "users", **take, resume=True)
    run = finished_run(tmp_path / "run")
    with pytest.raises(ConfigError, match=r"already holds a wansync run \(finished"):
        claim(run, **take)
    assert claim(run, **take, replace=True) is Claim.REPLACE
    assert claim(run, **take, resume=True, identity=identity()) is Claim.CONTINUE
    for change, says in (
        ({"strategy": "diloco"}, "its strategy is 'local_sgd', this run's 'diloco'"),
        ({"workers": 4}, "its workers is 2, this run's 4"),
        ({"options": identity()["options"] | {"sync_every": 3}}, "its option sync_every is 2, this run's 3"),
    ):
        with pytest.raises(ConfigError, match=f"cannot continue the run in .*: {says}"):
            claim(run, **take, resume=True, identity=identity(**change))
    file = tmp_path / "file"
    file.write_text("x")
    with pytest.raises(ConfigError, match="exists and is not a directory"):
        claim(file, **take)


def test_a_run_that_recorded_nothing_is_continued_and_its_first_record_makes_it_a_run(tmp_path):
    d = tmp_path / "killed"  # a loop of the user's killed before it closed: metrics.jsonl only
    d.mkdir()
    (d / "metrics.jsonl").write_text(json.dumps({"type": "step", "step": 3, "loss": 2.0}) + "\n")
    take = dict(action="train into", where="--out")
    with pytest.raises(ConfigError, match="already holds a wansync run: "):
        claim(d, **take)
    assert claim(d, **take, resume=True, identity=identity(strategy="diloco")) is Claim.CONTINUE
    (d / "metrics.jsonl").write_text("my own log\n")
    with pytest.raises(ConfigError, match="not a wansync run"):
        claim(d, **take)


def _surfaces(rank: int, world: int, dirs: dict[str, str]) -> dict[str, str]:
    """ws.Run and the Trainer, each into the user's directory and the finished run; then ws.Run continuing
    the finished run as the same run and as another."""
    import os

    import torch

    import wansync as ws

    def attempt(make: Any) -> str:
        try:
            run = make()
        except ConfigError as e:
            return str(e)
        (run.close() if hasattr(run, "close") else None) if run is not None else None
        return "accepted"

    model = torch.nn.Linear(4, 1)
    sync = ws.strategy("local_sgd", model, torch.optim.SGD(model.parameters(), lr=0.1), **OPTIONS)
    other = ws.strategy("local_sgd", model, torch.optim.SGD(model.parameters(), lr=0.1), sync_every=3)
    out = {
        f"run {name}": attempt(lambda d=d: ws.Run(sync, out=d, quiet=True))
        for name, d in dirs.items()
        if name != "same"
    }
    out["run other"] = attempt(lambda: ws.Run(other, out=dirs["finished"], quiet=True, append=True))
    out["run users append"] = attempt(lambda: ws.Run(sync, out=dirs["users"], quiet=True, append=True))
    out["run same"] = attempt(lambda: ws.Run(sync, out=dirs["same"], quiet=True, append=True))

    import transformers

    from wansync.integrations.hf import WansyncTrainer

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    for name in ("users", "finished"):
        args = transformers.TrainingArguments(
            output_dir=f"{dirs['scratch']}/hf", use_cpu=True, report_to=[], max_steps=1, disable_tqdm=True
        )
        data = [{"input_ids": torch.tensor([1, 2, 3, 4]), "labels": torch.tensor([1, 2, 3, 4])}] * 8
        cfg = transformers.LlamaConfig(
            vocab_size=16, hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2
        )
        trainer = WansyncTrainer(
            model=transformers.LlamaForCausalLM(cfg),
            args=args,
            train_dataset=data,
            strategy="local_sgd",
            strategy_options=OPTIONS,
            run_dir=dirs[name],
        )
        out[f"trainer {name}"] = attempt(lambda t=trainer: t.train() and None)
    return out


def test_train_ws_run_and_the_trainer_refuse_the_same_directories_and_continue_only_the_same_run(tmp_path, capsys):
    from wansync.cli import main

    dirs = {
        "users": str(users_dir(tmp_path / "users")),
        "finished": str(finished_run(tmp_path / "finished")),
        "same": str(finished_run(tmp_path / "same")),
        "scratch": str(tmp_path / "scratch"),
    }
    said = {}
    for name in ("users", "finished"):
        with pytest.raises(SystemExit) as e:
            main(["train", "--out", dirs[name], "--steps", "1", "--quiet"])
        assert e.value.code == 1
        said[name] = capsys.readouterr().err
    before = {name: sorted(p.name for p in Path(d).iterdir()) for name, d in dirs.items() if name != "scratch"}
    for out in run_ranks(
        _surfaces, 2, {k: v for k, v in dirs.items() if k != "scratch"} | {"scratch": dirs["scratch"]}
    ):
        for surface in ("train", "run", "trainer"):
            users = said["users"] if surface == "train" else out[f"{surface} users"]
            finished = said["finished"] if surface == "train" else out[f"{surface} finished"]
            assert USERS in users and "\n" not in users.strip(), (surface, users)
            assert FINISHED in finished and "\n" not in finished.strip(), (surface, finished)
        assert "its option sync_every is 2, this run's 3" in out["run other"]
        assert USERS in out["run users append"]
        assert out["run same"] == "accepted"
    assert "--resume" in said["finished"] and "--force" in said["finished"]
    for name in ("users", "finished"):  # nothing written into what was refused
        assert sorted(p.name for p in Path(dirs[name]).iterdir()) == before[name]
