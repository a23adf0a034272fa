"""Sealed payloads: the one format for what crosses between processes outside a collective (a heal's
state, a local rank's result), as tensors plus JSON behind an HMAC. Nothing received is unpickled.

    offset 0   MAGIC (6 bytes) | VERSION (1) | 0 (1) | header bytes H (u64 LE) | data bytes D (u64 LE)
    24         the header: the object as JSON (ASCII), H bytes, then zeros up to a multiple of ALIGN
    ...        the data: each tensor's (and bytes value's) raw bytes at an offset of the header's,
               every one a multiple of ALIGN from the data's start, D bytes in all
    end        TAG: HMAC-SHA256 under the payload's key of every byte before it

The reader reads the 24-byte preamble (only to bound the read: H and D against its limit), then the
rest whole into memory, checks the tag, and only then parses the header and builds tensors (each a
copy of its bytes, `frombuffer(...).clone()`). One tag over the whole payload, not one per chunk: a
heal applies the whole state or none of it, so it has to hold it all before using any of it anyway,
and one tag leaves nothing to reorder or drop between chunks. The cost is that the receiver holds the
payload and the tensors built from it at once (two copies, at the peak); the sender adds none (its
tensors are written from their own memory).

The key: the run secret's for the payload's use (`key_for`), or without a secret the public
PUBLIC_KEY: the tag then still catches a corrupted or cut payload, not a forged one.

The object model, JSON where JSON says it (`null`, `true`, numbers, strings, lists; an int stays an
int and a float a float, NaN and infinities included), every other kind a one-key tagged object:
{"tuple": [...]}, {"set": [...]}, {"map": {str: ...}} (a dict whose keys are all strings),
{"dict": [[key, value], ...]} (other keys: int, float, bool, None, str, tuples of them; each keeps
its type), either dict form with "meta" (a state_dict's `_metadata`, given back on an OrderedDict),
{"tensor": [dtype, shape, offset]} (any dtype of DTYPES, bfloat16 included; the shape, never the
strides), {"bytes": [offset, length]}, {"dtype": name}, {"size": [...]} (torch.Size). Anything else
is refused when sealing, in one line naming its type and where it lies. Byte order: the host's
(little-endian on every platform torch ships for).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import struct
import warnings
from collections import OrderedDict
from types import MappingProxyType
from typing import Any, BinaryIO, Iterator

import torch

from ..errors import DataError, PeerError
from .secret import Secret

MAGIC = b"WSSEAL"
VERSION = 1
PREAMBLE = struct.Struct("<6sBxQQ")
TAG = 32
ALIGN = 64
HEADER_CAP = 1 << 28  # 256 MiB of JSON: millions of tensors' entries
PUBLIC_KEY = b"wansync/no-secret"
DTYPES = MappingProxyType(
    {
        str(d).removeprefix("torch."): d
        for d in (
            torch.float64,
            torch.float32,
            torch.float16,
            torch.bfloat16,
            torch.complex128,
            torch.complex64,
            torch.int64,
            torch.int32,
            torch.int16,
            torch.int8,
            torch.uint8,
            torch.bool,
            *(
                getattr(torch, name)
                for name in (
                    "uint16",
                    "uint32",
                    "uint64",
                    "float8_e4m3fn",
                    "float8_e5m2",
                    "float8_e4m3fnuz",
                    "float8_e5m2fnuz",
                    "float8_e8m0fnu",
                )
                if hasattr(torch, name)
            ),
        )
    }
)
KEY_TYPES = (str, int, float, bool, type(None))  # and dtypes and tuples of them


class SealError(PeerError):
    """A payload refused before anything of it was used: a wrong tag, cut short, or malformed."""


def key_for(secret: Secret | None, use: str) -> bytes:
    """The key that seals payloads of `use` ("heal", ...): the secret's, or PUBLIC_KEY without one."""
    return secret.key(f"sealed/{use}") if secret is not None else PUBLIC_KEY


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


class Sealed:
    """`obj` encoded for sealing under `key`: the header made now, the data written from the tensors'
    own memory (tensors not on the CPU are copied there; non-contiguous ones made contiguous)."""

    def __init__(self, obj: Any, key: bytes):
        self.key = key
        self.blobs: list[tuple[int, memoryview]] = []  # (offset in the data, its bytes)
        self.data_bytes = 0
        self.header = json.dumps(self._value(obj, "the payload"), separators=(",", ":")).encode("ascii")
        self.preamble = PREAMBLE.pack(MAGIC, VERSION, len(self.header), self.data_bytes)
        self.size = _aligned(PREAMBLE.size + len(self.header)) + self.data_bytes + TAG

    def chunks(self) -> Iterator[bytes | memoryview]:
        """The payload's bytes in order, the tag last."""
        mac = hmac.new(self.key, digestmod=hashlib.sha256)
        head = PREAMBLE.size + len(self.header)
        parts: list[bytes | memoryview] = [self.preamble, self.header, bytes(_aligned(head) - head)]
        at = 0
        for offset, blob in self.blobs:
            parts.append(bytes(offset - at))
            parts.append(blob)
            at = offset + len(blob)
        parts.append(bytes(self.data_bytes - at))
        for part in parts:
            if len(part):
                mac.update(part)
                yield part
        yield mac.digest()

    def write(self, stream: Any) -> int:
        """Write the payload to `stream` (a socket's `sendall` or a file's `write`); its size."""
        send = getattr(stream, "sendall", None) or stream.write
        for part in self.chunks():
            send(part)
        return self.size

    def _blob(self, raw: memoryview) -> int:
        offset = self.data_bytes
        self.blobs.append((offset, raw))
        self.data_bytes = _aligned(offset + len(raw))
        return offset

    def _value(self, x: Any, where: str) -> Any:
        kind = type(x)
        if x is None or kind in (bool, int, float, str):
            return x
        if kind is list:
            return [self._value(v, f"{where}[{i}]") for i, v in enumerate(x)]
        if kind is tuple:
            return {"tuple": [self._value(v, f"{where}[{i}]") for i, v in enumerate(x)]}
        if kind is set:
            return {"set": [self._key(v, f"an element of {where}") for v in x]}
        if kind in (dict, OrderedDict):
            return self._dict(x, where)
        if kind in (torch.Tensor, torch.nn.Parameter):
            return {"tensor": self._tensor(x, where)}
        if kind is bytes:
            return {"bytes": [self._blob(memoryview(x)), len(x)]}
        if kind is torch.dtype:
            if str(x).removeprefix("torch.") not in DTYPES:
                raise DataError(f"cannot seal {where}: dtype {x} is not one of the sealed dtypes")
            return {"dtype": str(x).removeprefix("torch.")}
        if kind is torch.Size:
            return {"size": list(x)}
        raise DataError(
            f"cannot seal {where}: a {kind.__module__}.{kind.__qualname__} is not a sealed type "
            f"(tensors, dicts, lists, tuples, sets, numbers, strings, bytes, None, dtypes)"
        )

    def _dict(self, x: dict, where: str) -> dict[str, Any]:
        if all(type(k) is str for k in x):
            out: dict[str, Any] = {"map": {k: self._value(v, f"{where}[{k!r}]") for k, v in x.items()}}
        else:
            out = {
                "dict": [[self._key(k, f"a key of {where}"), self._value(v, f"{where}[{k!r}]")] for k, v in x.items()]
            }
        meta = getattr(x, "_metadata", None)
        if meta is not None:
            out["meta"] = self._value(meta, f"{where}._metadata")
        return out

    def _key(self, k: Any, where: str) -> Any:
        """A dict's key or a set's element: a value of a hashable kind."""
        if type(k) is tuple:
            return {"tuple": [self._key(v, where) for v in k]}
        if type(k) is torch.dtype:
            return self._value(k, where)
        if type(k) not in KEY_TYPES:
            raise DataError(
                f"cannot seal {where}: a {type(k).__qualname__} (keys and set elements are str, int, float, "
                f"bool, None, dtypes and tuples of them)"
            )
        return k

    def _tensor(self, x: torch.Tensor, where: str) -> list[Any]:
        name = str(x.dtype).removeprefix("torch.")
        if x.layout != torch.strided or x.is_quantized or name not in DTYPES:
            raise DataError(f"cannot seal {where}: a {x.layout} {x.dtype} tensor is not a sealed tensor")
        t = x.detach()
        if t.device.type == "meta":
            raise DataError(f"cannot seal {where}: a tensor on the meta device has no data")
        t = t.cpu().resolve_conj().resolve_neg().contiguous()
        raw = t.reshape(-1).view(torch.uint8).numpy().data if t.numel() else memoryview(b"")
        return [name, list(t.shape), self._blob(raw)]


def seal(obj: Any, key: bytes) -> bytes:
    """`obj` as one sealed payload."""
    return b"".join(Sealed(obj, key).chunks())


def write_sealed(stream: Any, obj: Any, key: bytes) -> int:
    """Seal `obj` onto `stream` (a socket or a binary file) without copying its tensors; the bytes written."""
    return Sealed(obj, key).write(stream)


def unseal(data: bytes | bytearray | memoryview, key: bytes, what: str) -> Any:
    """The object sealed in `data`; SealError, one line naming `what`, when its tag does not match
    or it is cut short or malformed (nothing of it parsed before the tag matched)."""
    view = memoryview(data).cast("B")
    if len(view) < PREAMBLE.size:
        raise SealError(f"{what}: refused: {len(view)} bytes, shorter than a sealed payload's preamble")
    header_bytes, data_bytes = _preamble(bytes(view[: PREAMBLE.size]), what)
    if len(view) != _total(header_bytes, data_bytes):
        raise SealError(f"{what}: refused: {len(view)} bytes, not the {_total(header_bytes, data_bytes)} announced")
    with warnings.catch_warnings():  # a read-only buffer: every tensor built from it is a copy
        warnings.simplefilter("ignore")
        payload = torch.frombuffer(view, dtype=torch.uint8)
    return _open(payload, header_bytes, data_bytes, key, what)


def read_sealed(stream: BinaryIO, key: bytes, what: str, limit: int) -> Any:
    """The object of the sealed payload read from `stream` (with `readinto`), at most `limit` bytes of
    header and data: a longer one is refused before anything is allocated. SealError as `unseal`."""
    preamble = bytes(_read_exactly(stream, memoryview(bytearray(PREAMBLE.size)), what))
    header_bytes, data_bytes = _preamble(preamble, what)
    if header_bytes + data_bytes > limit:
        raise SealError(f"{what}: refused: {header_bytes + data_bytes} bytes announced, more than the {limit} accepted")
    payload = torch.empty(_total(header_bytes, data_bytes), dtype=torch.uint8)
    view = payload.numpy().data
    view[: PREAMBLE.size] = preamble
    _read_exactly(stream, view[PREAMBLE.size :], what)
    return _open(payload, header_bytes, data_bytes, key, what)


def _preamble(raw: bytes, what: str) -> tuple[int, int]:
    magic, version, header_bytes, data_bytes = PREAMBLE.unpack(raw)
    if magic != MAGIC:
        raise SealError(f"{what}: refused: not a sealed payload (no {MAGIC.decode()} magic)")
    if version != VERSION:
        raise SealError(f"{what}: refused: sealed payload version {version}, this wansync reads {VERSION}")
    if header_bytes > HEADER_CAP:
        raise SealError(f"{what}: refused: a header of {header_bytes} bytes, more than {HEADER_CAP}")
    return header_bytes, data_bytes


def _total(header_bytes: int, data_bytes: int) -> int:
    """A payload's bytes: preamble and header (padded), data, tag."""
    return _aligned(PREAMBLE.size + header_bytes) + data_bytes + TAG


def _read_exactly(stream: BinaryIO, view: memoryview, what: str) -> memoryview:
    got = 0
    while got < len(view):
        n = stream.readinto(view[got:])  # type: ignore[attr-defined]
        if not n:
            raise SealError(f"{what}: refused: cut short after {got} of {len(view)} bytes")
        got += n
    return view


def _open(payload: torch.Tensor, header_bytes: int, data_bytes: int, key: bytes, what: str) -> Any:
    """Check the tag over the whole `payload`, then (only then) parse its header and build its tensors."""
    raw = payload.numpy().data
    end = len(raw) - TAG
    mac = hmac.new(key, raw[:end], hashlib.sha256)
    if not hmac.compare_digest(mac.digest(), bytes(raw[end:])):
        raise SealError(
            f"{what}: refused: its tag does not match (corrupted on the way, or sealed without this run's secret)"
        )
    header = bytes(raw[PREAMBLE.size : PREAMBLE.size + header_bytes])
    return _parse(header, payload[end - data_bytes : end], what)


def _parse(header: bytes, data: torch.Tensor, what: str) -> Any:
    """The object of an authenticated payload; SealError for one whose content is malformed."""
    try:
        tree = json.loads(header.decode("ascii"), object_pairs_hook=_unique)
        return _Builder(data).value(tree)
    except (ValueError, TypeError, KeyError, IndexError, OverflowError, RecursionError, RuntimeError) as e:
        text = str(e).splitlines()[0] if str(e).strip() else type(e).__name__
        raise SealError(f"{what}: refused: malformed content ({text[:200]})") from None


def _unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        raise ValueError("a JSON object repeats a key")
    return out


class _Builder:
    """The objects of a parsed header, tensors copied out of the authenticated data."""

    def __init__(self, data: torch.Tensor):
        self.data = data

    def value(self, x: Any) -> Any:
        if x is None or type(x) in (bool, int, float, str):
            return x
        if type(x) is list:
            return [self.value(v) for v in x]
        if type(x) is not dict or not x:
            raise ValueError(f"unexpected {type(x).__name__}")
        tag, body = next(iter(x.items()))
        if tag in ("map", "dict"):
            return self._dict(x)
        if len(x) != 1:
            raise ValueError(f"a {tag} with more than one key")
        if tag == "tuple":
            return tuple(self.value(v) for v in _list(body))
        if tag == "set":
            return {self._key(v) for v in _list(body)}
        if tag == "tensor":
            return self._tensor(*_list(body, 3))
        if tag == "bytes":
            offset, length = _list(body, 2)
            return bytes(self._slice(offset, length).numpy())
        if tag == "dtype":
            return DTYPES[body]
        if tag == "size":
            return torch.Size([_count(n) for n in _list(body)])
        raise ValueError(f"unknown tag {tag!r}")

    def _dict(self, x: dict[str, Any]) -> dict[Any, Any]:
        if set(x) - {"map", "dict", "meta"} or ("map" in x) == ("dict" in x):
            raise ValueError("a dict with other keys than map or dict, and meta")
        if "map" in x:
            if type(x["map"]) is not dict:
                raise ValueError("a map that is not a JSON object")
            items = [(k, self.value(v)) for k, v in x["map"].items()]
        else:
            items = [(self._key(k), self.value(v)) for k, v in (_list(pair, 2) for pair in _list(x["dict"]))]
        if "meta" not in x:
            out = dict(items)
            if len(out) != len(items):
                raise ValueError("a dict repeats a key")
            return out
        meta: Any = OrderedDict(items)
        meta._metadata = self.value(x["meta"])
        return meta

    def _key(self, k: Any) -> Any:
        if type(k) is dict and set(k) == {"tuple"}:
            return tuple(self._key(v) for v in _list(k["tuple"]))
        if type(k) is dict and set(k) == {"dtype"}:
            return DTYPES[k["dtype"]]
        if type(k) not in KEY_TYPES:
            raise ValueError(f"a {type(k).__name__} key")
        return k

    def _slice(self, offset: Any, nbytes: int) -> torch.Tensor:
        offset = _count(offset)
        if offset % ALIGN or offset + nbytes > len(self.data):
            raise ValueError(f"data at {offset}+{nbytes} outside the payload's {len(self.data)} bytes")
        return self.data[offset : offset + nbytes]

    def _tensor(self, dtype: Any, shape: Any, offset: Any) -> torch.Tensor:
        d = DTYPES[dtype]
        dims = [_count(n) for n in _list(shape)]
        numel = 1
        for n in dims:
            numel *= n
        itemsize = torch.empty(0, dtype=d).element_size()
        flat = self._slice(offset, numel * itemsize)
        return flat.view(d).reshape(dims).clone()


def _list(x: Any, n: int | None = None) -> list[Any]:
    if type(x) is not list or (n is not None and len(x) != n):
        raise ValueError(f"expected a list{'' if n is None else f' of {n}'}")
    return x


def _count(x: Any) -> int:
    if type(x) is not int or x < 0:
        raise ValueError(f"expected a count, got {x!r}"[:80])
    return x
