"""Fragments for models that do not name their stages: the repeated blocks found in the module tree
(`strategies/blocks.py`), the ends attached to the first and last fragment, tied weights once, the
byte-balanced sequential cut, the imbalance warning, and bf16 models (FP32 anchors and exchange)."""

from __future__ import annotations

import itertools
import random
import warnings

import pytest
import torch
from torch import nn

import wansync as ws
from wansync.errors import ConfigError
from wansync.runner.localgroup import run_ranks
from wansync.strategies.blocks import repeated_blocks, unwrap
from wansync.strategies.fragments import FragmentImbalanceWarning, balanced_runs, imbalance, layout, partition
from wansync.strategies.outer import Anchor
from wansync.trainer.sharding import blocks as fsdp_units


# ---- a Hugging Face-shaped causal LM, no transformers needed -------------------------------------
class Block(nn.Module):
    def __init__(self, dim: int, ffn: int):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.attn = nn.Linear(dim, dim, bias=False)
        self.up, self.down = nn.Linear(dim, ffn, bias=False), nn.Linear(ffn, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        return x + self.attn(h) + self.down(torch.tanh(self.up(h)))


class Backbone(nn.Module):
    def __init__(self, vocab: int, dim: int, layers: int, ffn: int):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(Block(dim, ffn) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.register_buffer("inv_freq", torch.ones(4), persistent=False)  # as HF's rotary: not exchanged


class CausalLM(nn.Module):
    """`model.embed_tokens`, `model.layers` (a ModuleList), `model.norm`, `lm_head`, as HF's Llama."""

    def __init__(self, vocab: int = 64, dim: int = 16, layers: int = 4, ffn: int = 32, tied: bool = False):
        super().__init__()
        self.model = Backbone(vocab, dim, layers, ffn)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        if tied:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.model.embed_tokens(tokens)
        for block in self.model.layers:
            x = block(x)
        return self.lm_head(self.model.norm(x))


def unique_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())  # a tied weight once


def covers_every_parameter_once(model: nn.Module, frags) -> None:
    ids = [id(t) for f in frags for t in f.tensors]
    assert len(ids) == len(set(ids)) and set(ids) == {id(p) for p in model.parameters()}
    assert sum(f.nbytes for f in frags) == unique_bytes(model)


# ---- the rule ------------------------------------------------------------------------------------
@pytest.mark.parametrize("tied", [False, True])
def test_the_layers_are_the_blocks_the_embedding_joins_the_first_the_norm_and_head_the_last(tied):
    model = CausalLM(tied=tied)
    lay = layout(model)
    assert lay.source == "blocks model.layers"
    assert [s.name for s in lay.before] == ["model.embed_tokens"]
    assert [s.name for s in lay.blocks] == [f"model.layers.{i}" for i in range(4)]
    assert [s.name for s in lay.after] == (["model.norm"] if tied else ["model.norm", "lm_head"])  # tied: once
    two = partition(model, 2)  # strided, the default
    assert [f.stages for f in two] == [
        ["model.embed_tokens", "model.layers.0", "model.layers.2"],
        ["model.layers.1", "model.layers.3", *[s.name for s in lay.after]],
    ]
    for frags in (two, partition(model, 4), partition(model, 3, "sequential"), partition(model, 1)):
        covers_every_parameter_once(model, frags)


def test_compile_and_data_parallel_wrappers_are_looked_through():
    model = CausalLM(tied=True)
    plain = partition(model, 4)

    def compiled(m: nn.Module) -> nn.Module:
        return torch.compile(m, backend="eager")  # the same OptimizedModule, no inductor

    for wrapped in (compiled(model), nn.DataParallel(model), compiled(nn.DataParallel(model))):
        assert unwrap(wrapped) is model
        frags = partition(wrapped, 4)
        assert [f.stages for f in frags] == [f.stages for f in plain]
        assert [[id(t) for t in f.tensors] for f in frags] == [[id(t) for t in f.tensors] for f in plain]


def test_the_models_own_stages_stay_the_override():
    model = CausalLM()
    model.stages = lambda: [
        model.model.embed_tokens,
        model.model.layers[0],
        model.model.layers[1],
        model.model.layers[2],
        model.model.layers[3],
        model.model.norm,
    ]
    lay = layout(model)
    assert lay.source == "stages()" and [s.name for s in lay.after] == ["model.norm"]
    assert lay.after[0].tensors[-1] is model.lm_head.weight  # uncovered tensors join the last stage


def test_the_largest_container_of_one_composite_type_wins():
    class EncoderDecoder(nn.Module):
        def __init__(self):
            super().__init__()
            self.encoder = nn.ModuleList(Block(32, 64) for _ in range(2))  # fewer, larger blocks
            self.decoder = nn.ModuleList(Block(8, 16) for _ in range(6))
            self.heads = nn.ModuleList(nn.Linear(32, 32) for _ in range(8))  # leaves: a layer stack, not blocks

    found = repeated_blocks(EncoderDecoder())
    assert found.container == "encoder" and [n for n, _ in found.blocks] == ["encoder.0", "encoder.1"]
    moe = CausalLM()
    for block in moe.model.layers:  # experts inside each block
        block.experts = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16)) for _ in range(3))
    assert repeated_blocks(moe).container == "model.layers"
    mixed = nn.ModuleList([Block(8, 16), nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))])
    assert repeated_blocks(mixed) is None  # two types: not repeated blocks


def test_no_repeated_blocks_is_one_line_that_says_what_to_do():
    class TwoParts(nn.Module):
        def __init__(self):
            super().__init__()
            self.backbone = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8))
            self.head = nn.Linear(8, 2)

    with pytest.raises(ConfigError) as e:
        partition(TwoParts(), 4)
    assert str(e.value) == (
        "fragments must be between 1 and the model's 2 blocks (stages), got 4: it defines no "
        "stages() and has no repeated blocks (a ModuleList or nn.Sequential of modules of one "
        "type); define model.stages() (docs/strategies.md) or use at most 2 fragments"
    )
    assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match=r"^fragments must be between 1 and the model's 4 blocks \(stages\), got 5$"):
        partition(CausalLM(), 5)


def test_fsdp_shards_the_same_blocks_the_fragments_are_cut_over():
    model = CausalLM()
    assert fsdp_units(model) == list(model.model.layers)


# ---- Hugging Face's LlamaForCausalLM -------------------------------------------------------------
@pytest.fixture(scope="module")
def llama():
    transformers = pytest.importorskip("transformers", reason="transformers is not installed (the hf extra)")

    def build(layers: int, tied: bool) -> nn.Module:
        torch.manual_seed(0)
        return transformers.LlamaForCausalLM(
            transformers.LlamaConfig(
                vocab_size=256,
                hidden_size=32,
                intermediate_size=64,
                num_hidden_layers=layers,
                num_attention_heads=2,
                num_key_value_heads=2,
                max_position_embeddings=64,
                tie_word_embeddings=tied,
            )
        )

    return build


@pytest.mark.parametrize("layers", [4, 8])
def test_hf_llama_with_the_default_partition_gives_fragments_within_2x_tied_and_compiled(llama, layers):
    for tied in (False, True):
        model = llama(layers, tied)
        lay = layout(model)
        assert lay.source == "blocks model.layers" and len(lay.blocks) == layers
        assert [s.name for s in lay.before] == ["model.embed_tokens"]
        assert [s.name for s in lay.after] == (["model.norm"] if tied else ["model.norm", "lm_head"])
        embed, block, norm = lay.before[0].nbytes, lay.blocks[0].nbytes, lay.after[0].nbytes
        head = 0 if tied else embed
        assert (embed, block, norm) == (256 * 32 * 4, (4 * 32 * 32 + 3 * 32 * 64 + 2 * 32) * 4, 32 * 4)
        expected = {
            2: [embed + layers // 2 * block, layers // 2 * block + norm + head],
            4: [embed + layers // 4 * block] + [layers // 4 * block] * 2 + [layers // 4 * block + norm + head],
        }
        for wrapped in (model, torch.compile(model, backend="eager")):
            for p in (2, 4):
                frags = partition(wrapped, p)  # strided, Streaming's default
                sizes = [f.nbytes for f in frags]
                assert sizes == expected[p]
                assert max(sizes) <= 2 * min(sizes) and imbalance(frags) is None
                covers_every_parameter_once(model, frags)  # the tied head once


# ---- balance -------------------------------------------------------------------------------------
def brute_force(weights: list[int], parts: int) -> tuple[int, int]:
    best = None
    for cuts in itertools.combinations(range(1, len(weights)), parts - 1):
        bounds = (0, *cuts, len(weights))
        sums = [sum(weights[a:b]) for a, b in itertools.pairwise(bounds)]
        key = (max(sums), -min(sums))
        best = key if best is None or key < best else best
    return best[0], -best[1]


def test_balanced_runs_minimize_the_largest_then_maximize_the_smallest():
    rng = random.Random(0)
    for _ in range(150):
        n = rng.randint(1, 9)
        weights = [rng.choice([1, 2, 3, 10, 50]) for _ in range(n)]
        parts = rng.randint(1, n)
        runs = balanced_runs(weights, parts)
        assert [i for r in runs for i in r] == list(range(n)) and all(runs)  # contiguous, none empty
        sums = [sum(weights[i] for i in r) for r in runs]
        assert (max(sums), min(sums)) == brute_force(weights, parts), (weights, parts)


def test_sequential_balances_bytes_with_the_ends_counted_and_strided_keeps_the_papers_pattern():
    class Tapered(CausalLM):  # blocks of one type whose sizes differ (wide early, narrow late)
        def __init__(self):
            super().__init__(vocab=8, dim=16, layers=0)
            self.model.layers = nn.ModuleList(Block(16, ffn) for ffn in (256, 16, 16, 16, 16, 16))

    model = Tapered()
    seq = partition(model, 2, "sequential")
    assert [f.stages for f in seq] == [
        ["model.embed_tokens", "model.layers.0"],
        [f"model.layers.{i}" for i in range(1, 6)] + ["model.norm", "lm_head"],
    ]
    even = [len(f.stages) for f in partition(CausalLM(layers=6), 2, "sequential")]  # ends of equal size:
    assert even == [4, 5]  # three blocks each
    assert partition(model, 2)[0].stages[1:] == ["model.layers.0", "model.layers.2", "model.layers.4"]  # strided


def test_a_fragment_more_than_twice_the_smallest_warns_in_one_line():
    balanced = partition(CausalLM(vocab=64, layers=4), 2)
    assert imbalance(balanced) is None
    heavy = partition(CausalLM(vocab=4096, layers=4), 4)  # a 64k-row embedding dwarfs a block
    line = imbalance(heavy)
    assert line is not None and "\n" not in line
    assert line.startswith(
        "fragments are unbalanced: the largest (fragment 3, 268 kB) is 51x the smallest " "(fragment 1, 5.25 kB)"
    )  # head + norm + a block; one block of 1312 floats


# ---- bf16 ----------------------------------------------------------------------------------------
def test_an_fp32_anchor_over_bf16_tensors_accumulates_what_bf16_rounds_away():
    w = torch.ones(4, dtype=torch.bfloat16)  # bf16's step at 1.0 is 2^-7 = 0.0078
    fp32 = Anchor([w], lr=1.0, momentum=0.0)  # the default over 16-bit tensors: float32
    plain = Anchor([w.clone()], lr=1.0, momentum=0.0, dtype=torch.bfloat16)
    assert fp32.value.dtype == torch.float32 and plain.value.dtype == torch.bfloat16
    for _ in range(10):  # ten outer steps of 0.001 each
        fp32.outer_step(torch.full((4,), 1e-3), load=True)
        plain.outer_step(torch.full((4,), 1e-3, dtype=torch.bfloat16), load=True)
    assert torch.allclose(fp32.value, torch.full((4,), 0.99), atol=1e-6)
    assert torch.equal(w, torch.full((4,), 0.99).to(torch.bfloat16))  # the model receives it rounded
    assert torch.equal(plain.value, torch.ones(4, dtype=torch.bfloat16))  # bf16 alone never moves
    assert w.dtype == torch.bfloat16


def test_mixed_dtypes_are_refused_in_one_line():
    model = CausalLM().to(torch.bfloat16)
    assert {t.dtype for f in partition(model, 2) for t in f.tensors} == {torch.bfloat16}
    model.model.norm.float()
    with pytest.raises(
        ConfigError,
        match=r"^fragment exchange needs every parameter and buffer in one dtype, "
        r"float32 or bfloat16 or float16; got bfloat16, float32 \(cast",
    ):
        partition(model, 2)


STEPS = 12


def bf16_against_fp32(rank: int, world: int) -> dict:
    """The same trajectory twice: a bf16 model under streaming, and an fp32 copy given the bf16
    model's gradients (the fp32-accumulated reference)."""
    torch.manual_seed(0)
    low = CausalLM(vocab=32, dim=16, layers=4, ffn=32).to(torch.bfloat16)
    ref = CausalLM(vocab=32, dim=16, layers=4, ffn=32)
    ref.load_state_dict({k: v.float() for k, v in low.state_dict().items()})
    options = dict(sync_every=4, fragments=2, overlap=1, outer_lr=1.0, outer_momentum=0.0)  # no gain: rounding
    with warnings.catch_warnings():
        warnings.simplefilter("error", FragmentImbalanceWarning)  # balanced: no warning
        syncs = [ws.strategy("streaming", m, torch.optim.SGD(m.parameters(), lr=0.5), **options) for m in (low, ref)]
    tokens = torch.randint(0, 32, (4, 8), generator=torch.Generator().manual_seed(rank))
    losses = []
    for _ in range(STEPS):
        logits = syncs[0].model(tokens[:, :-1])
        loss = nn.functional.cross_entropy(logits.float().reshape(-1, 32), tokens[:, 1:].reshape(-1))
        loss.backward()
        for p, q in zip(low.parameters(), ref.parameters()):
            q.grad = p.grad.float()
        for s in syncs:
            s.step()
            s.zero_grad()
        losses.append(loss.item())
    for s in syncs:
        s.finish()

    def by_fragment(sync) -> torch.Tensor:  # the anchors' order
        return torch.cat([t.detach().reshape(-1) for f in sync.fragments for t in f.tensors])

    return {
        "low": by_fragment(syncs[0]),
        "ref": by_fragment(syncs[1]),
        "anchor": torch.cat([a.value for a in syncs[0].anchors]),
        "ref_anchor": torch.cat([a.value for a in syncs[1].anchors]),
        "anchor_dtypes": {a.value.dtype for a in syncs[0].anchors},
        "param_dtypes": {p.dtype for p in low.parameters()},
        "losses": losses,
        "periodic": {name: periodic_on_bf16(name, tokens) for name in ("diloco", "slowmo")},
    }


def periodic_on_bf16(name: str, tokens: torch.Tensor) -> dict:
    """DiLoCo's and SlowMo's θ̃ over a bf16 model: float32 (Anchor's default over 16-bit tensors)."""
    torch.manual_seed(0)
    model = CausalLM(vocab=32, dim=16, layers=2, ffn=32).to(torch.bfloat16)
    sync = ws.strategy(
        name,
        model,
        torch.optim.SGD(model.parameters(), lr=0.5),
        sync_every=2,
        **({"outer_momentum": 0.0} if name == "diloco" else {}),
    )
    for _ in range(4):
        nn.functional.cross_entropy(
            sync.model(tokens[:, :-1]).float().reshape(-1, 32), tokens[:, 1:].reshape(-1)
        ).backward()
        sync.step()
        sync.zero_grad()
    sync.finish()
    flat = torch.cat([t.detach().reshape(-1) for t in sync.anchor.flat.tensors])
    return {
        "anchor_dtype": sync.anchor.value.dtype,
        "model": flat,
        "rounded": torch.equal(flat, sync.anchor.value.to(torch.bfloat16)),
    }


def test_a_bf16_model_trains_under_streaming_and_follows_its_fp32_accumulated_reference():
    ranks = run_ranks(bf16_against_fp32, 2)
    a, b = ranks
    assert torch.equal(a["low"], b["low"]) and a["low"].dtype == torch.bfloat16  # finish: identical ranks
    assert a["param_dtypes"] == {torch.bfloat16} and a["anchor_dtypes"] == {torch.float32}
    assert torch.equal(a["low"], a["anchor"].to(torch.bfloat16))  # the model is θ̃, rounded once
    for r in ranks:
        assert r["losses"][-1] < 0.8 * r["losses"][0]  # it trains
    # the fp32 reference took the same gradients, so the bf16 run differs by its own roundings only:
    # each of the 12 inner steps rounds θ_m to bf16, by at most half a unit in the last place (eps/2)
    # of the values it passes through (scale: the value plus the tensor's mean magnitude)
    ulp = torch.finfo(torch.bfloat16).eps
    scale = a["ref_anchor"].abs() + a["ref_anchor"].abs().mean()
    err = (a["anchor"] - a["ref_anchor"]).abs() / scale
    assert err.max() < STEPS / 2 * ulp, err.max()
    torch.testing.assert_close(a["low"].float(), a["ref"], rtol=STEPS * ulp, atol=1e-2 * STEPS * ulp)
    for name in ("diloco", "slowmo"):  # the other outer optimizers accumulate in float32 too
        assert a["periodic"][name]["anchor_dtype"] == torch.float32 and a["periodic"][name]["rounded"], name
        assert torch.equal(a["periodic"][name]["model"], b["periodic"][name]["model"]), name
