"""Image datasets as whole uint8 tensors in memory (N×C×H×W) plus integer labels.

Spec strings: "fashion-mnist" (Debian package), "fashion-mnist:PATH", "cifar100:PATH",
"cifar10:PATH", "imagefolder:PATH". Converting to float happens per batch, which keeps
memory at one byte per pixel and makes batch assembly a cheap index.
"""

from __future__ import annotations

import gzip
import pickle
from typing import Any
from pathlib import Path
from types import MappingProxyType

import numpy as np
import torch

from wansync.errors import ConfigError, DataError

from .imagedata import ImageData

FASHION_MNIST_DIR = Path("/usr/share/datasets/fashion-mnist")
DATASET_FORMS = ("fashion-mnist", "fashion-mnist:PATH", "cifar100:PATH", "cifar10:PATH", "imagefolder:PATH")


def load_dataset(spec: str) -> ImageData:
    """Load the dataset a spec string names (see DATASET_FORMS)."""
    name, _, path = spec.partition(":")
    name = name.strip().lower()
    if name == "fashion-mnist":
        return load_fashion_mnist(Path(path) if path else None)
    if name in ("cifar100", "cifar10") and path:
        return load_cifar(Path(path), classes=100 if name == "cifar100" else 10)
    if name == "imagefolder" and path:
        from .imagefolder import load_imagefolder

        return load_imagefolder(Path(path))
    raise ConfigError(f"unknown vision dataset {spec!r}; valid forms: {', '.join(DATASET_FORMS)}")


# --- Fashion-MNIST (idx format, optionally gzipped) -------------------------------------------

_FMNIST_FILES = MappingProxyType(
    {
        "train_x": "train-images-idx3-ubyte",
        "train_y": "train-labels-idx1-ubyte",
        "test_x": "t10k-images-idx3-ubyte",
        "test_y": "t10k-labels-idx1-ubyte",
    }
)
FASHION_MNIST_CLASSES = (
    "T-shirt/top",
    "Trouser",
    "Pullover",
    "Dress",
    "Coat",
    "Sandal",
    "Shirt",
    "Sneaker",
    "Bag",
    "Ankle boot",
)


def read_idx(path: Path) -> np.ndarray:
    """Read one idx file (uint8 payload), gzipped or not."""
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rb") as f:
            raw = f.read()
    except (OSError, EOFError) as e:
        raise DataError(f"cannot read idx file {path}: {e}") from None
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] != 0x08:
        raise DataError(f"{path} is not a uint8 idx file")
    ndim = raw[3]
    dims = [int.from_bytes(raw[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim)]
    payload = np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * ndim)
    if payload.size != int(np.prod(dims)):
        raise DataError(f"{path} is truncated or corrupt: its header says {dims} but it holds {payload.size} bytes")
    return payload.reshape(dims)


def load_fashion_mnist(directory: Path | None = None) -> ImageData:
    """Fashion-MNIST from the Debian package's directory (or `directory`): 60k/10k 1×28×28, 10 classes."""
    d = directory or FASHION_MNIST_DIR
    arrays = {}
    for key, stem in _FMNIST_FILES.items():
        found = [d / (stem + suf) for suf in (".gz", "") if (d / (stem + suf)).is_file()]
        if not found:
            raise DataError(
                f"Fashion-MNIST file {stem}.gz not found in {d}: run `apt-get install "
                f"dataset-fashion-mnist`, or put the four idx files from the Fashion-MNIST "
                f"GitHub releases in a directory and pass fashion-mnist:PATH"
            )
        arrays[key] = read_idx(found[0])
    x_tr, x_te = (torch.from_numpy(arrays[k].copy()).unsqueeze(1) for k in ("train_x", "test_x"))
    y_tr, y_te = (torch.from_numpy(arrays[k].astype(np.int64)) for k in ("train_y", "test_y"))
    return ImageData("fashion-mnist", x_tr, y_tr, x_te, y_te, 10, list(FASHION_MNIST_CLASSES))


# --- CIFAR (python pickle format) ----------------------------------------------------------


# What a CIFAR batch's pickle may name: numpy's array and dtype reconstruction, nothing else. Any other
# global (os.system, a __reduce__ of anyone's) is refused before it runs: a file handed around as
# "CIFAR" cannot run code, wherever it came from.
CIFAR_GLOBALS = frozenset(
    (module, name)
    for module in ("numpy.core.multiarray", "numpy._core.multiarray", "numpy")
    for name in ("_reconstruct", "ndarray", "dtype", "scalar")
)


class _CifarUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in CIFAR_GLOBALS:
            raise pickle.UnpicklingError(
                f"it names {module}.{name}, which a CIFAR batch never holds (arrays, lists, bytes)"
            )
        return super().find_class(module, name)


def _unpickle(path: Path) -> dict:
    # Only numpy arrays and plain data are built (`CIFAR_GLOBALS`): pickle would otherwise run code.
    try:
        with open(path, "rb") as f:
            obj = _CifarUnpickler(f, encoding="bytes").load()
    except Exception as e:  # noqa: BLE001 - any failure to unpickle is a data problem
        raise DataError(f"cannot read CIFAR file {path}: {type(e).__name__}: {e}") from None
    if not isinstance(obj, dict):
        raise DataError(f"CIFAR file {path} does not hold a dict")
    return obj


def _cifar_split(files: list[Path], label_key: bytes, classes: int) -> tuple[torch.Tensor, torch.Tensor]:
    xs, ys = [], []
    for p in files:
        d = _unpickle(p)
        if b"data" not in d or label_key not in d:
            raise DataError(f"CIFAR file {p} lacks b'data' or {label_key!r}")
        data = np.asarray(d[b"data"], dtype=np.uint8)
        if data.ndim != 2 or data.shape[1] != 3072:
            raise DataError(f"CIFAR file {p}: b'data' must be N×3072 uint8, got {data.shape}")
        xs.append(data.reshape(-1, 3, 32, 32))
        ys.append(np.asarray(d[label_key], dtype=np.int64))
    x, y = np.concatenate(xs), np.concatenate(ys)
    if len(y) and (y.min() < 0 or y.max() >= classes):
        raise DataError(f"CIFAR labels in {files[0].parent} fall outside 0..{classes - 1}")
    return torch.from_numpy(x), torch.from_numpy(y)


def load_cifar(directory: Path, classes: int = 100) -> ImageData:
    """CIFAR-100 (`train`, `test`, `meta`) or CIFAR-10 (`data_batch_1..5`, `test_batch`) directory."""
    d = directory
    sub = d / ("cifar-100-python" if classes == 100 else "cifar-10-batches-py")
    if sub.is_dir():  # accept the archive's parent directory too
        d = sub
    if not d.is_dir():
        raise DataError(f"CIFAR directory {directory} does not exist")
    if classes == 100:
        train, test, meta, key, names_key = ["train"], ["test"], "meta", b"fine_labels", b"fine_label_names"
    else:
        train = [f"data_batch_{i}" for i in range(1, 6)]
        test, meta, key, names_key = ["test_batch"], "batches.meta", b"labels", b"label_names"
    for fname in train + test:
        if not (d / fname).is_file():
            raise DataError(f"CIFAR-{classes} file {fname!r} missing in {d}")
    x_tr, y_tr = _cifar_split([d / f for f in train], key, classes)
    x_te, y_te = _cifar_split([d / f for f in test], key, classes)
    names: list[str] = []
    if (d / meta).is_file():
        raw = _unpickle(d / meta).get(names_key, [])
        names = [n.decode() if isinstance(n, bytes) else str(n) for n in raw]
    return ImageData(f"cifar{classes}", x_tr, y_tr, x_te, y_te, classes, names)
