"""A factory of the user's, named on the command line: `pkg.module:name` or `path/to/file.py:name`.

`--model` and `--data` take one (docs/your_model.md). This module turns the string into the callable
and calls it, and every way that can go wrong (the module does not import, the name is not there or
not callable, the factory raises) into one line that names the flag and the string. A module is
looked up on `sys.path` first, then in the working directory (the `wansync` script, unlike
`python -m`, does not put it on the path); a file is imported with its own directory on the path,
as Python runs a script.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import re
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

from ..errors import ConfigError, WansyncError, first_line, path_kind

FACTORY_FORMS = "pkg.module:factory | path/to/file.py:factory"
_DOTTED = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")
# `NAME:...` forms of --data that are not factories (a dataset with a path, a Hugging Face dataset)
NOT_FACTORIES = ("hf", "cifar10", "cifar100", "imagefolder", "fashion-mnist")


def is_factory(text: str) -> bool:
    """Whether `text` names a factory: a dotted module name or a .py file, a colon, a dotted name."""
    where, sep, name = text.strip().rpartition(":")
    if not sep or not _DOTTED.match(name) or where.lower() in NOT_FACTORIES:
        return False
    return bool(_DOTTED.match(where)) or where.endswith(".py")


def load_factory(text: str, flag: str) -> Callable[..., Any]:
    """The callable `text` names; a ConfigError of one line when it cannot be had."""
    where, _, name = text.strip().rpartition(":")
    module = _import_file(Path(where), text, flag) if where.endswith(".py") else _import_module(where, text, flag)
    found: Any = module
    for part in name.split("."):
        if not hasattr(found, part):
            raise ConfigError(f"{flag} {text}: {where} has no attribute {name!r}")
        found = getattr(found, part)
    if not callable(found):
        raise ConfigError(f"{flag} {text}: {name} is not callable (it is of type {type(found).__name__})")
    return found


def call_factory(factory: Callable[..., Any], arg: Any, text: str, flag: str) -> Any:
    """`factory(arg)`, or `factory()` when it takes no argument; what it raises becomes one line."""
    try:
        return factory(arg) if _takes_an_argument(factory) else factory()
    except WansyncError:
        raise
    except (Exception, SystemExit) as e:  # the user's code: any failure (a sys.exit too) is reported, in one line
        raise ConfigError(f"{flag} {text}: the factory raised {type(e).__name__}: {first_line(e)}") from e


def _takes_an_argument(factory: Callable[..., Any]) -> bool:
    try:
        params = inspect.signature(factory).parameters.values()
    except (TypeError, ValueError):  # a builtin without a signature: hand it the argument
        return True
    positional = (
        inspect.Parameter.POSITIONAL_ONLY,
        inspect.Parameter.POSITIONAL_OR_KEYWORD,
        inspect.Parameter.VAR_POSITIONAL,
    )
    return any(p.kind in positional for p in params)


def _import_module(where: str, text: str, flag: str) -> ModuleType:
    module = _try_import(where, text, flag)
    if module is None and os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())  # the working directory, as `python -m` would have it
        importlib.invalidate_caches()
        module = _try_import(where, text, flag)
    if module is None:
        raise ConfigError(
            f"{flag} {text}: cannot import {where}: no such module on the Python path or in the "
            f"working directory {os.getcwd()}"
        )
    return module


def _try_import(where: str, text: str, flag: str) -> ModuleType | None:
    """The module, or None when it (or a package above it) is not found."""
    try:
        return importlib.import_module(where)
    except ModuleNotFoundError as e:
        if e.name is not None and (where == e.name or where.startswith(e.name + ".")):
            return None
        raise _failed(e, where, text, flag) from None  # a module the user's module imports is missing
    except (Exception, SystemExit) as e:  # noqa: BLE001 - the user's module ran and failed (or called sys.exit)
        raise _failed(e, where, text, flag) from None


def _failed(e: BaseException, where: str, text: str, flag: str) -> ConfigError:
    return ConfigError(f"{flag} {text}: importing {where} failed: {type(e).__name__}: {first_line(e)}")


def _import_file(path: Path, text: str, flag: str) -> ModuleType:
    path = path.expanduser().resolve()
    if not path.exists():
        raise ConfigError(f"{flag} {text}: no such file {path}")
    if not path.is_file():  # a directory named x.py, a FIFO (importing it would block)
        raise ConfigError(f"{flag} {text}: {path} is {path_kind(path)}, not a Python file")
    name = f"_wansync_user_{re.sub(r'[^0-9A-Za-z_]', '_', str(path))}"  # one module per file
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ConfigError(f"{flag} {text}: {path} cannot be imported as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # before it runs: a dataclass in it looks itself up there
    if str(path.parent) not in sys.path:
        sys.path.append(str(path.parent))  # its sibling modules import, as when it runs as a script
    try:
        spec.loader.exec_module(module)
    except (Exception, SystemExit) as e:  # noqa: BLE001 - the user's file ran and failed (a sys.exit: exit 0, untrained)
        del sys.modules[name]
        raise _failed(e, path.name, text, flag) from None
    return module
