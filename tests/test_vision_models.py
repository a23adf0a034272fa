"""Vision models: forward shapes, stage partitioning, width, patch size, determinism."""

import pytest
import torch

from wansync.errors import ConfigError
from wansync.workloads.vision import VISION_MODELS, build_model
from wansync.workloads.vision.vit import choose_patch_size

INPUTS = {"gray28": (1, 28, 10), "rgb32": (3, 32, 100)}  # channels, size, classes


def _build(name, key, width=1.0, seed=0):
    c, s, k = INPUTS[key]
    return build_model(name, in_channels=c, num_classes=k, image_size=s, width=width, seed=seed)


@pytest.fixture(scope="module")
def models():
    """Every model for both input kinds, built once (ResNet-50 and ViT-S are ~20M params)."""
    return {(m, k): _build(m, k) for m in VISION_MODELS for k in INPUTS}


@pytest.mark.parametrize("key", list(INPUTS))
@pytest.mark.parametrize("name", VISION_MODELS)
def test_forward_shape(models, name, key):
    c, s, k = INPUTS[key]
    model = models[(name, key)]
    n = 2 if name in ("resnet50", "vit_s") else 4
    with torch.no_grad():
        out = model.eval()(torch.randn(n, c, s, s))
    assert out.shape == (n, k)
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("name", VISION_MODELS)
def test_stages_cover_every_parameter_once(models, name):
    model = models[(name, "rgb32")]
    stage_params = [id(p) for st in model.stages() for p in st.parameters()]
    assert len(stage_params) == len(set(stage_params)), "a parameter appears in two stages"
    assert set(stage_params) == {id(p) for p in model.parameters()}
    assert len(model.stages()) >= 3


def test_stage_order_and_counts(models):
    assert len(models[("resnet18", "rgb32")].stages()) == 6  # stem, 4 stages, head
    assert len(models[("vit_s", "rgb32")].stages()) == 14  # embed, 12 blocks, head


def test_known_sizes(models):
    def count(m):
        return sum(p.numel() for p in m.parameters())

    assert 11.0e6 < count(models[("resnet18", "rgb32")]) < 11.3e6  # ResNet-18, 100 classes
    assert 23.4e6 < count(models[("resnet50", "rgb32")]) < 23.8e6  # ResNet-50, 100 classes
    assert 21.0e6 < count(models[("vit_s", "rgb32")]) < 21.7e6  # ViT-S
    assert count(models[("cnn", "gray28")]) < 0.5e6


def test_width_scales_resnet():
    small = _build("resnet18", "rgb32", width=0.25)
    n = sum(p.numel() for p in small.parameters())
    assert 0.6e6 < n < 0.8e6
    assert small(torch.randn(2, 3, 32, 32)).shape == (2, 100)


def test_build_is_deterministic_and_leaves_global_rng_alone():
    torch.manual_seed(123)
    before = torch.random.get_rng_state()
    a, b = _build("cnn", "gray28", seed=7), _build("cnn", "gray28", seed=7)
    c = _build("cnn", "gray28", seed=8)
    assert torch.equal(torch.random.get_rng_state(), before)
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.equal(pa, pb)
    assert any(not torch.equal(pa, pc) for pa, pc in zip(a.parameters(), c.parameters()))


@pytest.mark.parametrize("size,patch", [(28, 4), (32, 4), (64, 8)])
def test_patch_size_divides_image(size, patch):
    assert choose_patch_size(size) == patch


def test_unknown_model_is_config_error():
    with pytest.raises(ConfigError, match="resnet18"):
        build_model("resnet34", in_channels=3, num_classes=10, image_size=32)
