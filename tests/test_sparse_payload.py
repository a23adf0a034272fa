"""The pieces of a sparse exchange as plain functions: chunking (comm/chunks.py), top-k (comm/topk.py),
the DCT (comm/dct.py), bit packing (comm/bitpack.py), the statistical quantizer (comm/quantize.py) and
the payload built from them (comm/sparse.py), each against a direct transcription of its rule."""

from __future__ import annotations

import math

import pytest
import torch

from wansync.comm.bitpack import pack, packed_bytes, unpack
from wansync.comm.chunks import ChunkLayout, as_matrix, chunk_side
from wansync.comm.dct import BlockDCT, dct_matrix
from wansync.comm.quantize import BITS, dequantize, quantize, table_bytes
from wansync.comm.sparse import SparseCodec
from wansync.comm.topk import chunk_topk, kept_per_chunk
from sparse_reference import quantize as reference_quantize

SHAPES = [(256, 64), (64,), (192, 64), (64, 160), (7,), (3, 5, 4), (), (0, 8)]


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@pytest.mark.parametrize("n,target", [(64, 64), (256, 64), (160, 64), (100, 64), (97, 64), (7, 64), (1, 64), (12, 5)])
def test_a_chunk_side_is_the_largest_divisor_not_above_the_target(n, target):
    assert chunk_side(n, target) == max(d for d in _divisors(n) if d <= target)


def test_tensors_are_chunked_as_matrices_vectors_as_one_row():
    assert as_matrix((5,)) == (1, 5) and as_matrix((3, 4)) == (3, 4) and as_matrix((2, 3, 4, 5)) == (2, 60)
    assert as_matrix(()) == (1, 1)


def test_take_and_put_move_every_value_of_every_chunk_exactly_once():
    layout = ChunkLayout.of_shapes(SHAPES)
    flat = torch.arange(layout.numel, dtype=torch.float32)
    seen = torch.cat([g.take(flat).reshape(-1) for g in layout.groups])
    assert torch.equal(seen.sort().values, flat)
    back = torch.full_like(flat, -1.0)
    for g in layout.groups:
        g.put(g.take(flat), back)
    assert torch.equal(back, flat)


def test_a_chunk_is_a_whole_block_of_its_matrix():
    layout = ChunkLayout.of_shapes([(8, 6)], chunk=4)  # blocks of 4 x 3
    m = torch.arange(48, dtype=torch.float32).view(8, 6)
    chunks = layout.groups[0].take(m.reshape(-1))
    expected = torch.stack([m[i : i + 4, j : j + 3].reshape(-1) for i in (0, 4) for j in (0, 3)])
    assert torch.equal(chunks, expected)


def test_shard_bounds_cut_at_rows_of_blocks_and_restrict_keeps_the_chunks():
    layout = ChunkLayout.of_shapes(SHAPES)
    flat = torch.randn(layout.numel)
    for parts in (2, 3, 4):
        bounds = layout.bounds(parts)
        assert bounds[0] == 0 and bounds[-1] == layout.numel and bounds == sorted(bounds)
        pieces = []
        for a, b in zip(bounds, bounds[1:]):
            sub = layout.restrict(a, b)
            pieces += [g.take(flat[a:b]) for g in sub.groups]
        whole = torch.cat([c.reshape(-1) for c in pieces]).sort().values
        assert torch.equal(whole, flat.sort().values)


def test_restricting_across_a_row_of_blocks_is_refused():
    layout = ChunkLayout.of_shapes([(8, 6)], chunk=4)
    with pytest.raises(ValueError, match="cut a row of blocks"):
        layout.restrict(0, 6)


@pytest.mark.parametrize("k", [1, 3, 32, 64])
def test_chunked_top_k_is_torch_topk_per_chunk(k):
    g = torch.Generator().manual_seed(k)
    chunks = torch.randn(17, 64, generator=g)
    idx, vals = chunk_topk(chunks, k)
    for row in range(17):
        direct = torch.topk(chunks[row].abs(), k).indices
        assert set(idx[row].tolist()) == set(direct.tolist())
        assert torch.equal(vals[row], chunks[row][idx[row]])


def test_top_k_larger_than_the_chunk_is_refused():
    with pytest.raises(ValueError, match="top-k of 65 values from chunks of 64"):
        chunk_topk(torch.zeros(2, 64), 65)


def test_kept_per_chunk_rounds_the_density_and_clamps_a_count():
    assert kept_per_chunk(4096, 32 / 4096) == 32 and kept_per_chunk(64, 32 / 4096) == 1
    assert kept_per_chunk(100, 0.025) == 3 and kept_per_chunk(10, 1.0) == 10
    assert kept_per_chunk(64, 0.5, topk=32) == 32 and kept_per_chunk(7, 0.5, topk=32) == 7


def test_the_dct_is_orthonormal_and_matches_the_textbook_formula():
    d = dct_matrix(8, torch.float64)
    torch.testing.assert_close(d @ d.T, torch.eye(8, dtype=torch.float64), rtol=0, atol=1e-12)
    x = torch.randn(8, dtype=torch.float64)
    y = [
        sum(x[i] * math.cos(math.pi * (2 * i + 1) * k / 16) for i in range(8))
        * math.sqrt(2 / 8)
        * (1 / math.sqrt(2) if k == 0 else 1)
        for k in range(8)
    ]
    torch.testing.assert_close(d @ x, torch.tensor(y, dtype=torch.float64), rtol=0, atol=1e-12)
    block = BlockDCT(4, 6, torch.float64)
    chunks = torch.randn(5, 24, dtype=torch.float64)
    torch.testing.assert_close(block.inverse(block.forward(chunks)), chunks, rtol=0, atol=1e-12)
    two_d = block.forward(chunks).view(5, 4, 6)
    torch.testing.assert_close(
        two_d, dct_matrix(4, torch.float64) @ chunks.view(5, 4, 6) @ dct_matrix(6, torch.float64).T
    )


@pytest.mark.parametrize("bits", [0, 1, 2, 6, 9, 11, 12, 13, 16, 24, 32])
def test_bit_packing_round_trips_in_the_bytes_it_promises(bits):
    for n in (0, 1, 7, 8, 33, 1000):
        values = torch.randint(0, 2**bits if bits else 1, (n,))
        data = pack(values, bits)
        assert data.dtype == torch.uint8 and data.numel() == packed_bytes(n, bits) == -(-n * bits // 8)
        assert torch.equal(unpack(data, n, bits), values)


def test_packed_bits_are_laid_least_significant_first():
    assert pack(torch.tensor([1, 2, 3, 0]), 2).tolist() == [0b00111001]
    assert pack(torch.tensor([0xABC, 0x123]), 12).tolist() == [0xBC, 0x3A, 0x12]


@pytest.mark.parametrize("bits", BITS)
def test_the_quantizer_is_the_reference_rule_per_segment(bits):
    g = torch.Generator().manual_seed(bits)
    values = torch.cat([torch.randn(50, generator=g) * 3 + 1, torch.randn(7, generator=g) * 1e-4, torch.tensor([2.5])])
    segment = torch.cat([torch.zeros(50), torch.ones(7), torch.full((1,), 2.0)]).long()
    q = quantize(values, segment, 3, bits)
    decoded = dequantize(q.codes, segment, q.shift, q.table)
    expected = torch.cat(
        [
            reference_quantize(values[:50], bits),
            reference_quantize(values[50:57], bits),
            reference_quantize(values[57:], bits),
        ]
    )
    torch.testing.assert_close(decoded, expected, rtol=0, atol=1e-6)
    assert q.codes.dtype == torch.uint8 and int(q.codes.max()) < 2**bits
    assert decoded[-1] == 2.5  # one value: decoded exactly
    assert table_bytes(3, bits) == 3 * 4 * (2**bits + 1)


def test_a_non_finite_value_makes_its_segment_decode_non_finite():
    values = torch.tensor([1.0, float("nan"), 2.0, 3.0, 4.0])
    segment = torch.tensor([0, 0, 0, 1, 1])
    q = quantize(values, segment, 2, 2)
    decoded = dequantize(q.codes, segment, q.shift, q.table)
    assert not torch.isfinite(decoded[:3]).any() and torch.isfinite(decoded[3:]).all()


def _encode(codec: SparseCodec, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    out, residual = torch.empty(codec.wire_bytes(), dtype=torch.uint8), torch.empty_like(x)
    codec.encode_into(x, out, residual=residual)
    return out, residual


def _decoded(codec: SparseCodec, payload: torch.Tensor) -> torch.Tensor:
    one = SparseCodec(codec.layout, codec.density, codec.topk, codec.bits, codec.range_sigmas, codec.dct, "all")
    return one.aggregate_into([payload], torch.empty(codec.layout.numel), 1)


@pytest.mark.parametrize("dct", [False, True])
@pytest.mark.parametrize("bits", [2, 8, 32])
def test_what_is_sent_plus_what_is_kept_is_the_buffer(dct, bits):
    layout = ChunkLayout.of_shapes(SHAPES)
    codec = SparseCodec(layout, bits=bits, dct=dct)
    x = torch.randn(layout.numel, generator=torch.Generator().manual_seed(1))
    payload, residual = _encode(codec, x)
    assert payload.numel() == codec.wire_bytes() == sum(codec.parts.values())
    sent = _decoded(codec, payload)
    if bits == 32 and not dct:
        assert torch.equal(sent + residual, x)  # exact: a sent value leaves 0 behind
        assert int((residual == 0).sum()) == codec.kept
    else:
        torch.testing.assert_close(sent + residual, x, rtol=0, atol=1e-5)


def test_a_payload_sends_the_top_k_of_every_chunk():
    layout = ChunkLayout.of_shapes([(128, 64)])  # two blocks of 64 x 64
    codec = SparseCodec(layout, topk=5, bits=32)
    x = torch.randn(layout.numel, generator=torch.Generator().manual_seed(2))
    sent = _decoded(codec, _encode(codec, x)[0])
    m = x.view(128, 64)
    for block in (m[:64], m[64:]):
        top = torch.topk(block.abs().reshape(-1), 5).indices
        mask = torch.zeros(4096, dtype=torch.bool)
        mask[top] = True
        s = sent.view(128, 64)[:64] if block.data_ptr() == m.data_ptr() else sent.view(128, 64)[64:]
        assert torch.equal(s.reshape(-1)[mask], block.reshape(-1)[mask]) and not s.reshape(-1)[~mask].any()


def test_the_chosen_mean_averages_over_the_workers_that_sent_an_index():
    layout = ChunkLayout.of_shapes([(4,)])
    a, b = torch.tensor([4.0, 0.0, 0.0, 1.0]), torch.tensor([0.0, 0.0, 2.0, 3.0])
    for rule, want in (("chosen", [4.0, 0.0, 2.0, 2.0]), ("all", [2.0, 0.0, 1.0, 2.0])):
        codec = SparseCodec(layout, topk=2, bits=32, aggregate=rule)
        mean = codec.aggregate_into([_encode(codec, a)[0], _encode(codec, b)[0]], torch.empty(4), 2)
        assert mean.tolist() == want


def test_at_density_one_both_rules_are_the_plain_mean():
    layout = ChunkLayout.of_shapes(SHAPES)
    xs = [torch.randn(layout.numel, generator=torch.Generator().manual_seed(s)) for s in range(3)]
    for rule in ("chosen", "all"):
        codec = SparseCodec(layout, density=1.0, bits=32, aggregate=rule)
        mean = codec.aggregate_into([_encode(codec, x)[0] for x in xs], torch.empty(layout.numel), 3)
        assert torch.equal(mean, (xs[0] + xs[1] + xs[2]) / 3)


def test_the_bytes_at_the_reference_defaults():
    layout = ChunkLayout.of_shapes([(4096, 4096)])
    codec = SparseCodec(layout)  # 64 x 64 blocks, 32 kept, 2 bits
    blocks = 4096 * 4096 // 4096
    assert codec.parts == {"indices": blocks * 32 * 12 // 8, "values": blocks * 32 * 2 // 8, "tables": 4 * 5}
    assert codec.wire_bytes() / (4 * 4096 * 4096) < 0.0035


def test_a_sharded_payload_covers_its_shard_only():
    layout = ChunkLayout.of_shapes(SHAPES)
    codec = SparseCodec(layout, bits=32)
    x = torch.randn(layout.numel, generator=torch.Generator().manual_seed(3))
    whole = _decoded(codec, _encode(codec, x)[0])
    bounds = layout.bounds(3)
    parts = []
    for a, b in zip(bounds, bounds[1:]):
        sub = codec.restrict(a, b)
        parts.append(_decoded(sub, _encode(sub, x[a:b].clone())[0]))
    assert torch.equal(torch.cat(parts), whole)


def test_any_run_of_chunks_is_taken_and_put_back_in_place():
    layout = ChunkLayout.of_shapes([(8, 12), (4, 12)], chunk=4)  # one group: 3 x 4 blocks, 6 + 3 chunks
    flat = torch.arange(layout.numel, dtype=torch.float32)
    g = layout.groups[0]
    whole = g.take(flat)
    for a in range(g.chunks):
        for b in range(a + 1, g.chunks + 1):
            assert torch.equal(g.take(flat, a, b), whole[a:b])
            back = flat.clone()
            g.put(-g.take(flat, a, b), back, a, b)
            assert torch.equal(g.take(back, a, b), -whole[a:b])
            assert int((back != flat).sum()) == (b - a) * g.size - int((whole[a:b] == 0).sum())


@pytest.mark.parametrize("bits,chunk", [(2, 64), (32, 64), (3, 5), (8, 11)])
def test_a_payload_and_its_mean_are_the_same_bytes_whatever_the_run_of_chunks(monkeypatch, bits, chunk):
    import wansync.comm.sparse as sparse

    shapes = [(256, 64), (64,), (192, 64), (64, 160), (7,), (121, 55)]
    layout = ChunkLayout.of_shapes(shapes, chunk)
    xs = [torch.randn(layout.numel, generator=torch.Generator().manual_seed(s)) for s in range(2)]

    def run(batch: int) -> tuple[list[torch.Tensor], torch.Tensor, list[torch.Tensor]]:
        monkeypatch.setattr(sparse, "BATCH_VALUES", batch)
        codec = SparseCodec(layout, density=0.05, bits=bits, dct=bits == 3)
        assert batch > 1 << 20 or any(len(s.batches) > 1 for s in codec.sections)
        encoded = [_encode(codec, x) for x in xs]
        mean = codec.aggregate_into([p for p, _ in encoded], torch.empty(layout.numel), 2)
        return [p for p, _ in encoded], mean, [r for _, r in encoded]

    big = run(1 << 22)
    for batch in (64, 1000):
        small = run(batch)
        assert all(torch.equal(a, b) for a, b in zip(big[0], small[0]))
        assert torch.equal(big[1], small[1]) and all(torch.equal(a, b) for a, b in zip(big[2], small[2]))
