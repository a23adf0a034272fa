"""One way to write a file (issue 61): a scan of src/ with `ast` for every way Python, torch, numpy,
matplotlib or shutil writes a file, outside `rundir/files.py`, each exception named with its reason.

`rundir.files` replaces a link, never writes through it, and refuses a hard link or another user's
file (docs/reliability.md, rule 1); a module that writes by itself escapes that. What a third party
writes under a name of its own (TensorBoard's event files, torch.distributed.checkpoint's shards) is
allowed here, by file and by reason: wansync makes their directory (`files.directory`, which refuses
a link there). An allowance that no longer matches anything fails too, so the list cannot rot.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src"
THE_WRITER = "wansync/rundir/files.py"

# (file under src/, what it calls, why that is not a file wansync writes by itself)
ALLOWED = (
    (
        "wansync/rundir/checkpoint.py",
        "torch.distributed.checkpoint.save",
        "a worker's sharded checkpoint: torch.distributed.checkpoint writes its own file names into "
        "checkpoints/stepN/workerW/, which save_sharded makes first with files.directory (a link there refused)",
    ),
    (
        "wansync/telemetry/tensorboard.py",
        "torch.utils.tensorboard.SummaryWriter",
        "TensorBoard writes new event files of its own naming; the run's tensorboard/ is made by "
        "files.directory first (telemetry.run: a link there refused); a directory a user names is theirs",
    ),
)

WRITE_MODE = set("wax+")
OPENERS = {"open", "io.open", "builtins.open", "codecs.open", "os.fdopen", "gzip.open", "bz2.open", "lzma.open"}
WRITE_FLAGS = {"O_WRONLY", "O_RDWR", "O_CREAT", "O_APPEND", "O_TRUNC"}
SAVERS = {  # call -> index of its target argument
    "torch.save": 1,
    "numpy.save": 0,
    "numpy.savez": 0,
    "numpy.savez_compressed": 0,
    "numpy.savetxt": 0,
}
MOVERS = {
    "os.replace",
    "os.rename",
    "os.renames",
    "os.link",
    "os.symlink",
    "os.mkfifo",
    "shutil.copy",
    "shutil.copy2",
    "shutil.copyfile",
    "shutil.copytree",
    "shutil.move",
    "tempfile.mkstemp",
    "tempfile.NamedTemporaryFile",
}
PATH_WRITERS = {"write_text", "write_bytes", "touch", "rename", "symlink_to", "hardlink_to"}
THIRD_PARTY = {"torch.distributed.checkpoint.save", "torch.utils.tensorboard.SummaryWriter"}
BUFFERS = {"io.BytesIO", "io.StringIO", "BytesIO", "StringIO"}


def aliases(tree: ast.AST) -> dict[str, str]:
    """Each name an import binds (anywhere in the module) -> what it names; `np` -> `numpy`, and a
    relative import as written (`from ..rundir import files` -> `..rundir.files`)."""
    out: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                out[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom):
            base = "." * node.level + (f"{node.module}." if node.module else "")
            for a in node.names:
                out[a.asname or a.name] = f"{base}{a.name}"
    return out


def through_the_writer(name: str) -> bool:
    """A call of `rundir.files` itself (`files.write_text`), however the module was imported."""
    module = name.rpartition(".")[0]
    return module.endswith("rundir.files") or module == ".files"


def dotted(node: ast.AST, names: dict[str, str]) -> str:
    """`a.b.c` of a call's function, its first name resolved through the imports ("" if not a name)."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return ""
    return ".".join([names.get(node.id, node.id), *reversed(parts)])


def arg(call: ast.Call, index: int, keyword: str) -> ast.expr | None:
    found = next((k.value for k in call.keywords if k.arg == keyword), None)
    return found if found is not None else (call.args[index] if len(call.args) > index else None)


def in_memory(tree: ast.AST, names: dict[str, str]) -> set[str]:
    """Names the module binds to an in-memory buffer (`buf = io.BytesIO()`): a save into one writes no file."""
    return {
        t.id
        for node in ast.walk(tree)
        if isinstance(node, ast.Assign)
        and isinstance(node.value, ast.Call)
        and dotted(node.value.func, names) in BUFFERS
        for t in node.targets
        if isinstance(t, ast.Name)
    }


def writes_mode(mode: ast.expr | None) -> bool:
    """A mode that may write: one with w, a, x or +, or one computed at run time (it may)."""
    if mode is None:
        return False
    return not isinstance(mode, ast.Constant) or (isinstance(mode.value, str) and bool(WRITE_MODE & set(mode.value)))


def write_flags(flags: ast.expr | None) -> bool:
    """os.open's flags hold a write flag, or a value the scan cannot read (a variable)."""
    if flags is None:
        return False
    named = {
        n.attr if isinstance(n, ast.Attribute) else n.id
        for n in ast.walk(flags)
        if isinstance(n, (ast.Attribute, ast.Name))
    }
    return bool(named & WRITE_FLAGS) or not any(n.startswith("O_") for n in named)


def findings(source: str) -> list[tuple[int, str]]:
    """(line, what) of every call in `source` that may write a file."""
    tree = ast.parse(source)
    names = aliases(tree)
    buffers = in_memory(tree, names)
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        name = dotted(node.func, names)
        if through_the_writer(name):
            continue
        attr = node.func.attr if isinstance(node.func, ast.Attribute) else ""
        if name in OPENERS:
            if writes_mode(arg(node, 1, "mode")):
                found.append((node.lineno, f"{name} to write"))
        elif attr == "open":  # Path.open(mode): only a mode given as text is read (Image.open(path) is not one)
            mode = arg(node, 0, "mode")
            if isinstance(mode, ast.Constant) and writes_mode(mode):
                found.append((node.lineno, ".open to write"))
        if name == "os.open" and write_flags(arg(node, 1, "flags")):
            found.append((node.lineno, "os.open to write"))
        if name in SAVERS or attr == "savefig":
            target = (
                arg(node, 0, "fname")
                if attr == "savefig"
                else arg(node, SAVERS[name], "f" if name == "torch.save" else "file")
            )
            if not (isinstance(target, ast.Name) and target.id in buffers):
                found.append((node.lineno, name if name in SAVERS else ".savefig"))
        if name in MOVERS:
            found.append((node.lineno, name))
        elif attr in PATH_WRITERS:
            found.append((node.lineno, f".{attr}"))
        elif attr == "replace" and len(node.args) == 1 and not node.keywords:  # Path.replace (str.replace takes two)
            found.append((node.lineno, ".replace"))
        if name in THIRD_PARTY:
            found.append((node.lineno, name))
    return sorted(found)


@functools.cache
def scan() -> dict[str, list[tuple[int, str]]]:
    out = {}
    for path in sorted((SRC / "wansync").rglob("*.py")):
        rel = path.relative_to(SRC).as_posix()
        hits = findings(path.read_text()) if rel != THE_WRITER else []
        if hits:
            out[rel] = hits
    return out


def test_nothing_in_src_writes_a_file_but_through_rundir_files():
    allowed = {(path, what) for path, what, _ in ALLOWED}
    bad = [
        f"{path}:{line}: {what}" for path, hits in scan().items() for line, what in hits if (path, what) not in allowed
    ]
    assert bad == []


def test_every_allowance_still_matches_something():
    found = {(path, what) for path, hits in scan().items() for _, what in hits}
    stale = [f"{path}: {what}" for path, what, _ in ALLOWED if (path, what) not in found]
    assert stale == []


def test_the_writer_it_exempts_exists():
    assert (SRC / THE_WRITER).is_file()


def test_the_scan_finds_every_form():
    source = """
import io, os, shutil, tempfile
import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from pathlib import Path
from torch.utils.tensorboard import SummaryWriter
open(p, "w")
open(p, mode="ab")
open(p, m)
io.open(p, "r+")
os.fdopen(fd, "w")
Path(p).open("w")
p.open(mode="x")
os.open(p, os.O_WRONLY | os.O_CREAT)
os.open(p, flags)
Path(p).write_text("x")
p.write_bytes(b"x")
p.touch()
p.rename(q)
p.replace(q)
q.symlink_to(p)
torch.save(obj, p)
torch.save(obj, f=p)
np.save(p, a)
fig.savefig(p, dpi=1)
os.replace(a, b)
os.rename(a, b)
shutil.copy(a, b)
shutil.copy2(a, b)
shutil.copyfile(a, b)
shutil.copytree(a, b)
shutil.move(a, b)
tempfile.mkstemp()
dcp.save(state, checkpoint_id=d)
SummaryWriter(log_dir=d)
"""
    calls = source.strip().splitlines()[6:]  # after the imports: one form a line, each found once
    assert [line for line, _ in findings(source)] == list(range(8, 8 + len(calls))), findings(source)


def test_the_scan_passes_reads_and_in_memory_buffers():
    source = """
import io, os
import torch
from PIL import Image
open(p)
open(p, "rb")
open(p, encoding="utf-8", errors="replace")
Path(p).open()
Image.open(p)
os.open(p, os.O_RDONLY)
buf = io.BytesIO()
torch.save(obj, buf)
fig.savefig(buf)
text.replace("a", "b")
cfg.replace(threads=1)
p.read_text()
from ..rundir import files
files.write_text(p, "x")
files.save_figure(p, fig)
"""
    assert findings(source) == []
