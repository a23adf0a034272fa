"""The rules a value a user gives must obey, declared beside the value: config keys (`config.py`)
and strategy options (`strategies/options.py`) name them in their field declarations, and each
fails with the same one-line ConfigError the user sees, e.g. `sync_every must be >= 1, got 0`."""

from __future__ import annotations

import math
import os
import re
from typing import Any, Callable

from .errors import check

Rule = Callable[[str, Any], None]  # (key or option name, value): raises a one-line ConfigError when broken


def _finite(value: Any) -> bool:
    return not isinstance(value, float) or math.isfinite(value)


def at_least(low: int) -> Rule:
    def rule(name: str, value: Any) -> None:
        check(_finite(value) and value >= low, f"{name} must be >= {low}, got {value}")

    return rule


def positive(name: str, value: Any) -> None:
    check(_finite(value) and value > 0, f"{name} must be > 0, got {value}")


def positive_or_inf(name: str, value: Any) -> None:
    """> 0, infinity included (a window that never closes); never NaN."""
    check(value == value and value > 0, f"{name} must be > 0 (inf: unbounded), got {value}")


positive_or_inf.allows_inf = True  # type: ignore[attr-defined]  # `config.check_bounds` lets inf through


def in_range(low: float, high: float, *, low_included: bool = True, high_included: bool = False) -> Rule:
    """low <= value < high; `low_included`/`high_included` say which ends belong to the range."""

    def rule(name: str, value: Any) -> None:
        above = low <= value if low_included else low < value
        below = value <= high if high_included else value < high
        check(
            above and below,
            f"{name} must be in {'[' if low_included else '('}{low:g}, {high:g}"
            f"{']' if high_included else ')'}, got {value}",
        )

    return rule


def one_of(choices: tuple[str, ...]) -> Rule:
    def rule(name: str, value: Any) -> None:
        allowed = " or ".join(choices) if len(choices) == 2 else f"one of {', '.join(choices)}"
        check(value in choices, f"{name} must be {allowed}, got {value!r}")

    return rule


def not_blank(what: str) -> Rule:
    """A string with something in it besides white space; `what` says what it must name."""

    def rule(name: str, value: Any) -> None:
        check(bool(str(value).strip()), f"{name} must name {what}, got an empty value")

    return rule


def at_most_cores(name: str, value: Any) -> None:
    """No more than this machine's cores: more threads than cores only slow a worker down (and
    thousands of them crash it)."""
    cores = os.cpu_count() or 1
    check(value <= cores, f"{name} must be at most this machine's {cores} cores, got {value}")


_HOST = re.compile(r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9](?:[A-Za-z0-9.-]{0,251}[A-Za-z0-9])?)$")


def host_port(name: str, value: Any) -> None:
    """HOST:PORT, as a peer dials it: a host name, an IPv4 address or a bracketed IPv6 one, and a
    port in [1, 65535]; empty means unset. (A URL, `http://h:1`, is the usual mistake.)"""
    host, sep, port = str(value).rpartition(":")
    ok = bool(sep) and bool(_HOST.match(host)) and port.isdigit() and len(port) <= 5 and 1 <= int(port) <= 65535
    check(not value or ok, f"{name} must be HOST:PORT (a host name or address, a port in [1, 65535]), got {value!r}")


def port_range(name: str, value: Any) -> None:
    """LOW-HIGH, 1024 <= LOW <= HIGH <= 65535; empty: any port."""
    if value:
        low, sep, high = str(value).partition("-")
        ok = sep and low.isdigit() and high.isdigit() and 1024 <= int(low) <= int(high) <= 65535
        check(bool(ok), f"{name} must be LOW-HIGH with 1024 <= LOW <= HIGH <= 65535, got {value!r}")
