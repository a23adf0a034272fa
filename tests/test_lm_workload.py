"""The LM workload under the training loop's contract: protocol, evaluation, DDP, a short training run."""

import math

import pytest
import torch
import torch.distributed as dist

from wansync.workloads.base import Workload
from wansync.workloads.lm import build_lm_workload


@pytest.fixture(autouse=True)
def one_thread():
    """One intra-op thread: on a shared 2-core machine, spinning thread pools are slower, not faster."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


@pytest.fixture(scope="module")
def workload():
    return build_lm_workload(batch_size=4, seq_len=32, eval_batches=3)


def test_satisfies_the_workload_protocol(workload):
    assert isinstance(workload, Workload) and workload.kind == "lm"
    facts = workload.describe()
    assert facts["params"] == 1_820_352 and facts["vocab"] == 256 and facts["tokenizer"] == "byte"
    assert facts["val_tokens"] / (facts["train_tokens"] + facts["val_tokens"]) == pytest.approx(0.05, abs=1e-3)
    assert facts["windows_per_rank"] == facts["windows"]


def test_loss_is_next_token_cross_entropy(workload):
    batch = workload.next_batch()
    loss = workload.loss(workload.model, batch)
    assert loss.shape == () and abs(loss.item() - math.log(256)) < 0.5  # untrained ≈ uniform


def test_evaluation_is_fixed_and_restores_the_mode(workload):
    model = workload.model.train()
    first = workload.evaluate(model)
    assert model.training
    other_rank = build_lm_workload(rank=1, world_size=2, batch_size=4, seq_len=32, eval_batches=3)
    assert workload.evaluate(model) == first == other_rank.evaluate(model)
    assert first["val_ppl"] == pytest.approx(math.exp(first["val_loss"]))
    assert first["val_bpb"] == pytest.approx(first["val_loss"] / math.log(2))  # bytes: one per token
    model.eval()
    workload.evaluate(model)
    assert not model.training
    model.train()


def test_loss_and_evaluation_through_ddp(workload, tmp_path):
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        ddp = torch.nn.parallel.DistributedDataParallel(workload.model)
        workload.loss(ddp, workload.next_batch()).backward()
        assert workload.model.embed.weight.grad is not None
        assert workload.evaluate(ddp) == workload.evaluate(workload.model)
    finally:
        dist.destroy_process_group()
        workload.model.zero_grad(set_to_none=True)


def test_thirty_adamw_steps_lower_the_loss():
    w = build_lm_workload(batch_size=8, seq_len=64, eval_batches=2, seed=1)
    opt = torch.optim.AdamW(w.model.parameters(), lr=3e-3)
    before = w.evaluate(w.model)["val_loss"]
    for _ in range(30):
        loss = w.loss(w.model, w.next_batch())
        opt.zero_grad()
        loss.backward()
        opt.step()
    after = w.evaluate(w.model)["val_loss"]
    assert after < before - 1.0, (before, after)
