"""ImageFolder-style datasets (e.g. TinyImageNet) decoded once with Pillow into uint8 tensors.

Layout: PATH/train/<class>/**/*.{JPEG,jpg,png} and either PATH/val/<class>/... or TinyImageNet's
PATH/val/images/* + PATH/val/val_annotations.txt. Every image is converted to RGB and resized to the
first training image's size (its shorter side, squared), so one dataset is one dense tensor.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError

from wansync.errors import DataError

from .imagedata import ImageData

IMAGE_EXTS = frozenset({".jpeg", ".jpg", ".png", ".bmp", ".gif", ".webp"})


def _images_under(d: Path) -> list[Path]:
    return sorted(p for p in d.rglob("*") if p.is_file() and p.suffix.lower() in IMAGE_EXTS)


def _train_split(root: Path) -> tuple[list[str], list[tuple[Path, int]]]:
    train = root / "train"
    if not train.is_dir():
        raise DataError(f"image folder {root} has no train/ directory (expected train/<class>/*.jpg)")
    classes = sorted(p.name for p in train.iterdir() if p.is_dir())
    if not classes:
        raise DataError(f"image folder {train} has no class directories (expected train/<class>/*.jpg)")
    items = []
    for i, c in enumerate(classes):
        imgs = _images_under(train / c)
        if not imgs:
            raise DataError(f"class directory {train / c} holds no images (.jpg/.jpeg/.png)")
        items += [(p, i) for p in imgs]
    return classes, items


def _val_split(root: Path, classes: list[str]) -> list[tuple[Path, int]]:
    index = {c: i for i, c in enumerate(classes)}
    for name in ("val", "test"):
        d = root / name
        if not d.is_dir():
            continue
        ann = d / "val_annotations.txt"
        if ann.is_file() and (d / "images").is_dir():  # TinyImageNet layout
            items = []
            for n, line in enumerate(ann.read_text().splitlines(), 1):
                parts = line.split("\t")
                if len(parts) < 2 or not line.strip():
                    continue
                if parts[1] not in index:
                    raise DataError(f"{ann}:{n}: class {parts[1]!r} is not a train class")
                items.append((d / "images" / parts[0], index[parts[1]]))
            if not items:
                raise DataError(f"{ann} lists no images")
            return items
        subdirs = sorted(p.name for p in d.iterdir() if p.is_dir())
        unknown = [s for s in subdirs if s not in index]
        if unknown:
            raise DataError(f"{d} has class directory {unknown[0]!r} that train/ lacks")
        items = [(p, index[c]) for c in subdirs for p in _images_under(d / c)]
        if not items:
            raise DataError(f"{d} holds no images in class directories")
        return items
    raise DataError(f"image folder {root} has no val/ (or test/) split")


def _decode(path: Path, size: tuple[int, int] | None) -> np.ndarray:
    try:
        with Image.open(path) as im:
            im = im.convert("RGB")
            if size is not None and im.size != size:
                im = im.resize(size, Image.BILINEAR)
            return np.asarray(im, dtype=np.uint8).transpose(2, 0, 1)
    except (UnidentifiedImageError, OSError, ValueError) as e:
        raise DataError(f"cannot read image {path}: {type(e).__name__}") from e


def _decode_all(items: list[tuple[Path, int]], size: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    out = np.empty((len(items), 3, size[1], size[0]), dtype=np.uint8)

    def work(i: int) -> None:
        out[i] = _decode(items[i][0], size)

    # Pillow releases the GIL while decoding, so threads help on large folders.
    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        list(pool.map(work, range(len(items))))
    return torch.from_numpy(out), torch.tensor([c for _, c in items], dtype=torch.long)


def load_imagefolder(root: Path) -> ImageData:
    """Load PATH/train and PATH/val (or TinyImageNet's val layout) as RGB uint8 tensors."""
    if not root.is_dir():
        raise DataError(f"image folder {root} does not exist")
    classes, train = _train_split(root)
    val = _val_split(root, classes)
    first = _decode(train[0][0], None)
    side = min(first.shape[1], first.shape[2])  # square, so ViT patches tile it
    size = (side, side)
    x_tr, y_tr = _decode_all(train, size)
    x_te, y_te = _decode_all(val, size)
    return ImageData(f"imagefolder:{root.name}", x_tr, y_tr, x_te, y_te, len(classes), classes)
