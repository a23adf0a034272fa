"""Nothing from the network is unpickled, anywhere (issue 58): a scan of src/ with `ast` for every way
Python or torch turns bytes into code, each exception named with its reason.

What crosses between hosts goes as tensors plus JSON (`trust.sealed`, JSON through the stores); what
is read from the user's own disk in a format of its own (CIFAR's pickle batches) is allowed here, by
file and by reason. An allowance that no longer matches anything fails too, so the list cannot rot.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src"

# (file under src/, what it does, why that is not something a peer sent)
ALLOWED = (
    (
        "wansync/workloads/vision/datasets.py",
        "pickle.Unpickler",
        "CIFAR's own format (python pickle batches) from the user's disk, by an Unpickler whose find_class "
        "admits only numpy's array reconstruction (CIFAR_GLOBALS): no other global is ever built",
    ),
    (
        "wansync/net/topology_file.py",
        "yaml.load",
        "its Loader is a yaml.SafeLoader subclass (_unique_keys_loader) that only refuses a key given twice",
    ),
)

UNPICKLERS = {
    "pickle.load",
    "pickle.loads",
    "pickle.Unpickler",
    "_pickle.load",
    "_pickle.loads",
    "_pickle.Unpickler",
    "marshal.load",
    "marshal.loads",
    "joblib.load",
    "shelve.open",
    "pandas.read_pickle",
    "yaml.unsafe_load",
    "yaml.unsafe_load_all",
    "yaml.full_load",
    "yaml.full_load_all",
}
OBJECT_COLLECTIVES = {  # torch.distributed's *_object collectives pickle what a peer sends
    "broadcast_object_list",
    "all_gather_object",
    "gather_object",
    "scatter_object_list",
    "recv_object_list",
    "send_object_list",
}
PICKLING_MODULES = {"dill", "cloudpickle"}
SAFE_YAML_LOADERS = {"yaml.SafeLoader", "yaml.CSafeLoader", "yaml.BaseLoader", "yaml.CBaseLoader"}


def aliases(tree: ast.AST) -> dict[str, str]:
    """Each name an import binds (anywhere in the module, function-local ones too) -> what it names."""
    out: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                out[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for a in node.names:
                out[a.asname or a.name] = f"{node.module}.{a.name}"
    return out


def dotted(node: ast.AST, names: dict[str, str]) -> str:
    """`a.b.c` of a call's function, its first name resolved through the imports ("" if not a name)."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return ""
    return ".".join([names.get(node.id, node.id), *reversed(parts)])


def keyword(call: ast.Call, name: str) -> ast.expr | None:
    return next((k.value for k in call.keywords if k.arg == name), None)


def is_constant(node: ast.expr | None, value: object) -> bool:
    return isinstance(node, ast.Constant) and node.value is value


def findings(source: str) -> list[tuple[int, str]]:
    """(line, what) of every way `source` may unpickle or run what it reads."""
    tree = ast.parse(source)
    names = aliases(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            modules = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            found += [(node.lineno, m.split(".")[0]) for m in modules if m.split(".")[0] in PICKLING_MODULES]
        if isinstance(node, ast.ClassDef):  # an Unpickler of one's own still unpickles: listed by its base
            found += [(node.lineno, b) for b in (dotted(base, names) for base in node.bases) if b in UNPICKLERS]
        if not isinstance(node, ast.Call):
            continue
        name = dotted(node.func, names)
        last = name.rpartition(".")[2] if name else getattr(node.func, "attr", "")
        if is_constant(keyword(node, "weights_only"), False):
            found.append((node.lineno, "weights_only=False"))
        elif name == "torch.load" and not is_constant(keyword(node, "weights_only"), True):
            found.append((node.lineno, "torch.load without weights_only=True"))
        if name in UNPICKLERS:
            found.append((node.lineno, name))
        if last in OBJECT_COLLECTIVES:
            found.append((node.lineno, f"{last} (pickles what peers send)"))
        if last == "read_pickle":
            found.append((node.lineno, "read_pickle"))
        if is_constant(keyword(node, "allow_pickle"), True):
            found.append((node.lineno, "allow_pickle=True"))
        if name in ("yaml.load", "yaml.load_all"):
            loader = keyword(node, "Loader") or (node.args[1] if len(node.args) > 1 else None)
            if loader is None or dotted(loader, names) not in SAFE_YAML_LOADERS:
                found.append((node.lineno, name))
    return sorted(found)


def scan() -> dict[str, list[tuple[int, str]]]:
    out = {}
    for path in sorted((SRC / "wansync").rglob("*.py")):
        hits = findings(path.read_text())
        if hits:
            out[path.relative_to(SRC).as_posix()] = hits
    return out


def test_nothing_in_src_unpickles_but_what_is_allowed_by_reason():
    allowed = {(path, what) for path, what, _ in ALLOWED}
    bad = [
        f"{path}:{line}: {what}" for path, hits in scan().items() for line, what in hits if (path, what) not in allowed
    ]
    assert bad == []


def test_every_allowance_still_matches_something():
    found = {(path, what) for path, hits in scan().items() for _, what in hits}
    stale = [f"{path}: {what}" for path, what, _ in ALLOWED if (path, what) not in found]
    assert stale == []


def test_the_scan_finds_every_form():
    source = """
import pickle, marshal, yaml, dill
import torch.distributed as dist
from pickle import loads as l
from torch import load
import cloudpickle
import numpy as np
import yaml as y
pickle.load(f)
l(b)
marshal.loads(b)
torch.load(f)
load(f, weights_only=False)
something(weights_only=False)
dist.broadcast_object_list(xs)
group.all_gather_object(out, x)
torch.distributed.gather_object(x)
y.load(t)
yaml.load(t, Loader=yaml.Loader)
yaml.unsafe_load(t)
np.load(p, allow_pickle=True)
class Mine(pickle.Unpickler): pass
"""
    whats = [what for _, what in findings(source)]
    assert whats == [
        "dill",
        "cloudpickle",
        "pickle.load",
        "pickle.loads",
        "marshal.loads",
        "torch.load without weights_only=True",
        "weights_only=False",
        "weights_only=False",
        "broadcast_object_list (pickles what peers send)",
        "all_gather_object (pickles what peers send)",
        "gather_object (pickles what peers send)",
        "yaml.load",
        "yaml.load",
        "yaml.unsafe_load",
        "allow_pickle=True",
        "pickle.Unpickler",
    ]


def test_the_safe_forms_pass():
    source = """
import torch, yaml, json
torch.load(f, map_location="cpu", weights_only=True)
yaml.load(t, Loader=yaml.SafeLoader)
yaml.safe_load(t)
json.loads(s)
"""
    assert findings(source) == []
