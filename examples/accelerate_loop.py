"""A loop written with Hugging Face `accelerate`, training under a wansync strategy
(`wansync.integrations.accelerate.prepare`, docs/your_model.md): a tiny Llama (about 200k parameters,
built from a config: nothing is downloaded) on the bundled Shakespeare, byte by byte, in bf16 autocast.

    python examples/accelerate_loop.py --strategy diloco                                  # one process
    torchrun --standalone --nproc-per-node 2 examples/accelerate_loop.py --strategy diloco --steps 40

accelerate prepares the data only (each rank its own shard); the model and the optimizer are the
strategy's: no DDP of accelerate's around the model, `sync.step()` as the step, `accelerator.autocast()`
for mixed precision. Rank 0 prints the loss, the strategy's bytes and whether every rank ended alike.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
import torch.distributed as dist
import transformers
from accelerate import Accelerator

import wansync as ws
from wansync.integrations.accelerate import prepare
from wansync.workloads.lm.corpus import shakespeare_text


class Bytes(torch.utils.data.Dataset):
    """Windows of `seq_len` bytes of the text; labels are the inputs (the model shifts them)."""

    def __init__(self, text: str, seq_len: int = 32, windows: int = 512):
        data = torch.tensor(list(text.encode("utf-8")[: seq_len * windows]), dtype=torch.long)
        self.windows = data.view(windows, seq_len)

    def __len__(self) -> int:
        return len(self.windows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.windows[i], "labels": self.windows[i], "index": torch.tensor(i)}


def tiny_llama(seed: int = 0) -> transformers.LlamaForCausalLM:
    config = transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=64,
        use_cache=False,
    )
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(config)


def train(strategy: str = "diloco", steps: int = 12, mixed_precision: str = "bf16", **options: Any) -> dict[str, Any]:
    """Train on the current process group (or torchrun's, or one process); what the run did."""
    ws.init()  # torchrun's environment (ws.init(wan=...) for an emulated link), else one process
    accelerator = Accelerator(mixed_precision=mixed_precision, cpu=not torch.cuda.is_available())
    model = tiny_llama().to(accelerator.device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    if strategy != "ddp":
        options = {"sync_every": 4, **options}
    sync = ws.strategy(strategy, model, optimizer, **options)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 4))
    loader = torch.utils.data.DataLoader(Bytes(shakespeare_text()), batch_size=4, shuffle=True)
    (loader,) = prepare(accelerator, sync, loader)
    dtypes: set[torch.dtype] = set()
    hook = model.model.layers[0].mlp.down_proj.register_forward_hook(lambda m, i, o: dtypes.add(o.dtype))
    seen, losses = [], []
    batches = iter(loader)
    for _ in range(steps):
        batch = next(batches)
        seen += batch.pop("index").tolist()
        with accelerator.autocast():
            loss = sync.model(**batch).loss
        accelerator.backward(loss)
        sync.step()
        sync.zero_grad()
        scheduler.step()
        losses.append(loss.item())
    hook.remove()
    sync.finish()
    flat = torch.cat([p.detach().reshape(-1).float() for p in model.parameters()])
    every = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(every, flat)
    return {
        "losses": losses,
        "seen": seen,
        "forward_dtypes": sorted(str(d) for d in dtypes),
        "wrapped": type(sync.model).__name__,
        "alike": all(torch.equal(every[0], e) for e in every),
        "bytes": sync.comm.bytes,
        "processes": accelerator.num_processes,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--strategy", default="diloco")
    ap.add_argument("--steps", type=int, default=12)
    args = ap.parse_args()
    out = train(args.strategy, args.steps)
    if dist.get_rank() == 0:
        print(
            f"{args.strategy}: loss {out['losses'][0]:.3f} -> {out['losses'][-1]:.3f} over {args.steps} steps, "
            f"{out['processes']} process(es), forward {', '.join(out['forward_dtypes'])}, {out['bytes']} bytes "
            f"sent, every rank alike: {out['alike']}"
        )


if __name__ == "__main__":
    main()
