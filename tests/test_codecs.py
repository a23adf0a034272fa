"""Codecs: exact wire sizes, round-trip error bounds, and loud failure on bad names or non-finite data."""

from __future__ import annotations

import math

import pytest
import torch

from wansync.comm import codecs as codecs_module
from wansync.comm.codecs import CODECS, Encoded, Fp4Codec, Int8Codec, decode_into, encode_into, get_codec
from wansync.errors import ConfigError

CHUNK = 1024
SIZES = [0, 1, 2, 3, 7, 1023, 1024, 1025, 2048, 3001]
TINY = 2.0**-149  # smallest float32 denormal
DENORMAL_MAX = 2.0**-126


def _inputs() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    outlier = torch.randn(3001, generator=g) * 1e-3
    outlier[1500] = 1e30
    denormals = torch.randint(-(2**20), 2**20, (2500,), generator=g).float() * TINY
    return {
        "empty": torch.zeros(0),
        "zeros": torch.zeros(2049),
        "one": torch.tensor([-3.25]),
        "randn": torch.randn(5000, generator=g),
        "negative": -torch.rand(1500, generator=g) * 100,
        "wide_range": torch.randn(4096, generator=g) * torch.logspace(-20, 20, 4096),
        "outlier": outlier,
        "denormals": denormals,
        "negative_zero": torch.full((5,), -0.0),
    }


INPUTS = _inputs()


def _chunks(x: torch.Tensor, chunk: int = CHUNK) -> list[torch.Tensor]:
    return [c for c in x.split(chunk) if c.numel()]


def _roundtrip(name: str, x: torch.Tensor) -> torch.Tensor:
    codec = get_codec(name)
    enc = codec.encode(x)
    assert enc.nbytes == codec.wire_bytes(x.numel())
    y = codec.decode(enc)
    assert y.dtype == torch.float32 and y.shape == (x.numel(),)
    return y


@pytest.mark.parametrize("name", sorted(CODECS))
@pytest.mark.parametrize("numel", SIZES)
def test_encoded_bytes_equal_wire_bytes(name: str, numel: int) -> None:
    codec = CODECS[name]
    enc = codec.encode(torch.randn(numel))
    assert enc.data.dtype == torch.uint8 and enc.data.dim() == 1
    assert len(enc.data) == codec.wire_bytes(numel) == enc.nbytes
    assert enc.numel == numel and enc.codec == name


@pytest.mark.parametrize("numel", SIZES)
def test_wire_bytes_formulas(numel: int) -> None:
    n_chunks = math.ceil(numel / CHUNK)
    assert CODECS["fp32"].wire_bytes(numel) == 4 * numel
    assert CODECS["bf16"].wire_bytes(numel) == 2 * numel
    assert CODECS["int8"].wire_bytes(numel) == numel + 4 * n_chunks
    assert CODECS["fp4"].wire_bytes(numel) == math.ceil(numel / 2) + 4 * n_chunks


def test_bytes_ratio_versus_fp32() -> None:
    numel = 1 << 20
    fp32 = CODECS["fp32"].wire_bytes(numel)
    ratio = {name: CODECS[name].wire_bytes(numel) / fp32 for name in CODECS}
    assert ratio["fp32"] == 1.0
    assert ratio["bf16"] == 0.5
    assert ratio["int8"] == pytest.approx(0.25 + 1 / CHUNK)  # one 4-byte scale per 1024 × 4 bytes
    assert ratio["fp4"] == pytest.approx(0.125 + 1 / CHUNK)


@pytest.mark.parametrize("case", sorted(INPUTS))
def test_fp32_is_exact(case: str) -> None:
    x = INPUTS[case]
    y = _roundtrip("fp32", x)
    assert torch.equal(y.view(torch.int32), x.view(torch.int32))  # bit for bit, -0.0 included


@pytest.mark.parametrize("case", sorted(INPUTS))
def test_bf16_relative_error(case: str) -> None:
    x = INPUTS[case]
    y = _roundtrip("bf16", x)
    # 8 significant bits, round to nearest: relative error ≤ 2^-8 for normals; below 2^-126 the
    # spacing is fixed at 2^-133, so the absolute error there is at most half of it.
    bound = torch.where(x.abs() >= DENORMAL_MAX, x.abs() * 2.0**-8, torch.full_like(x, 2.0**-134))
    assert ((y - x).abs() <= bound).all()
    assert torch.equal(torch.signbit(y), torch.signbit(x))


def _check_scaled(codec_name: str, x: torch.Tensor, half_gap) -> None:
    """Per chunk: |decoded - x| ≤ half_gap(|x| / scale) · scale, scale = absmax / qmax."""
    codec = get_codec(codec_name)
    y = _roundtrip(codec_name, x)
    for xc, yc in zip(_chunks(x), _chunks(y)):
        absmax = xc.abs().max().double()
        if absmax == 0:
            assert (yc == 0).all()
            continue
        scale = absmax / codec.qmax  # exact, in float64
        err = (yc.double() - xc.double()).abs()
        bound = half_gap(xc.abs().double() / scale) * scale
        # slack: the stored scale is rounded up by one float32 ulp, and q·scale is rounded to float32
        slack = scale * 2.0**-20 + TINY
        assert (err <= bound + slack).all(), f"max excess {(err - bound).max().item():g}"


@pytest.mark.parametrize("case", sorted(INPUTS))
def test_int8_error_at_most_half_a_step(case: str) -> None:
    _check_scaled("int8", INPUTS[case], lambda a: torch.full_like(a, 0.5))


def _fp4_half_gap(a: torch.Tensor) -> torch.Tensor:
    # neighbouring E2M1 magnitudes are 0.5 apart below 2, 1 apart in [2, 4], 2 apart in [4, 6]
    return torch.where(a < 2, 0.25, torch.where(a < 4, 0.5, 1.0)).to(a.dtype)


@pytest.mark.parametrize("case", sorted(INPUTS))
def test_fp4_error_at_most_half_the_gap(case: str) -> None:
    _check_scaled("fp4", INPUTS[case], _fp4_half_gap)


def test_fp4_represents_its_grid_exactly() -> None:
    grid = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6])
    x = torch.cat([grid, -grid]) * 0.75
    y = _roundtrip("fp4", x)
    scale = (torch.tensor(4.5) / 6).item()
    assert torch.allclose(y, x, rtol=2.0**-20, atol=0)
    assert y.abs().max().item() == pytest.approx(6 * scale, rel=2.0**-20)


def test_fp4_rounds_to_nearest() -> None:
    # scale 1 (absmax 6): 0.7 → 0.5, 0.8 → 1, 2.4 → 2, 2.6 → 3, 4.9 → 4, 5.1 → 6, -1.3 → -1.5
    x = torch.tensor([6.0, 0.7, 0.8, 2.4, 2.6, 4.9, 5.1, -1.3, 0.2])
    y = _roundtrip("fp4", x)
    expect = torch.tensor([6.0, 0.5, 1.0, 2.0, 3.0, 4.0, 6.0, -1.5, 0.0])
    assert torch.allclose(y, expect, rtol=2.0**-20, atol=0)


def test_fp4_rounding_matches_a_nearest_grid_search() -> None:
    # dense sweep of |x| / scale over [0, 6], every midpoint (tie) included, plus ±1 ulp around each
    mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    around = torch.cat([mids, torch.nextafter(mids, torch.tensor(0.0)), torch.nextafter(mids, torch.tensor(9.0))])
    a = torch.cat([torch.linspace(0, 6, 100_001), around])
    x = torch.cat([torch.tensor([6.0]), a])  # one chunk whose absmax 6 sets scale ≈ 1
    codec = Fp4Codec(chunk=x.numel())
    y = codec.decode(codec.encode(x))[1:]
    grid = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    scale = torch.nextafter(torch.tensor(1.0), torch.tensor(2.0))  # 6 / 6, rounded up one ulp
    expect = grid[torch.bucketize(a / scale, mids)] * scale  # nearest, ties toward zero
    assert torch.equal(y, expect)


def test_fp4_packs_two_codes_per_byte_low_nibble_first() -> None:
    codec = Fp4Codec(chunk=4)
    x = torch.tensor([6.0, -0.5, 1.0, 0.0, 3.0])  # chunk 1: scale 1; chunk 2 ([3.0]): scale 0.5
    enc = codec.encode(x)
    codes = enc.data[8:]  # 2 chunks → 2 float32 scales first
    # E2M1 codes: 6 = 0b0111, -0.5 = 0b1001, 1 = 0b0010, 0 = 0b0000; 3.0 / 0.5 = 6 = 0b0111, padded with 0
    assert codes.tolist() == [0x97, 0x02, 0x07]


def test_int8_uses_the_full_range() -> None:
    x = torch.tensor([-5.0, 2.0, 5.0, 0.0])
    enc = Int8Codec().encode(x)
    assert enc.data[4:].view(torch.int8).tolist() == [-127, 51, 127, 0]  # 2 / (5 / 127) = 50.8


def test_a_huge_outlier_only_costs_its_own_chunk() -> None:
    x = INPUTS["outlier"]  # values ~1e-3, one 1e30 at index 1500, in the second chunk
    for name in ("int8", "fp4"):
        y = _roundtrip(name, x)
        others = torch.cat([y[:1024] - x[:1024], y[2048:] - x[2048:]])
        assert others.abs().max() < 1e-3  # the other chunks keep their own, small scales
        assert y[1500].item() == pytest.approx(1e30, rel=2.0**-20)
        assert (y[1024:1500] == 0).all() and (y[1501:2048] == 0).all()  # swamped by the outlier


@pytest.mark.parametrize("chunk", [1, 3, 64])
def test_chunk_size_is_configurable(chunk: int) -> None:
    x = torch.randn(100)
    for codec in (Int8Codec(chunk), Fp4Codec(chunk)):
        enc = codec.encode(x)
        assert enc.nbytes == codec.wire_bytes(100) == 4 * math.ceil(100 / chunk) + 100 * codec.code_bits // 8
        assert codec.decode(enc).shape == (100,)


@pytest.mark.parametrize("name", sorted(CODECS))
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_values_are_never_silently_dropped(name: str, bad: float) -> None:
    x = torch.randn(3000)
    x[1100] = bad
    y = _roundtrip(name, x)
    assert not torch.isfinite(y[1024:2048]).all()
    assert torch.isfinite(y[:1024]).all() and torch.isfinite(y[2048:]).all()


@pytest.mark.parametrize("name", sorted(CODECS))
def test_encoding_is_deterministic_and_leaves_input_alone(name: str) -> None:
    x = torch.randn(3001)
    before = x.clone()
    a, b = CODECS[name].encode(x), CODECS[name].encode(x)
    assert torch.equal(a.data, b.data)
    assert torch.equal(x, before)


def test_decode_rejects_a_foreign_or_truncated_payload() -> None:
    enc = CODECS["int8"].encode(torch.randn(10))
    with pytest.raises(ValueError, match="int8"):
        CODECS["fp4"].decode(enc)
    with pytest.raises(ValueError, match="bytes"):
        CODECS["int8"].decode(type(enc)("int8", 10, enc.data[:-1]))


def test_unknown_codec_names_the_valid_ones() -> None:
    with pytest.raises(ConfigError) as info:
        get_codec("fp3")
    msg = str(info.value)
    assert "\n" not in msg and "'fp3'" in msg
    for name in ("fp32", "bf16", "int8", "fp4"):
        assert name in msg


def test_codec_objects_pass_through_get_codec() -> None:
    codec = Int8Codec(chunk=256)
    assert get_codec(codec) is codec
    assert get_codec("fp4") is CODECS["fp4"]


# ---- blocked encode and decode: the exchange's, whose temporaries stay one block ---------------


@pytest.mark.parametrize("block", [1 << 20, 3 * CHUNK, 3000])
@pytest.mark.parametrize("codec", [*CODECS.values(), Int8Codec(7), Fp4Codec(7)], ids=lambda c: f"{c.name}-{c.chunk}")
def test_blocked_encode_and_decode_give_the_whole_buffers_bytes_and_bits(monkeypatch, codec, block) -> None:
    monkeypatch.setattr(codecs_module, "BLOCK_VALUES", block)
    g = torch.Generator().manual_seed(1)
    for n in (1, 5, 1023, 1024, 4097, 20001):
        x = torch.randn(n, generator=g) * torch.rand(n, generator=g) ** 3
        whole = codec.encode(x).data
        assert torch.equal(encode_into(codec, x, torch.empty(codec.wire_bytes(n) + 3, dtype=torch.uint8)), whole)
        padded = codec.encode(torch.cat([x, x.new_zeros(9)])).data  # as if zero-padded to n + 9
        assert torch.equal(encode_into(codec, x, torch.full((len(padded),), 255, dtype=torch.uint8), n + 9), padded)
        decoded = codec.decode(Encoded(codec.name, n, whole))
        assert torch.equal(decode_into(codec, whole, n, torch.empty(n)), decoded)
        k = max(1, n - 3)  # a prefix, added to what is there
        assert torch.equal(decode_into(codec, whole, n, torch.ones(k), add=True), 1 + decoded[:k])


def test_a_blocked_decode_refuses_a_payload_of_the_wrong_size() -> None:
    codec = get_codec("int8")
    with pytest.raises(ValueError, match="uint8 bytes"):
        decode_into(codec, torch.zeros(codec.wire_bytes(10) - 1, dtype=torch.uint8), 10, torch.empty(10))
