"""The LLaMA-style decoder: shapes, causality, sizes, tied head, stages, deterministic init."""

import pytest
import torch

from wansync.errors import ConfigError
from wansync.workloads.lm import LM_MODELS, LMShape, TransformerLM, lm_shape


@pytest.fixture(autouse=True)
def one_thread():
    """One intra-op thread: on a shared 2-core machine, spinning thread pools are slower, not faster."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


MICRO = LMShape(dim=32, n_layers=2, n_heads=4, ffn_hidden=64, max_seq_len=32)


def make(shape: LMShape = MICRO, vocab: int = 256, seed: int = 0) -> TransformerLM:
    torch.manual_seed(seed)
    return TransformerLM(shape, vocab)


def test_forward_gives_logits_per_position():
    model = make()
    tokens = torch.randint(0, 256, (3, 17))
    assert model(tokens).shape == (3, 17, 256)


def test_changing_a_future_token_leaves_earlier_logits_unchanged():
    model = make().eval()
    tokens = torch.randint(0, 256, (2, 24))
    changed = tokens.clone()
    changed[:, 10] = (changed[:, 10] + 1) % 256
    with torch.no_grad():
        a, b = model(tokens), model(changed)
    torch.testing.assert_close(a[:, :10], b[:, :10], rtol=0, atol=1e-6)
    assert not torch.allclose(a[:, 10:], b[:, 10:])


def test_named_sizes_have_the_stated_parameter_counts():
    tiny = make(LM_MODELS["tiny"])
    assert 1_000_000 <= sum(p.numel() for p in tiny.parameters()) == LM_MODELS["tiny"].param_count(256) <= 3_000_000
    with torch.device("meta"):
        small = TransformerLM(LM_MODELS["small"], 256)
        big = TransformerLM(LM_MODELS["150m"], 32000)
    assert 15_000_000 <= sum(p.numel() for p in small.parameters()) == LM_MODELS["small"].param_count(256) <= 25_000_000
    assert sum(p.numel() for p in big.parameters()) == LM_MODELS["150m"].param_count(32000) == 149_804_928


def test_output_head_is_the_input_embedding():
    model = make()
    shapes = [p.shape for p in model.parameters()]
    assert shapes.count(torch.Size([256, 32])) == 1  # no separate head matrix
    tokens = torch.randint(0, 256, (1, 8))
    model(tokens).sum().backward()
    assert model.embed.weight.grad[tokens.unique()].abs().sum() > 0
    untouched = torch.ones(256, dtype=torch.bool)
    untouched[tokens.unique()] = False
    assert model.embed.weight.grad[untouched].abs().sum() > 0  # gradient through the head reaches every row


def test_stages_partition_the_parameters_in_forward_order():
    model = make()
    stages = model.stages()
    assert stages[0] is model.embed and stages[-1] is model.norm
    assert list(stages[1:-1]) == list(model.blocks)
    ids = [id(p) for stage in stages for p in stage.parameters()]
    assert len(ids) == len(set(ids)) and set(ids) == {id(p) for p in model.parameters()}


def test_init_depends_only_on_the_seed():
    a, b, c = make(seed=1), make(seed=1), make(seed=2)
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.equal(pa, pb)
    assert not torch.equal(a.embed.weight, c.embed.weight)


def test_unknown_model_name_lists_the_valid_ones():
    with pytest.raises(ConfigError, match="tiny, small, 150m"):
        lm_shape("huge")


def test_sequence_longer_than_max_seq_len_is_refused():
    with pytest.raises(ConfigError, match="max_seq_len"):
        make()(torch.zeros(1, 33, dtype=torch.long))


@pytest.mark.parametrize("model, longest", [("micro", 256), ("tiny", 512)])
def test_a_seq_len_beyond_the_models_tables_is_refused_before_any_worker_starts(model, longest):
    from wansync.config import build_config
    from wansync.runner.run import check_run

    with pytest.raises(
        ConfigError, match=rf"^seq_len must be in \[1, {longest}\] for model '{model}', got {longest + 1}$"
    ):
        check_run(build_config(None, {"model": model, "seq_len": longest + 1}))  # the launcher's and --dry-run's check
    check_run(build_config(None, {"model": model, "seq_len": longest}))
