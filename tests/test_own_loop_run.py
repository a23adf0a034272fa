"""Your own loop gets what `wansync train` has (`ws.Run`, run through examples/own_loop.py): the
profiler that adds up, DDP's exposed communication, the run directory `wansync report` reads, the
guards at construction, TensorBoard (also from the CLI's `--tensorboard`) and the progress line."""

from __future__ import annotations

import csv
import importlib.util
import io
import json
import tomllib
import warnings
from pathlib import Path
from typing import Any

import pytest

from cli_harness import TINY, wansync
from wansync.runner.localgroup import run_ranks
from wansync.telemetry.progress import Progress

pytestmark = pytest.mark.timeout(180)

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "own_loop.py"
STEP_TAGS = {"train/loss", "train/items_per_s", "comm/exposed_s", "comm/exposed_pct", "comm/bytes_sent"}
SYNC_TAGS = {"sync/events", "sync/bytes", "sync/drift"}


def example() -> Any:
    spec = importlib.util.spec_from_file_location("own_loop", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def scalars(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar series in `log_dir`, read back by TensorBoard's own reader."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def _two_loops(rank: int, world: int, root: str) -> dict[str, Any]:
    """examples/own_loop.py twice in one group of 2 ranks: ddp on an emulated `lan` link (a group
    under the emulator, as `ws.init(wan="lan")` makes the default one), then diloco with H = 5,
    which the Nesterov guard warns about."""
    import torch.distributed as dist

    from wansync import net

    lan = dist.new_group(backend=net.install(), pg_options=net.Emulator(net.parse_wan("lan"), seed=0))
    train = example().train
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train(f"{root}/ddp", "ddp", steps=12, eval_every=6, tensorboard=True, group=lan)
        built = len(caught)
        train(f"{root}/diloco", "diloco", steps=12, eval_every=6, tensorboard=True, sync_every=5)
        train(f"{root}/sparseloco", "sparseloco", steps=12, eval_every=6, tensorboard=True, sync_every=3, density=0.1)
    return {
        "ddp": [str(w.message) for w in caught[:built]],
        "diloco": [(w.category.__name__, str(w.message), Path(w.filename).name) for w in caught[built:]],
    }


def test_a_user_loop_gets_the_profile_run_directory_guards_and_tensorboard_of_the_cli(tmp_path):
    warned = run_ranks(_two_loops, 2, str(tmp_path), timeout=150)
    # the guard, at construction, once (rank 0), pointing at the user's line; nothing else to say
    assert warned[0]["ddp"] == [] and warned[1] == {"ddp": [], "diloco": []}
    assert [(c, f) for c, m, f in warned[0]["diloco"]] == [("RegimeWarning", "own_loop.py")]
    assert warned[0]["diloco"][0][1].startswith(
        "diloco: outer Nesterov momentum 0.9 (gain 7) applied as often " "as every 5 inner steps"
    )
    for name in ("ddp", "diloco", "sparseloco"):
        run = tmp_path / name
        prof = json.loads((run / "profile.json").read_text())
        summary = json.loads((run / "summary.json").read_text())
        wall = prof["wall_clock_s"]
        assert abs(sum(prof["categories_s"].values()) - wall) <= 0.01 * wall, prof["categories_s"]
        assert summary["wall_clock_s"] == wall and summary["steps"] == 12 and summary["workers"] == 2
        assert summary["strategy"] == name and summary["final_val_loss"] < summary["first_eval"]
        for rank in (0, 1):  # every rank's step times, for the planner
            steps_s = json.loads((run / "logs" / f"profile_rank{rank}.json").read_text())["steps_s"]
            assert len(steps_s["compute"]) == len(steps_s["other"]) == 12
        tags = scalars(run / "tensorboard")
        assert STEP_TAGS | {"eval/val_loss"} <= set(tags), sorted(tags)
        assert [s for s, _ in tags["train/loss"]] == list(range(1, 13))
        assert [s for s, _ in tags["eval/val_loss"]] == [6, 12]
    ddp = json.loads((tmp_path / "ddp" / "profile.json").read_text())
    # DDP's blocked time, from the comm hook the run installs: on the emulated link, and complete
    assert ddp["categories_s"]["exposed_comm"] > 0 and ddp["derived"]["ddp_instrumented"]
    assert ddp["wan"]["emulated"] and "RTT" in ddp["wan"]["link"] and ddp["derived"]["events_complete"]
    assert len(ddp["events"]) == 12 and all(e["bytes"] > 0 for e in ddp["events"])
    diloco = json.loads((tmp_path / "diloco" / "summary.json").read_text())
    assert diloco["sync_events"] >= 2 and diloco["wan"] is None
    assert SYNC_TAGS <= set(scalars(tmp_path / "diloco" / "tensorboard"))
    sparse = json.loads((tmp_path / "sparseloco" / "summary.json").read_text())
    assert sparse["sync_events"] == 4 and set(sparse["comm"]["pseudo_grads"]["parts"]) == {
        "indices",
        "values",
        "tables",
    }
    assert {"sync/events", "sync/bytes"} <= set(scalars(tmp_path / "sparseloco" / "tensorboard"))
    # `wansync report` reads both like any other runs
    r = wansync("report", str(tmp_path), "--no-plots")
    assert r.returncode == 0, r.stderr
    with open(tmp_path / "summary.csv", newline="") as f:
        rows = {row["setting"]: row for row in csv.DictReader(f)}
    assert {k: (row["status"], row["exposed_comm_pct_mean"] != "") for k, row in rows.items()} == {
        "ddp": ("ok", True),
        "diloco": ("ok", True),
        "sparseloco": ("ok", True),
    }, r.stdout


def test_tensorboard_from_the_command_line(tmp_path):
    out = tmp_path / "run"
    r = wansync(
        "train",
        "--strategy",
        "local_sgd",
        "--sync-every",
        "2",
        "--workers",
        "2",
        "--steps",
        "4",
        "--eval-every",
        "2",
        "--tensorboard",
        "--out",
        str(out),
        *TINY,
    )
    assert r.returncode == 0, r.stderr
    tags = scalars(out / "tensorboard")
    assert STEP_TAGS | SYNC_TAGS | {"train/lr", "eval/val_loss", "eval/val_ppl", "eval/val_bpb"} <= set(tags)
    assert [s for s, _ in tags["sync/events"]] == [2, 4] and [v for _, v in tags["sync/events"]] == [1, 2]
    assert [s for s, _ in tags["eval/val_loss"]] == [2, 4]
    assert tomllib.loads((out / "config.toml").read_text())["run"]["tensorboard"] is True


def _no_tensorboard() -> None:
    """The CLI's process, as on a machine without the tensorboard package."""
    real = importlib.util.find_spec
    importlib.util.find_spec = lambda name, *a, **k: None if name == "tensorboard" else real(name, *a, **k)


def test_tensorboard_missing_is_one_line_before_any_work(tmp_path):
    r = wansync("train", "--tensorboard", "--out", str(tmp_path / "run"), *TINY, setup=_no_tensorboard)
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines() == [
        "wansync: error: TensorBoard scalars need the tensorboard package: " "pip install 'wansync[tensorboard]'"
    ]
    assert not (tmp_path / "run").exists()


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_is_a_tqdm_bar_on_a_terminal_and_plain_lines_elsewhere():
    def drive(stream: io.StringIO, **kw: Any) -> str:
        p = Progress(25, every=10, stream=stream, prefix="[ddp] ", **kw)
        for step in range(1, 26):
            p.update(step, "loss 1.000 512 tok/s")
        p.log("step 25: val_loss 1.0000")
        p.close()
        return stream.getvalue()

    plain = [
        "[ddp] step 10/25 loss 1.000 512 tok/s",
        "[ddp] step 20/25 loss 1.000 512 tok/s",
        "[ddp] step 25/25 loss 1.000 512 tok/s",
        "[ddp] step 25: val_loss 1.0000",
    ]
    assert drive(io.StringIO()).splitlines() == plain  # a log file, CI: as before tqdm
    assert drive(Terminal(), quiet=True).splitlines() == plain  # --quiet on a terminal
    assert drive(Terminal(), enabled=False) == ""  # ranks but the first
    bar = drive(Terminal())
    assert "25/25" in bar and "step/s" in bar and "<00:00" in bar and "loss 1.000 512 tok/s" in bar  # rate, ETA
    assert "[ddp] step 25: val_loss 1.0000\n" in bar and "step 10/25 loss" not in bar


def _hf_loops(rank: int, world: int, root: str) -> dict[str, Any]:
    """A Hugging Face LlamaForCausalLM in the user's loop under `ws.Run`: ddp on an emulated `lan`
    link, then cpdp with transformers' own cosine schedule, warmup from 0 and decay to 0 (an inner
    lr of 0 at cpdp's boundaries, steps 4 and 8)."""
    import torch
    import torch.distributed as dist
    from transformers import LlamaConfig, LlamaForCausalLM, get_cosine_schedule_with_warmup

    import wansync as ws
    from wansync import net

    lan = dist.new_group(backend=net.install(), pg_options=net.Emulator(net.parse_wan("lan"), seed=0))
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=32,
        use_cache=False,
    )
    tokens = torch.randint(0, 64, (8, 4, 16), generator=torch.Generator().manual_seed(rank))
    lrs = {}
    for name, group, steps in (("ddp", lan, 8), ("cpdp", None, 8)):
        torch.manual_seed(0)
        model = LlamaForCausalLM(config)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        schedule = get_cosine_schedule_with_warmup(opt, num_warmup_steps=4, num_training_steps=4)
        sync = ws.strategy(name, model, opt, group=group, **({"sync_every": 4} if name == "cpdp" else {}))
        seen = []
        with ws.Run(sync, out=f"{root}/{name}", steps=steps) as run:
            for step in range(steps):
                batch = tokens[step]
                loss = sync.model(input_ids=batch, labels=batch).loss
                loss.backward()
                sync.step()
                sync.zero_grad()
                seen.append(opt.param_groups[0]["lr"])
                if name == "cpdp":
                    schedule.step()
                run.log(loss, items=batch.numel())
            sync.finish()
            with torch.no_grad():
                run.evaluate({"val_loss": float(model(input_ids=tokens[0], labels=tokens[0]).loss)})
        lrs[name] = seen
    return lrs


def test_a_hugging_face_model_in_the_users_loop(tmp_path):
    pytest.importorskip("transformers")
    lrs = run_ranks(_hf_loops, 2, str(tmp_path), timeout=150)
    assert lrs[0]["cpdp"][0] == 0.0 and 0.0 in lrs[0]["cpdp"][4:]  # boundaries at lr 0 finished
    ddp = json.loads((tmp_path / "ddp" / "profile.json").read_text())
    wall = ddp["wall_clock_s"]
    assert abs(sum(ddp["categories_s"].values()) - wall) <= 0.01 * wall, ddp["categories_s"]
    assert ddp["categories_s"]["exposed_comm"] > 0 and ddp["wan"]["emulated"]
    r = wansync("report", str(tmp_path), "--no-plots")
    assert r.returncode == 0, r.stderr
    with open(tmp_path / "summary.csv", newline="") as f:
        assert {row["setting"]: row["status"] for row in csv.DictReader(f)} == {"ddp": "ok", "cpdp": "ok"}


def _second_run_into(rank: int, world: int, root: str) -> dict[str, Any]:
    """A finished ws.Run, then a second one into the same directory: refused (its metrics.jsonl kept),
    unless it asks to append."""
    import torch
    import wansync as ws
    from wansync.errors import ConfigError

    model = torch.nn.Linear(4, 1)
    sync = ws.strategy("local_sgd", model, torch.optim.SGD(model.parameters(), lr=0.1), sync_every=2)
    with ws.Run(sync, out=root, quiet=True) as run:
        for _ in range(2):
            model(torch.ones(2, 4)).sum().backward()
            sync.step()
            sync.zero_grad()
            run.log(0.5)
        sync.finish()
        run.evaluate({"val_loss": 0.5})
    torch.distributed.barrier()  # rank 0 has written summary.json: a second program would start after it
    before = (Path(root) / "metrics.jsonl").read_text() if rank == 0 else ""
    try:
        ws.Run(sync, out=root, quiet=True)
        refused = ""
    except ConfigError as e:
        refused = str(e)
    after = (Path(root) / "metrics.jsonl").read_text() if rank == 0 else ""
    again = ws.Run(sync, out=root, quiet=True, append=True)
    again.close()
    return {"refused": refused, "kept": before == after}


def test_a_second_run_into_a_finished_directory_is_refused_unless_it_appends(tmp_path):
    for out in run_ranks(_second_run_into, 2, str(tmp_path / "run")):
        assert "already holds a wansync run (finished" in out["refused"] and "append=True" in out["refused"]
        assert "\n" not in out["refused"] and out["kept"]


def _left_open(rank: int, world: int, out: str) -> list[str]:
    """A run never closed, then one closed, each dropped: what each said on stderr once collected."""
    import contextlib
    import gc

    import torch

    import wansync as ws

    said = []
    for close in (False, True):
        model = torch.nn.Linear(4, 2)
        sync = ws.strategy("local_sgd", model, torch.optim.SGD(model.parameters(), lr=0.1), sync_every=2)
        err = io.StringIO()
        with contextlib.redirect_stderr(err), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the closed run's "last evaluation is missing"
            run = ws.Run(sync, out=f"{out}/{close}", quiet=True)
            if close:
                run.close()
            del run, sync, model
            gc.collect()
        said.append(err.getvalue())
    return said


def test_a_run_never_closed_says_so_once_and_a_closed_one_says_nothing(tmp_path):
    left, closed = run_ranks(_left_open, 1, str(tmp_path))[0]
    assert left.count("was never closed: summary.json and profile.json were not written") == 1, left
    assert f"ws.Run(out={tmp_path}/False)" in left and "run.close()" in left
    assert closed == "", closed
