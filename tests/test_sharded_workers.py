"""Workers sharded inside with FSDP2 (`--inside fsdp`): the strategy on each rank's local shards.

The specification, on real gloo groups and the micro LM, 2 workers of 2 ranks:
- `--inside fsdp` reaches the parameters of `--inside ddp` (to float rounding) after every step,
  for every strategy, and every rank ends with the same model;
- a worker puts the same bytes between workers per exchange either way;
- a user's own model, sharded with `fully_shard` on a 2 x 2 mesh, trains under `ws.strategy`;
- the outer state lives where `outer_state_device` says, and a run stopped with an exchange in
  flight resumes bit for bit from its sharded (torch.distributed.checkpoint) checkpoint.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from wansync import strategies
from wansync.comm.replicas import replica_groups
from wansync.config import Config
from wansync.runner.localgroup import run_ranks
from wansync.trainer.optim import build_optimizer
from wansync.trainer.sharding import shard_worker
from wansync.workloads import build_workload
from wansync.workloads.lm.corpus import shakespeare_text
from test_replicas import CASES as STRATEGY_CASES, PER_RANK_BATCH

# the sparse exchanges chunk each rank's own shard (its rows of a tensor: other blocks than the whole
# tensor's), so they reach DDP inside's parameters only where nothing is chosen: at density 1, unquantized
SPARSE = ("sparseloco", "demo")
# every strategy (two sync periods each, as in test_replicas), and the options that touch the exchange
CASES: dict[str, tuple[str, dict[str, Any], int]] = {
    **{name: (name, options, steps) for name, (options, steps) in STRATEGY_CASES.items() if name not in SPARSE},
    "sparseloco+dense": ("sparseloco", {"sync_every": 2, "density": 1.0, "bits": 32}, 4),
    "local_sgd+optimizer_state": ("local_sgd", {"sync_every": 2, "sync_optimizer_state": True}, 4),
    # bf16 rounds each value on its own: the same whatever the split (int8's chunks of 1024 values are cut
    # elsewhere by DDP's shards than by FSDP's, so its quantization differs at the cuts)
    "streaming+bf16": ("streaming", {"sync_every": 4, "fragments": 2, "overlap": 1, "codec": "bf16"}, 8),
}


def full_flat(model: torch.nn.Module) -> torch.Tensor:
    """The whole model as one flat tensor: what each parameter's `full_tensor()` gives (its row
    shards, FSDP2's Shard(0) with torch.chunk's split, end to end in rank order), with the shards of
    all the parameters gathered in one collective (an all-gather per parameter was a third of the time
    of `runs`, which gathers after every step)."""
    from torch.distributed.tensor import DTensor, Shard

    params = [p.detach() for p in model.parameters()]
    if not any(isinstance(p, DTensor) for p in params):
        return torch.cat([p.reshape(-1) for p in params])
    mesh, placements = params[0].device_mesh, params[0].placements
    assert all(isinstance(p, DTensor) and (p.device_mesh, p.placements) == (mesh, placements) for p in params)
    (dim,) = [d for d, placement in enumerate(placements) if placement == Shard(0)]
    group, me = mesh.get_group(dim), mesh.get_local_rank(dim)
    size = dist.get_world_size(group)

    def rows(p: Any, rank: int) -> int:  # torch.chunk's split of dim 0
        chunk = -(-p.shape[0] // size)
        return max(0, min(chunk, p.shape[0] - rank * chunk))

    assert all(rows(p, me) == p.to_local().shape[0] for p in params)
    numel = [[rows(p, r) * p.shape[1:].numel() for p in params] for r in range(size)]
    width = max(sum(n) for n in numel)
    mine = torch.cat([p.to_local().reshape(-1) for p in params])
    every = [torch.empty(width, dtype=mine.dtype) for _ in range(size)]
    dist.all_gather(every, torch.cat([mine, mine.new_zeros(width - mine.numel())]), group=group)
    pieces = [buffer[: sum(n)].split(n) for buffer, n in zip(every, numel)]
    return torch.cat([torch.cat([pieces[r][i] for r in range(size)]) for i in range(len(params))])


def train_both_ways(rank: int, world: int, names: list[str], corpus: str) -> dict[str, Any]:
    """Each strategy with DDP and with FSDP inside workers of 2 ranks; per strategy and way: the
    full parameters after every step, the ledger, and whether every rank ended alike."""
    out: dict[str, Any] = {}
    for name in names:
        strategy, options, steps = CASES[name] if name in CASES else (name, *STRATEGY_CASES[name])
        for inside in ("ddp", "fsdp"):
            replicas = replica_groups(2, shard_inside=inside == "fsdp")
            cfg = Config(
                strategy=strategy,
                model="micro",
                data=corpus,
                seq_len=16,
                batch_size=PER_RANK_BATCH,
                lr=1e-3,
                seed=0,
                inside=inside,
            )
            torch.manual_seed(0)
            wl = build_workload(cfg, replicas.worker, replicas.workers, replicas.local_rank, 2)
            if inside == "fsdp":
                shard_worker(
                    wl.model, replicas.mesh, "fp32", hybrid=not strategies.strategy_class(strategy).steps_inside_workers
                )
            opt = build_optimizer(cfg, wl.model)
            sync = strategies.build(
                strategy, wl.model, opt, replicas=replicas, **strategies.resolve_options(strategy, options)
            )
            after_steps = []
            for _ in range(steps):
                wl.loss(sync.model, wl.next_batch()).backward()
                sync.step()
                sync.zero_grad()
                after_steps.append(full_flat(wl.model))
            sync.finish()
            final = full_flat(wl.model)
            every = [torch.empty_like(final) for _ in range(world)]
            dist.all_gather(every, final)
            out[(name, inside)] = {
                "steps": after_steps,
                "final": final,
                "comm": sync.comm.snapshot(),
                "worker": replicas.worker,
                "alike": all(torch.equal(every[0], e) for e in every),
                "outer_devices": sorted({str(a.value.device) for a in _anchors(sync)}),
                "local_state": sum(t.numel() for ts in sync.state_tensors().values() for t in ts),
            }
    return out


def _anchors(sync: Any) -> list[Any]:
    return list(getattr(sync, "anchors", [])) + ([sync.anchor] if hasattr(sync, "anchor") else [])


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> list[dict[str, Any]]:
    corpus = tmp_path_factory.mktemp("corpus") / "plays.txt"
    corpus.write_text(shakespeare_text()[:200_000])
    return run_ranks(train_both_ways, 4, [*CASES, *SPARSE], str(corpus), timeout=300)


@pytest.mark.parametrize("name", list(CASES))
def test_fsdp_inside_reaches_the_parameters_of_ddp_inside_after_every_step(runs, name):
    for rank in runs:
        for step, (ddp, fsdp) in enumerate(zip(rank[(name, "ddp")]["steps"], rank[(name, "fsdp")]["steps"]), 1):
            rel = float((fsdp - ddp).norm() / ddp.norm())
            assert rel <= 1e-5, f"{name}: step {step} differs by {rel:.2e} (relative)"


@pytest.mark.parametrize("name", [*CASES, *SPARSE])
def test_every_rank_ends_with_the_same_model(runs, name):
    assert all(r[(name, "fsdp")]["alike"] for r in runs)


@pytest.mark.parametrize("name", SPARSE)
def test_a_sparse_exchange_chunks_each_ranks_own_shard(runs, name):
    """Each rank's payload is its shard's own (its own chunks and tables), about half the worker's."""
    purpose = strategies.strategy_class(name).exchange_purpose
    for r in runs:
        ddp, fsdp = (r[(name, way)]["comm"][purpose]["bytes"] for way in ("ddp", "fsdp"))
        assert 0.3 * 2 * ddp < fsdp < 0.7 * 2 * ddp, (ddp, fsdp)  # DDP inside: half of the worker's too
        assert r[(name, "fsdp")]["local_state"] * 2 == pytest.approx(r[(name, "ddp")]["local_state"], rel=0.1)


@pytest.mark.parametrize("name", ["local_sgd", "diloco", "streaming"])
def test_a_worker_sends_the_same_bytes_between_workers_whether_ddp_or_fsdp_is_inside(runs, name):
    def between(inside: str, worker: int) -> int:
        comm = [r[(name, inside)]["comm"] for r in runs if r[(name, inside)]["worker"] == worker]
        return sum(v["bytes"] for c in comm for k, v in c.items() if k in ("params", "pseudo_grads"))

    for worker in range(2):
        assert between("fsdp", worker) == between("ddp", worker) > 0
    assert all(not any(k.startswith("inside/grads") for k in r[(name, "fsdp")]["comm"]) for r in runs)


def test_the_outer_state_stays_beside_the_model_by_default(runs):
    assert runs[0][("diloco", "fsdp")]["outer_devices"] == ["cpu"]
    assert runs[0][("streaming", "fsdp")]["outer_devices"] == ["cpu"]


def test_outer_state_in_host_memory_is_the_same_outer_step():
    """`outer_state_device=cpu`: θ̃ and the momentum on the host (here the model is there too, so it is
    a device move in name only; on a GPU it is a copy each way), the same arithmetic."""
    from wansync.strategies.outer import Anchor
    from wansync.strategies.options import anchor_device

    torch.manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(300)), torch.nn.Parameter(torch.randn(7, 5))]
    results = []
    for device in (anchor_device("model"), anchor_device("cpu")):
        model = [torch.nn.Parameter(p.detach().clone()) for p in ps]
        a = Anchor(model, lr=0.7, momentum=0.9, nesterov=True, device=device)
        for step in range(3):
            with torch.no_grad():
                for p in model:
                    p.add_(0.01 * (step + 1))
            a.outer_step(a.pseudo_gradient(), load=True)
        results.append((a.value.clone(), [p.detach().clone() for p in model], a.device))
    (v0, m0, d0), (v1, m1, d1) = results
    assert d0 == d1 == torch.device("cpu") and anchor_device("model") is None
    assert torch.equal(v0, v1) and all(torch.equal(x, y) for x, y in zip(m0, m1))


# ---- a user's own sharded model -------------------------------------------------------------------
def user_loops(rank: int, world: int, cases: list[tuple[str, dict[str, Any], bool]]) -> list[Any]:
    """`user_loop` for each (strategy, options, hybrid), one after the other in one group."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    return [user_loop(rank, world, mesh, *case) for case in cases]


def user_loop(rank: int, world: int, mesh: Any, name: str, options: dict[str, Any], hybrid: bool) -> Any:
    """The README's loop on a model the user sharded: fully_shard on the rows of a 2 x 2 mesh."""
    import wansync as ws
    from torch.distributed.fsdp import fully_shard
    from wansync.errors import ConfigError

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(5)])
    for layer in model:
        fully_shard(layer, mesh=mesh if hybrid else mesh["shard"])
    fully_shard(model, mesh=mesh if hybrid else mesh["shard"])
    opt = (torch.optim.SGD if name == "demo" else torch.optim.AdamW)(model.parameters(), lr=1e-2)
    try:
        sync = ws.strategy(name, model, opt, **options)
    except ConfigError as e:
        return str(e)
    torch.manual_seed(100 + rank)
    for _ in range(12):
        sync.model(torch.randn(4, 8)).pow(2).mean().backward()
        sync.step()
        sync.zero_grad()
    sync.finish()
    final = full_flat(model)
    every = [torch.empty_like(final) for _ in range(world)]
    dist.all_gather(every, final)
    return {
        "alike": all(torch.equal(every[0], e) for e in every),
        "moved": not torch.equal(final, _initial(model)),
        "workers": sync.replicas.workers,
    }


def _initial(model: torch.nn.Module) -> torch.Tensor:
    torch.manual_seed(0)
    return torch.cat(
        [p.detach().reshape(-1) for p in torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(5)]).parameters()]
    )


USER_CASES = [
    ("diloco", {"sync_every": 4}, False),
    ("streaming", {"sync_every": 6, "fragments": 2, "overlap": 1}, False),
    ("cocodc", {"sync_every": 6, "fragments": 2, "overlap": 1}, False),
    ("diloco", {"sync_every": 4}, True),  # hybrid sharding: refused for local steps
    ("ddp", {}, True),  # ... and taken by ddp
    ("sparseloco", {"sync_every": 4, "chunk": 4}, False),
    ("demo", {"chunk": 4}, False),
]
TRAINED = (0, 1, 2, 5, 6)


@pytest.fixture(scope="module")
def user_runs() -> list[list[Any]]:
    return run_ranks(user_loops, 4, USER_CASES, timeout=240)


@pytest.mark.parametrize("case", TRAINED, ids=[USER_CASES[i][0] for i in TRAINED])
def test_a_model_the_user_sharded_trains_and_every_rank_ends_alike(user_runs, case):
    out = [rank[case] for rank in user_runs]
    assert all(o["alike"] and o["moved"] and o["workers"] == 2 for o in out), out


def test_hybrid_sharding_is_refused_for_a_strategy_with_local_steps_and_taken_by_ddp(user_runs):
    refused, ddp = ([rank[i] for rank in user_runs] for i in (3, 4))
    assert all("takes local steps, but the model is sharded on a 2-D mesh" in o for o in refused)
    assert all(o["alike"] and o["moved"] for o in ddp)


# ---- kill and resume: the model and optimizer through torch.distributed.checkpoint ---------------
def sharded_state(run: Any, step: int, worker: int) -> dict[str, Any]:
    """A worker's model and optimizer as its DCP checkpoint of `step` holds them (read offline)."""
    import tempfile
    from pathlib import Path
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "state.pt"
        dcp_to_torch_save(str(Path(run) / "checkpoints" / f"step{step:08d}" / f"worker{worker}"), str(out))
        return torch.load(out, weights_only=False)


def _flat_tensors(x: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    if torch.is_tensor(x):
        return {prefix: x}
    if isinstance(x, dict):
        return {k: v for key, val in x.items() for k, v in _flat_tensors(val, f"{prefix}.{key}").items()}
    if isinstance(x, (list, tuple)):
        return {k: v for i, val in enumerate(x) for k, v in _flat_tensors(val, f"{prefix}.{i}").items()}
    return {}


RESUMED = [
    ("diloco", {"sync_every": 3}),
    ("streaming", {"sync_every": 4, "fragments": 2, "overlap": 1}),
    ("sparseloco", {"sync_every": 3}),
    ("diloco", {"sync_every": 3, "overlap_rounds": True}),
]


@pytest.fixture(scope="module")
def resumed(tmp_path_factory) -> tuple[Any, list[Any]]:
    """Per case of RESUMED (in its folder, by index): a whole run, and the same run stopped at step 6
    and resumed; every leg in one group of 4 ranks, one after the other (one start-up for them all)."""
    from trainer_harness import lay_out, run_legs
    from test_reliability import TINY_KEYS

    root, legs = tmp_path_factory.mktemp("resumed"), []
    for case, (name, options) in enumerate(RESUMED):
        common = {
            "strategy": name,
            **options,
            "workers": 2,
            "ranks_per_worker": 2,
            "inside": "fsdp",
            "steps": 8,
            "checkpoint_every": 4,
            "eval_every": 2,
            "quiet": True,
            **TINY_KEYS,
        }
        whole, broken = (lay_out({**common, "out": str(root / str(case) / leg)}) for leg in ("whole", "broken"))
        legs += [{"run_dir": whole}, {"run_dir": broken, "stop_at": 6}, {"run_dir": broken, "resume": True}]
    return root, run_ranks(run_legs, 4, legs, timeout=600)


@pytest.mark.parametrize("case", range(len(RESUMED)), ids=[f"{n}-options{i}" for i, (n, _) in enumerate(RESUMED)])
def test_a_sharded_run_stopped_with_an_exchange_in_flight_resumes_bit_for_bit(resumed, case):
    import json

    name, options = RESUMED[case]
    root, legs = resumed
    tmp_path = root / str(case)
    whole, broken = tmp_path / "whole", tmp_path / "broken"
    assert all("stopped" in rank[3 * case + 1] for rank in legs)
    ranks = [
        torch.load(tmp_path / "broken" / "checkpoints" / "step00000004" / f"rank{r}.pt", weights_only=True)
        for r in range(4)
    ]  # the checkpoint the resume started from
    if name == "streaming":
        assert all(r["strategy"]["in_flight"] for r in ranks)  # the checkpoint holds an exchange in flight
    if options.get("overlap_rounds"):  # round 1's mean, waited for and recorded
        assert all(r["strategy"]["overlap"]["landing"] is not None for r in ranks)
    assert all(r["model"] is None and r["inside"] == "fsdp" for r in ranks)  # the model: the DCP checkpoint
    for worker in range(2):
        a, b = (_flat_tensors(sharded_state(d, 8, worker)) for d in (whole, broken))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), f"worker {worker} differs"
    for rank in range(4):
        a, b = (
            _flat_tensors(
                torch.load(tmp_path / leg / "checkpoints" / "step00000008" / f"rank{rank}.pt", weights_only=True)[
                    "strategy"
                ]
            )
            for leg in ("whole", "broken")
        )
        assert all(torch.equal(a[k], b[k]) for k in a)
    s_whole, s_broken = (json.loads((tmp_path / leg / "summary.json").read_text()) for leg in ("whole", "broken"))
    assert all(s_whole[k] == s_broken[k] for k in ("final_val_loss", "bytes_sent", "sync_events"))


# ---- what cannot be sharded, in one line ----------------------------------------------------------
def shard_a_scalar(rank: int, world: int) -> str:
    from wansync.errors import ConfigError

    class Scalar(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.tensor(1.0))

    try:
        shard_worker(Scalar(), replica_groups(2, shard_inside=True).mesh, "fp32")
    except ConfigError as e:
        return str(e)
    return "sharded"


def test_a_model_fsdp_cannot_shard_is_one_line():
    out = run_ranks(shard_a_scalar, 2, timeout=120)
    assert all(
        o.startswith(
            "--inside fsdp cannot shard this model with FSDP2 (ValueError: fully_shard doesn't "
            "support scalar parameters"
        )
        and o.endswith("use --inside ddp")
        for o in out
    ), out


def test_bf16_on_a_gpu_without_it_is_one_line(monkeypatch):
    from wansync.errors import ConfigError
    from wansync.trainer.sharding import check_precision

    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    with pytest.raises(ConfigError, match=r"^--precision bf16: this GPU does not support bfloat16"):
        check_precision("bf16", "cuda")
    check_precision("bf16", "cpu")
    check_precision("fp32", "cuda")


def test_what_a_sharded_worker_cannot_do_is_refused_in_one_line(tmp_path):
    from cli_harness import TINY, wansync

    r = wansync("train", "--inside", "zero3", *TINY, "--out", str(tmp_path / "bad"))
    assert r.stderr.strip().splitlines() == ["wansync: error: inside must be ddp or fsdp, got 'zero3'"]


def test_a_run_resumes_only_with_the_inside_it_was_started_with(tmp_path):
    from cli_harness import TINY, wansync

    run = tmp_path / "run"
    first = wansync(
        "train",
        "--strategy",
        "local_sgd",
        "--workers",
        "1",
        "--steps",
        "2",
        "--checkpoint-every",
        "1",
        *TINY,
        "--out",
        str(run),
    )
    assert first.returncode == 0, first.stderr
    r = wansync("train", "--resume", str(run), "--inside", "fsdp", "--steps", "3")
    assert r.returncode != 0 and len(r.stderr.strip().splitlines()) == 1
    assert "cannot change inside when resuming" in r.stderr


@pytest.mark.parametrize(
    "strategy, inside, ranks, extra",
    [("diloco", "ddp", 1, ()), ("diloco", "fsdp", 2, ()), ("sparseloco", "fsdp", 2, ("--density", "0.1"))],
)
def test_a_bf16_run_learns(tmp_path, strategy, inside, ranks, extra):
    """bf16 compute (autocast with DDP inside, whatever its ranks; FSDP2's mixed-precision policy
    sharded), fp32 masters: the loss falls and summary.json says how the run computed."""
    import json
    from cli_harness import TINY, wansync

    r = wansync(
        "train",
        "--strategy",
        strategy,
        "--sync-every",
        "5",
        "--workers",
        "2",
        "--ranks-per-worker",
        str(ranks),
        "--inside",
        inside,
        "--precision",
        "bf16",
        "--steps",
        "15",
        "--eval-every",
        "5",
        *TINY,
        *extra,
        "--out",
        str(tmp_path / "run"),
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["precision"] == "bf16" and summary["inside"] == inside
    assert summary["final_val_loss"] < summary["first_eval"] - 0.3
