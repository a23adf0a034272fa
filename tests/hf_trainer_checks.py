"""What tests/test_hf_trainer.py checks of a practitioner's Trainer runs, under torchrun: several tiny
Llama runs of examples/hf_trainer.py's `train()` in one launch (its start-up, torch's and transformers'
imports, is most of the time), each rank's findings written to OUT/rank<R>.json.

    torchrun --standalone --nproc-per-node 2 tests/hf_trainer_checks.py OUT

First, on a plain group (no link emulated; then the group is made again under the link):

- **strategies**: diloco, streaming and sparseloco 12 steps straight, then 8 steps with a checkpoint
  and a new Trainer resumed from it to 12 (their logs, and the parameters' hashes); ddp with one and two
  micro-batches a step; two settings the adapter refuses.

The runs, on the emulated `cross-region` link:

- **snippet**: docs/hf_trainer.md's settings, no `use_cpu=True`, streaming with two micro-batches a
  step, a run directory with an evaluation set, a checkpoint at the last step: the Trainer's world,
  the batches each rank saw, the ranks' final parameters and the saved model's (hashes);
- **logs1 / logs40**: diloco with `logging_steps` 1 and 40, otherwise the same (a checkpoint at the
  last step each: logs40's is the one the resumes below try), their exposed share;
- **precision**: `bf16=True` and `torch_compile=True` (the eager backend: a graph is captured without
  a compiler's minutes): the dtype of the activations a hook sees, the graphs dynamo made;
- **resumes**: logs40's diloco checkpoint resumed as sparseloco, with other options, and as streaming:
  each refusal's line, and what was trained (nothing). The test resumes it in one process too, with
  examples/hf_trainer.py's command line.
"""

from __future__ import annotations

import gc
import hashlib
import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import transformers

import wansync as ws
from wansync.errors import ConfigError

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "hf_trainer.py"
DILOCO = {"sync_every": 4}


def example() -> Any:
    spec = importlib.util.spec_from_file_location("hf_trainer_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def digest(state: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for k in sorted(state):
        h.update(k.encode())
        h.update(state[k].detach().float().contiguous().numpy().tobytes())
    return h.hexdigest()


class Watch(transformers.TrainerCallback):
    """Hooks on the model the Trainer trains: each training forward's batch (hashed rows) and the dtype
    of the first attention projection's output."""

    def __init__(self) -> None:
        self.rows: list[str] = []
        self.dtypes: set[str] = set()

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        def batch(module: Any, a: Any, kw: dict[str, Any]) -> None:
            if torch.is_grad_enabled():
                self.rows += [hashlib.sha256(r.numpy().tobytes()).hexdigest()[:16] for r in kw["input_ids"]]

        def out(module: Any, a: Any, y: torch.Tensor) -> None:
            if torch.is_grad_enabled():
                self.dtypes.add(str(y.dtype))

        model.register_forward_pre_hook(batch, with_kwargs=True)
        model.model.layers[0].self_attn.q_proj.register_forward_hook(out)


def resume_refused(ex: Any, out: str, checkpoint: str, strategy: str, options: dict[str, Any]) -> dict[str, Any]:
    """Resume `checkpoint` to step 16 as `strategy` with `options`: the refusal's line and what was trained."""
    found: dict[str, Any] = {"error": None}
    trainers: list[Any] = []
    original = ex.WansyncTrainer.__init__

    def keep(self: Any, *a: Any, **k: Any) -> None:
        original(self, *a, **k)
        trainers.append(self)

    ex.WansyncTrainer.__init__ = keep
    try:
        ex.train(strategy, out, steps=16, resume=checkpoint, options=options, save_strategy="steps", save_steps=4)
    except ConfigError as e:
        found["error"] = str(e)
    finally:
        ex.WansyncTrainer.__init__ = original
    trainer = trainers[0]
    found["sync_steps"] = trainer.sync.t if trainer.sync is not None else None
    found["losses"] = [h for h in trainer.state.log_history if "loss" in h]
    found["saved"] = sorted(p.name for p in Path(out).glob("checkpoint-*"))
    return found


def refused(ex: Any, root: str, **settings: Any) -> str:
    args = transformers.TrainingArguments(output_dir=root, use_cpu=True, report_to=[], max_steps=1, **settings)
    try:
        ex.WansyncTrainer(model=ex.tiny_llama(), args=args, train_dataset=ex.Bytes("abcd" * 5000), strategy="diloco")
    except ConfigError as e:
        return str(e)
    return "accepted"


def strategies(ex: Any, out: Path) -> dict[str, Any]:
    """Every strategy 12 steps straight, then 8 steps with a checkpoint and a new Trainer resumed from it
    to 12; ddp with 1 and 2 micro-batches a step (the first under no_sync()); two refused settings."""
    found: dict[str, Any] = {}
    for s in ("diloco", "streaming", "sparseloco"):
        straight = ex.train(s, f"{out}/{s}")
        found[s] = {"logs": straight.state.log_history, "params": digest(straight.model.state_dict())}
        found[s]["t"] = straight.sync.t
        found[s]["stopped_at"] = ex.train(s, f"{out}/{s}-resumed", stop_at=8).sync.t
        resumed = ex.train(s, f"{out}/{s}-resumed", resume=f"{out}/{s}-resumed/checkpoint-8")
        found[s]["resumed"], found[s]["resumed_t"] = digest(resumed.model.state_dict()), resumed.sync.t
    found["ddp"] = {n: ex.train("ddp", f"{out}/ddp{n}", steps=4, accumulation=n).state.log_history for n in (1, 2)}
    found["refused"] = [
        refused(ex, f"{out}/refused", load_best_model_at_end=True, eval_strategy="steps", save_strategy="steps"),
        refused(ex, f"{out}/refused", fsdp="full_shard"),
    ]
    return found


def main(out: Path) -> None:
    ws.init()
    rank = dist.get_rank()
    ex = example()
    # every Trainer's train() ends in accelerate's gc.collect(): over the millions of objects torch and
    # transformers made at import, seconds over this launch's runs; frozen, the collections pass over them
    gc.freeze()
    found: dict[str, Any] = {"strategies": strategies(ex, out / "strategies")}
    dist.destroy_process_group()  # the same ranks again, under the emulated link
    ws.init(wan="cross-region")

    watch = Watch()
    snippet = ex.train(
        "streaming",
        str(out / "snippet"),
        accumulation=2,
        run_dir=str(out / "snippet-run"),
        callbacks=[watch],
        logging_steps=4,
        save_strategy="steps",
        save_steps=12,
    )
    found["snippet"] = {
        "world": dist.get_world_size(),
        "trainer_world": snippet.args.world_size,
        "processes": snippet.accelerator.num_processes,
        "process_index": snippet.args.process_index,
        "rows": watch.rows,
        "sync_steps": snippet.sync.t,
        "trained_module": type(snippet.model_wrapped).__name__,
        "final": digest(snippet.model.state_dict()),
    }
    if rank == 0:
        from safetensors.torch import load_file

        saved = load_file(str(out / "snippet" / "checkpoint-12" / "model.safetensors"))
        mine = snippet.model.state_dict()
        found["snippet"]["saved"] = digest({k: saved[k] for k in mine if k in saved})
        found["snippet"]["saved_keys"] = len(saved)

    for n in (1, 40):
        t = ex.train(
            "diloco", str(out / f"logs{n}"), options=DILOCO, logging_steps=n, save_strategy="steps", save_steps=12
        )
        found[f"logs{n}"] = {
            "exposed_pct": t.state.log_history[-1]["wansync/exposed_pct"],
            "logged": len([h for h in t.state.log_history if "loss" in h]),
            "runtime": t.state.log_history[-1]["train_runtime"],
        }

    watch = Watch()
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    precise = ex.train(
        "diloco",
        str(out / "precision"),
        steps=4,
        options=DILOCO,
        callbacks=[watch],
        use_cpu=True,  # TrainingArguments refuses bf16 on a CPU without it
        bf16=True,
        torch_compile=True,
        torch_compile_backend="eager",
    )
    found["precision"] = {
        "dtypes": sorted(watch.dtypes),
        "graphs": torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs,
        "loss": [h["loss"] for h in precise.state.log_history if "loss" in h],
        "forward_restored": "forward" not in vars(precise.model),
    }

    checkpoint = str(out / "logs40" / "checkpoint-12")
    found["resumes"] = {
        "sparseloco": resume_refused(ex, str(out / "as-sparseloco"), checkpoint, "sparseloco", {"sync_every": 4}),
        "options": resume_refused(ex, str(out / "other-options"), checkpoint, "diloco", {"sync_every": 8}),
        "streaming": resume_refused(ex, str(out / "as-streaming"), checkpoint, "streaming", ex.OPTIONS["streaming"]),
    }
    (out / f"rank{rank}.json").write_text(json.dumps(found))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
