"""Sealed payloads (`wansync.trust.sealed`): every supported kind comes back as it went, tensors bit for
bit; a payload flipped, cut or sealed under another key is refused before anything of it is parsed;
nothing in one is ever unpickled."""

from __future__ import annotations

import enum
import hashlib
import hmac
import io
import json
import math
import pickle

import pytest
import torch

from wansync.errors import DataError
from wansync.trust import sealed
from wansync.trust.sealed import DTYPES, PUBLIC_KEY, SealError, read_sealed, seal, unseal, write_sealed

KEY = b"k" * 32


def again(obj, key: bytes = KEY):
    return unseal(seal(obj, key), key, "the test payload")


def bits(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


# ---- what comes back ----------------------------------------------------------------------------
@pytest.mark.parametrize(
    "value",
    [
        None,
        True,
        False,
        0,
        -(2**70),
        1.5,
        "é\n\x00\ud800",
        [],
        [1, [2, [3]]],
        (),
        (1, "a", None),
        {"a": 1},
        {},
        {1, "a", (2, 3), torch.float32},
        set(),
        b"",
        b"\x00\xff" * 5,
        torch.bfloat16,
        torch.Size([2, 0, 3]),
        {"nested": [({"deep": (b"x", torch.int8)},)]},
    ],
    ids=lambda v: repr(sorted(v, key=repr) if isinstance(v, set) else v),  # a set's order varies by process
)
def test_a_plain_value_comes_back_equal_and_of_its_type(value):
    back = again(value)
    assert back == value and type(back) is type(value)


def test_ints_floats_and_bools_stay_themselves_nans_and_infinities_included():
    back = again([1, 1.0, True, float("nan"), float("inf"), -float("inf"), -0.0, 1e-320])
    assert [type(v) for v in back] == [int, float, bool, float, float, float, float, float]
    assert math.isnan(back[3]) and back[4] == math.inf and back[5] == -math.inf
    assert math.copysign(1, back[6]) == -1 and back[7] == 1e-320


def test_dict_keys_keep_their_types_and_order():
    value = {"1": "str", 1: "int", 2.5: "float", None: "none", False: "bool", (1, "1"): "tuple", "z": 0}
    back = again(value)
    assert list(back.items()) == list(value.items())
    assert [type(k) for k in back] == [type(k) for k in value]


@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=str)
def test_a_tensor_of_every_dtype_comes_back_bit_for_bit(dtype):
    size = torch.empty(0, dtype=dtype).element_size()
    raw = torch.randint(0, 256, (3, 5 * size), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    t = raw.view(dtype) if dtype != torch.bool else raw.remainder(2).view(torch.bool)
    back = again({"t": t, "scalar": t.reshape(-1)[0].clone(), "empty": t[:0]})
    for name in ("t", "scalar", "empty"):
        want = {"t": t, "scalar": t.reshape(-1)[0], "empty": t[:0]}[name]
        got = back[name]
        assert got.dtype == dtype and got.shape == want.shape and bits(got) == bits(want)


def test_a_strided_view_comes_back_with_its_values_as_a_contiguous_tensor_of_its_own():
    base = torch.arange(24.0).reshape(4, 6)
    view = base.t()[1:4]
    back = again(view)
    assert torch.equal(back, view) and back.is_contiguous()
    back.add_(1)  # its own memory
    assert torch.equal(view, base.t()[1:4])


def test_a_models_and_optimizers_state_dicts_load_back():
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    model(torch.randn(5, 3)).sum().backward()
    opt.step()
    back = again({"model": model.state_dict(), "optimizer": opt.state_dict()})
    assert back["model"]._metadata == model.state_dict()._metadata  # module versions, as torch.save kept them
    twin = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    twin.load_state_dict(back["model"])
    twin_opt = torch.optim.AdamW(twin.parameters())
    twin_opt.load_state_dict(back["optimizer"])
    assert twin_opt.param_groups[0]["betas"] == (0.9, 0.999) and twin_opt.param_groups[0]["lr"] == 0.01
    for a, b in zip(model.state_dict().values(), twin.state_dict().values()):
        assert torch.equal(a, b)
    assert torch.equal(twin_opt.state_dict()["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])


def test_streamed_it_comes_back_the_same():
    value = {"w": torch.randn(100, 7), "n": 3}
    buf = io.BytesIO()
    n = write_sealed(buf, value, KEY)
    assert n == len(buf.getvalue()) == sealed.Sealed(value, KEY).size
    buf.seek(0)
    back = read_sealed(buf, KEY, "the stream", limit=1 << 20)
    assert torch.equal(back["w"], value["w"]) and back["n"] == 3


# ---- refused before parsing ---------------------------------------------------------------------
@pytest.fixture
def no_parsing(monkeypatch):
    """Fails the test if anything is parsed or built: JSON, or tensors from the payload's bytes."""
    calls = []
    monkeypatch.setattr(json, "loads", lambda *a, **k: calls.append("json") or {})
    monkeypatch.setattr(sealed, "_Builder", lambda *a: calls.append("tensors"))
    return calls


PAYLOAD = {"w": torch.randn(3, 4).bfloat16(), "meta": {1: (2.5, "x")}, "b": b"raw"}


def test_one_byte_flipped_anywhere_is_refused_before_parsing(no_parsing):
    data = seal(PAYLOAD, KEY)
    for at in range(len(data)):
        flipped = bytearray(data)
        flipped[at] ^= 0x40
        with pytest.raises(SealError) as e:
            unseal(bytes(flipped), KEY, "the test payload")
        assert "\n" not in str(e.value) and str(e.value).startswith("the test payload: refused: ")
    assert no_parsing == []


def test_a_cut_or_padded_payload_is_refused_before_parsing(no_parsing):
    data = seal(PAYLOAD, KEY)
    for n in range(len(data)):
        with pytest.raises(SealError):
            unseal(data[:n], KEY, "the test payload")
        with pytest.raises(SealError, match="cut short"):
            read_sealed(io.BytesIO(data[:n]), KEY, "the test payload", limit=1 << 20)
    with pytest.raises(SealError, match="not the .* announced"):
        unseal(data + b"\x00", KEY, "the test payload")
    assert no_parsing == []


def test_another_key_is_refused_before_parsing(no_parsing):
    with pytest.raises(SealError, match="its tag does not match"):
        unseal(seal(PAYLOAD, PUBLIC_KEY), KEY, "the test payload")
    assert no_parsing == []


def test_a_payload_larger_than_the_limit_is_refused_before_it_is_read(monkeypatch):
    data = seal({"w": torch.zeros(1000)}, KEY)
    stream = io.BytesIO(data)
    with pytest.raises(SealError, match="more than the 1000 accepted"):
        read_sealed(stream, KEY, "the test payload", limit=1000)
    assert stream.tell() == sealed.PREAMBLE.size  # only the preamble was read


def test_another_version_or_a_huge_header_is_refused_from_the_preamble():
    data = bytearray(seal(1, KEY))
    data[6] = sealed.VERSION + 1
    with pytest.raises(SealError, match=f"version {sealed.VERSION + 1}"):
        unseal(bytes(data), KEY, "p")
    huge = sealed.PREAMBLE.pack(sealed.MAGIC, sealed.VERSION, sealed.HEADER_CAP + 1, 0)
    with pytest.raises(SealError, match="a header of"):
        read_sealed(io.BytesIO(huge), KEY, "p", limit=1 << 40)


def framed(header: bytes, data: bytes = b"", key: bytes = KEY) -> bytes:
    """A payload of this header and data with a good tag: what a peer holding the key could send."""
    head = sealed.PREAMBLE.pack(sealed.MAGIC, sealed.VERSION, len(header), len(data)) + header
    body = head + bytes(-len(head) % sealed.ALIGN) + data
    return body + hmac.new(key, body, hashlib.sha256).digest()


@pytest.mark.parametrize(
    "header",
    [
        b"not json",
        b'{"pickle": "x"}',
        b'{"tuple": [1], "set": []}',
        b'{"map": 1}',
        b'{"map": {}, "dict": []}',
        b'{"tensor": ["float32", [4], 0]}',  # past the data
        b'{"tensor": ["float32", [1], 3]}',  # not aligned
        b'{"tensor": ["object", [1], 0]}',
        b'{"tensor": ["float32", [-1], 0]}',
        b'{"bytes": [0, 99]}',
        b'{"dict": [[[1], 2]]}',  # a list as a key
        b'{"dict": [[1, 2], [1, 3]]}',  # a key twice
        b'{"map": {"a": 1, "a": 2}}',
        b'{"dtype": "qint8"}',
        b"[" * 100000 + b"]" * 100000,
        b"\xff",
    ],
)
def test_malformed_content_under_a_good_tag_is_one_line(header):
    with pytest.raises(SealError, match="malformed content") as e:
        unseal(framed(header, bytes(8)), KEY, "the test payload")
    assert "\n" not in str(e.value)


# ---- refused when sealing -----------------------------------------------------------------------
class Level(enum.IntEnum):
    LOW = 1


@pytest.mark.parametrize(
    "value,says",
    [
        ({"a": [1, object()]}, r"the payload\['a'\]\[1\]: a builtins.object is not a sealed type"),
        ({"lr": Level.LOW}, r"the payload\['lr'\]: a test_sealed.Level is not a sealed type"),
        (lambda: 0, "a builtins.function is not a sealed type"),
        ({frozenset(): 1}, "a key of the payload: a frozenset"),
        (torch.zeros(2).to_sparse(), "a torch.sparse_coo torch.float32 tensor is not a sealed tensor"),
        (torch.zeros(2, device="meta"), "the meta device"),
        (torch.empty(2, dtype=torch.float4_e2m1fn_x2), "a torch.strided torch.float4_e2m1fn_x2 tensor is not a sealed"),
    ],
)
def test_an_unsupported_value_is_refused_in_one_line_naming_its_type(value, says):
    with pytest.raises(DataError, match=says) as e:
        seal(value, KEY)
    assert "\n" not in str(e.value)


# ---- nothing is unpickled -----------------------------------------------------------------------
class Canary:
    """Unpickled, it creates the file at `path`."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_a_crafted_pickle_never_runs_as_the_payload_as_bytes_or_as_a_tensors_data(tmp_path):
    canary = tmp_path / "canary"
    evil = pickle.dumps(Canary(str(canary)))
    with pytest.raises(SealError, match="not a sealed payload"):
        unseal(evil, KEY, "the test payload")
    with pytest.raises(SealError, match="its tag does not match"):
        unseal(framed(evil), b"another key" * 3, "the test payload")
    as_data = torch.frombuffer(bytearray(evil), dtype=torch.uint8)
    back = again({"bytes": evil, "tensor": as_data})
    assert back["bytes"] == evil and bits(back["tensor"]) == evil  # data, never code
    with pytest.raises(SealError, match="malformed content"):
        unseal(framed(evil), KEY, "the test payload")  # a pickle where the header goes, under a good tag
    assert not canary.exists()
