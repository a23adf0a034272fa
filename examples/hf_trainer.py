"""A Hugging Face `transformers.Trainer` training under a wansync strategy (`WansyncTrainer`,
docs/hf_trainer.md): a tiny Llama (about 200k parameters, built from a config: nothing is downloaded)
on the bundled Shakespeare, byte by byte.

    python examples/hf_trainer.py --strategy diloco --out runs/hf/diloco                  # one process
    torchrun --standalone --nproc-per-node 2 examples/hf_trainer.py --strategy streaming --out runs/hf/streaming
    torchrun --standalone --nproc-per-node 2 examples/hf_trainer.py --strategy sparseloco \\
        --out runs/hf/sparse --resume runs/hf/sparse/checkpoint-8                          # continue a run
    torchrun --standalone --nproc-per-node 2 examples/hf_trainer.py --strategy diloco --bf16 \\
        --wan cross-region --run-dir runs/hf/diloco-run && wansync report runs/hf/diloco-run

The ranks train on the CPU, data-parallel, without `use_cpu=True` (WansyncTrainer sets up the world
accelerate would otherwise see as one process per rank). The Trainer logs `wansync/exposed_pct` and
`wansync/bytes` beside its loss (TensorBoard too, with `--tensorboard`); rank 0 prints the last log line
and the run's totals. `--run-dir` keeps the run for `wansync report`: its training loss, an evaluation
of the final model, exposed share and bytes. With `--params-out FILE` every rank saves its final
parameters (`FILE.rank<R>`), which the test compares across runs.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import torch
import torch.distributed as dist
import transformers

import wansync as ws
from wansync.errors import ConfigError
from wansync.integrations.hf import WansyncTrainer
from wansync.workloads.lm.corpus import shakespeare_text

# a few syncs in a dozen steps: the example's runs are short
OPTIONS = {
    "diloco": {"sync_every": 4},
    "streaming": {"sync_every": 4, "fragments": 2, "overlap": 1},
    "sparseloco": {"sync_every": 4, "density": 0.1},
}


class Bytes(torch.utils.data.Dataset):
    """Windows of `seq_len` bytes of the text, at fixed offsets; labels are the inputs (the model shifts)."""

    def __init__(self, text: str, seq_len: int = 32, windows: int = 512):
        data = torch.tensor(list(text.encode("utf-8")[: seq_len * windows]), dtype=torch.long)
        self.windows = data[: seq_len * windows].view(windows, seq_len)

    def __len__(self) -> int:
        return len(self.windows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.windows[i], "labels": self.windows[i]}


def tiny_llama(seed: int = 0) -> transformers.LlamaForCausalLM:
    config = transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=64,
        use_cache=False,
    )
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(config)


class StopAt(transformers.TrainerCallback):
    """Save a checkpoint and stop at step `step`: an interruption, for trying `--resume`."""

    def __init__(self, step: int):
        self.step = step

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        if state.global_step == self.step:
            control.should_save = control.should_training_stop = True
        return control


def train(
    strategy: str,
    out: str,
    steps: int = 12,
    accumulation: int = 1,
    stop_at: int | None = None,
    resume: str | None = None,
    tensorboard: bool = False,
    run_dir: str | None = None,
    options: dict[str, Any] | None = None,
    callbacks: list[Any] | None = None,
    **settings: Any,
) -> WansyncTrainer:
    """Train the tiny Llama with `strategy` on the current process group; returns the trainer.
    `run_dir`: a run directory for `wansync report` (the text's last windows are evaluated); `options`:
    the strategy's, instead of OPTIONS'; `settings`: more TrainingArguments (`bf16=True`, ...)."""
    text = shakespeare_text()
    args = transformers.TrainingArguments(
        output_dir=out,
        **{
            "max_steps": steps,
            "per_device_train_batch_size": 4,
            "gradient_accumulation_steps": accumulation,
            "learning_rate": 3e-3,
            "warmup_steps": 2,
            "lr_scheduler_type": "cosine",
            "max_grad_norm": 1.0,
            "logging_steps": 1,
            "save_strategy": "no",
            "report_to": ["tensorboard"] if tensorboard else [],
            "seed": 0,
            "dataloader_num_workers": 0,
            "disable_tqdm": True,
            **settings,
        },
    )
    trainer = WansyncTrainer(
        model=tiny_llama(),
        args=args,
        train_dataset=Bytes(text),
        eval_dataset=Bytes(text[-32 * 16 :], windows=16) if run_dir else None,
        strategy=strategy,
        strategy_options=OPTIONS.get(strategy, {}) if options is None else options,
        run_dir=run_dir,
        callbacks=[*(callbacks or []), *([StopAt(stop_at)] if stop_at else [])],
    )
    trainer.train(resume_from_checkpoint=resume)
    return trainer


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--strategy", default="diloco")
    p.add_argument("--out", default="runs/hf_trainer")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--accumulation", type=int, default=1, help="micro-batches per optimizer step")
    p.add_argument("--stop-at", type=int, help="save a checkpoint and stop at this step (an interruption)")
    p.add_argument("--resume", help="a checkpoint folder to resume from (resume_from_checkpoint)")
    p.add_argument("--params-out", help="save this rank's final parameters to FILE.rank<R>")
    p.add_argument("--tensorboard", action="store_true")
    p.add_argument("--run-dir", help="a run directory for `wansync report` (with an evaluation of the final model)")
    p.add_argument("--wan", help="train over an emulated link (`cross-region`, ...: docs/emulator.md)")
    p.add_argument("--bf16", action="store_true", help="bf16 autocast (TrainingArguments(bf16=True))")
    p.add_argument(
        "--compile", action="store_true", help="torch.compile the model (TrainingArguments(torch_compile=True))"
    )
    a = p.parse_args()
    ws.init(wan=a.wan)  # torchrun's environment, else one process
    settings = {"bf16": a.bf16, "torch_compile": a.compile}
    if a.bf16 and torch.accelerator.current_accelerator() is None:
        settings["use_cpu"] = True  # TrainingArguments refuses bf16 on a CPU without it
    try:
        trainer = train(
            a.strategy, a.out, a.steps, a.accumulation, a.stop_at, a.resume, a.tensorboard, a.run_dir, **settings
        )
    except ConfigError as e:  # a refusal (a resume under another strategy, say): its one line, no traceback
        sys.exit(f"hf_trainer.py: {e}")
    rank = dist.get_rank()
    if a.params_out:
        torch.save({k: v.detach().clone() for k, v in trainer.model.state_dict().items()}, f"{a.params_out}.rank{rank}")
    if rank == 0:
        last = [h for h in trainer.state.log_history if "wansync/bytes" in h][-1]
        print(
            json.dumps(
                {
                    "strategy": a.strategy,
                    "step": trainer.state.global_step,
                    "sync_steps": trainer.sync.t,
                    "world": dist.get_world_size(),
                    "trainer_world": trainer.args.world_size,
                    "trained_module": type(trainer.model_wrapped).__name__,
                    "exposed_pct": last["wansync/exposed_pct"],
                    "bytes": last["wansync/bytes"],
                    "log_history": trainer.state.log_history,
                }
            )
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
