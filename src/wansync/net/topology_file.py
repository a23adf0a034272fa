"""A topology file (TOML, or YAML with PyYAML): the general form of ``--wan``.

    name = "uneven-3-region"                       # optional (default: the file's name)

    [sites.us-east]
    workers = 2                                    # required, >= 1; workers fill sites in file order
    link = { rtt = "0.2ms", bw = "10gbit" }        # inside the site (default: lan, 0.2 ms, 10 Gbit/s)
    ports = "rank"                                 # a port per rank (default), or "worker": one per worker
    speeds = [1.0, 0.5]                            # relative compute speed per worker (or one number)

    [sites.eu-west]
    workers = 1

    [[links]]                                      # one per pair of sites, both directions ...
    sites = ["us-east", "eu-west"]
    rtt = "80ms"
    bw = "1gbit"
    jitter = "1ms"                                 # optional, as mtu
    [[links]]                                      # ... or one direction (then give the other too)
    from = "eu-west"
    to = "us-east"
    rtt = "80ms"
    bw = "300mbit"

    [worker]
    link = "nvlink"                                # between a worker's ranks: site | nvlink | {rtt, bw}

    [compute]
    step = "250ms"                                 # emulated: a full-speed worker's step lasts this long,
                                                   # a worker of speed 0.5 twice as long (padded)

    [[schedules]]                                  # links that change with run time
    links = [["us-east", "eu-west"]]               # "all", [a, b] pairs (both ways), {from, to}, a site's name
    steps = [{ at = "60s", scale = 0.1 }, { at = "120s", bw = "1gbit", rtt = "80ms" }]
    [[schedules]]
    links = "all"
    traffic = { seed = 7, every = "10s", low = 0.5, high = 1.0 }

Every key is checked: unknown keys, a pair of sites with no link, a site with no workers, a speed that
is not positive, steps that go back in time, a file that does not parse (with its line) are one-line
``ConfigError``s naming the file and the place.
"""

from __future__ import annotations

import math
import re
import tomllib
from pathlib import Path
from typing import Any

from wansync.errors import ConfigError, user_text
from wansync.net.link import LAN_LINK, WORKER_LINKS, Link, parse_rate, parse_time
from wansync.net.schedule import LinkSchedule, Step, Traffic
from wansync.net.topology import PORTS, Topology

__all__ = ["SUFFIXES", "load", "parse"]

SUFFIXES = (".toml", ".yaml", ".yml")
MAX_BYTES = 1 << 20
MAX_WORKERS = 4096  # config.MAX_PROCESSES: the processes of one run
_TOP = ("name", "sites", "links", "worker", "compute", "schedules")
_SITE = ("workers", "link", "ports", "speeds")
_LINK = ("rtt", "bw", "jitter", "mtu")
_PAIR = ("sites", "from", "to", *_LINK)
_SCHEDULE = ("links", "steps", "traffic")
_STEP = ("at", "bw", "scale", "rtt")
_TRAFFIC = ("seed", "every", "low", "high")


def load(path: str | Path) -> Topology:
    """The topology in the file at `path` (`.toml`, `.yaml` or `.yml`)."""
    p = Path(path)
    text = user_text(p, "topology file", MAX_BYTES)  # missing, a directory, a FIFO: said first
    if p.suffix.lower() not in SUFFIXES:
        raise ConfigError(f"topology file {p}: expected a .toml, .yaml or .yml file")
    return parse(text, str(p), yaml=p.suffix.lower() != ".toml", name=p.stem)


def parse(text: str, source: str, yaml: bool = False, name: str = "") -> Topology:
    """The topology a file's text describes; `source` names it in errors."""
    raw = _yaml(text, source) if yaml else _toml(text, source)
    return _Reader(source).topology(raw, name)


def _toml(text: str, source: str) -> dict[str, Any]:
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        msg = str(e)
        m = re.search(r"\s*\(at line (\d+), column (\d+)\)", msg)
        where = f"line {m.group(1)}" if m else "?"
        msg = msg[: m.start()] + msg[m.end() :] if m else msg
        raise ConfigError(f"topology file {source} does not parse: {where}: {msg}") from None


def _yaml(text: str, source: str) -> dict[str, Any]:
    try:
        import yaml
    except ImportError:
        raise ConfigError(
            f"topology file {source}: reading YAML needs PyYAML (pip install pyyaml), " f"or write the topology as TOML"
        ) from None
    try:
        data = yaml.load(text, Loader=_unique_keys_loader(yaml, source))
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"line {mark.line + 1}" if mark is not None else "?"
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(f"topology file {source} does not parse: {where}: {problem}") from None
    if not isinstance(data, dict):
        raise ConfigError(
            f"topology file {source}: expected a mapping of keys (name, sites, links, ...) at the "
            f"top, got {type(data).__name__}"
        )
    return data


def _unique_keys_loader(yaml: Any, source: str) -> Any:
    """PyYAML's safe loader, but a key given twice in a mapping is refused (PyYAML keeps the last one
    without a word; TOML refuses it too): two `[sites.a]` would silently become one site. So is a key
    YAML reads as other than a string (`1:`, `yes:`): a site named so would be looked up by its text."""

    class Loader(yaml.SafeLoader):
        pass

    def mapping(loader: Any, node: Any, deep: bool = False) -> Any:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = loader.construct_object(key_node, deep=deep)
            if not isinstance(key, str):  # every key of a topology file names something: a site, a link's field
                raise ConfigError(
                    f"topology file {source}: line {key_node.start_mark.line + 1}: the key {key_node.value} is "
                    f"read by YAML as {_kind(key)}, not a name (digits are numbers, yes/no/on/off booleans): "
                    f'quote it, e.g. "{key_node.value}"'
                )
            try:
                if key in seen:
                    raise ConfigError(
                        f"topology file {source} does not parse: line {key_node.start_mark.line + 1}: "
                        f"key {key!r} given twice"
                    )
                seen.add(key)
            except TypeError:  # an unhashable key: the loader's own error says so
                break
        return loader.construct_mapping(node, deep)

    Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, mapping)
    return Loader


class _Reader:
    """Checks and converts a parsed file, naming `source` and the place in every error."""

    def __init__(self, source: str):
        self.source = source

    def fail(self, where: str, message: str) -> ConfigError:
        return ConfigError(f"topology file {self.source}: {where}: {message}")

    def table(self, value: Any, where: str, allowed: tuple[str, ...]) -> dict[str, Any]:
        if not isinstance(value, dict):
            raise self.fail(where, f"expected a table, got {_kind(value)}")
        unknown = [k for k in value if k not in allowed]
        if unknown:
            raise self.fail(where, f"unknown key {unknown[0]!r} (known: {', '.join(allowed)})")
        return value

    def array(self, value: Any, where: str) -> list[Any]:
        if not isinstance(value, list):
            raise self.fail(where, f"expected an array, got {_kind(value)}")
        return value

    def string(self, value: Any, where: str) -> str:
        if not isinstance(value, str) or not value.strip():
            raise self.fail(where, f"expected a non-empty string, got {_kind(value)}")
        return value.strip()

    def choice(self, value: Any, where: str, choices: tuple[str, ...]) -> str:
        if value not in choices:
            raise self.fail(where, f"expected {' or '.join(repr(c) for c in choices)}, got {value!r}")
        return value

    def number(self, value: Any, where: str) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise self.fail(where, f"expected a finite number, got {value!r}")
        return float(value)

    def convert(self, where: str, fn: Any, *args: Any) -> Any:
        try:
            return fn(*args)
        except ConfigError as e:
            if str(e).startswith(f"topology file {self.source}: "):  # already says where
                raise
            raise self.fail(where, str(e)) from None

    # ---- the parts ---------------------------------------------------------------------------
    def topology(self, raw: dict[str, Any], default_name: str) -> Topology:
        top = self.table(raw, "the top level", _TOP)
        name = self.string(top["name"], "name") if "name" in top else default_name
        if "sites" not in top:
            raise self.fail("the top level", "no [sites]: give at least one site with its workers")
        sites = top["sites"]
        if not isinstance(sites, dict):
            raise self.fail("sites", f"expected a table of sites ([sites.NAME]), got {_kind(sites)}")
        if not sites:
            raise self.fail("[sites]", "no site: give at least one, e.g. [sites.east] workers = 2")
        names = [str(n) for n in sites]
        workers, links, ports, speeds = [], [], [], []
        for n in names:
            site = self.table(sites[n], f"[sites.{n}]", _SITE)
            workers.append(self.workers(site.get("workers"), f"[sites.{n}] workers"))
            links.append(self.link(site["link"], f"[sites.{n}] link") if "link" in site else LAN_LINK)
            ports.append(self.choice(site.get("ports", "rank"), f"[sites.{n}] ports", PORTS))
            speeds.extend(self.speeds(site.get("speeds"), workers[-1], f"[sites.{n}] speeds"))
        index = {n: i for i, n in enumerate(names)}
        pairs = self.pairs(self.array(top.get("links", []), "[[links]]"), index)
        worker_link = self.worker(top["worker"]) if "worker" in top else None
        step_s = self.compute(top["compute"]) if "compute" in top else 0.0
        schedules = tuple(
            self.schedule(s, f"[[schedules]] #{k + 1}", index, len(names))
            for k, s in enumerate(self.array(top.get("schedules", []), "[[schedules]]"))
        )
        return Topology(
            sites=len(names),
            name=name,
            site_names=tuple(names),
            site_workers=tuple(workers),
            site_links=tuple(links),
            intra_link=links[0],
            site_ports=tuple(ports) if "worker" in ports else (),
            pair_links=tuple((a, b, link) for (a, b), link in sorted(pairs.items())),
            speeds=tuple(speeds) if any(s != 1.0 for s in speeds) else (),
            worker_link=worker_link,
            schedules=schedules,
            step_s=step_s,
        )

    def workers(self, value: Any, where: str) -> int:
        if value is None:
            raise self.fail(where, "missing: every site needs its number of workers (>= 1)")
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.fail(where, f"expected a whole number of workers, got {value!r}")
        if value < 1:
            raise self.fail(where, f"a site with no workers ({value}); every site needs at least one")
        if value > MAX_WORKERS:
            raise self.fail(where, f"{value} workers: a run has at most {MAX_WORKERS} processes")
        return value

    def speeds(self, value: Any, workers: int, where: str) -> list[float]:
        if value is None:
            return [1.0] * workers
        values = value if isinstance(value, list) else [value] * workers
        if len(values) != workers:
            raise self.fail(where, f"{len(values)} speeds for {workers} workers")
        out = [self.number(v, f"{where}[{i}]") for i, v in enumerate(values)]
        bad = next((v for v in out if v <= 0), None)
        if bad is not None:
            raise self.fail(where, f"a worker's speed must be positive (relative to the others), got {bad:g}")
        return out

    def link(self, value: Any, where: str) -> Link:
        if isinstance(value, str) and value.strip().lower() == "lan":
            return LAN_LINK
        spec = self.table(value, where, _LINK)
        missing = [k for k in ("rtt", "bw") if k not in spec]
        if missing:
            raise self.fail(where, f"missing {' and '.join(missing)} (e.g. rtt = \"80ms\", bw = \"1gbit\")")
        return self.link_values(spec, where)

    def link_values(self, spec: dict[str, Any], where: str) -> Link:
        def text(key: str) -> str:
            return self.string(spec[key], f"{where} {key}")

        mtu = spec.get("mtu", 1500)
        if isinstance(mtu, bool) or not isinstance(mtu, int):
            raise self.fail(f"{where} mtu", f"expected a whole number of bytes, got {mtu!r}")
        return self.convert(
            where,
            lambda: Link(
                rtt_s=parse_time(text("rtt"), "rtt"),
                bandwidth_bps=parse_rate(text("bw"), "bw"),
                jitter_s=parse_time(text("jitter"), "jitter") if "jitter" in spec else 0.0,
                mtu=mtu,
            ),
        )

    def pairs(self, entries: list[Any], index: dict[str, int]) -> dict[tuple[int, int], Link]:
        pairs: dict[tuple[int, int], Link] = {}
        for k, entry in enumerate(entries):
            where = f"[[links]] #{k + 1}"
            spec = self.table(entry, where, _PAIR)
            if "sites" in spec and ("from" in spec or "to" in spec):
                raise self.fail(where, "give sites = [a, b] (both directions) or from/to (one), not both")
            if "sites" in spec:
                ends = self.array(spec["sites"], f"{where} sites")
                if len(ends) != 2:
                    raise self.fail(f"{where} sites", f"expected two site names, got {len(ends)}")
                a, b = (self.site(e, f"{where} sites", index) for e in ends)
                directions = [(a, b), (b, a)]
            elif "from" in spec and "to" in spec:
                a, b = self.site(spec["from"], f"{where} from", index), self.site(spec["to"], f"{where} to", index)
                directions = [(a, b)]
            else:
                raise self.fail(where, "which sites? give sites = [a, b], or from = a and to = b")
            if a == b:
                raise self.fail(
                    where,
                    f"a link from site {_names(index)[a]!r} to itself: a site's own link is "
                    f"[sites.{_names(index)[a]}] link",
                )
            link = self.link({k_: v for k_, v in spec.items() if k_ in _LINK}, where)
            for d in directions:
                if d in pairs:
                    names = _names(index)
                    raise self.fail(where, f"a second link from {names[d[0]]!r} to {names[d[1]]!r}")
                pairs[d] = link
        names = _names(index)
        for a in range(len(names)):
            for b in range(len(names)):
                if a != b and (a, b) not in pairs:
                    other = "" if (b, a) not in pairs else f" (only {names[b]} to {names[a]} is given)"
                    raise self.fail(
                        "[[links]]",
                        f"no link from {names[a]!r} to {names[b]!r}{other}: every pair of "
                        f'sites needs one (sites = ["{names[a]}", "{names[b]}"])',
                    )
        return pairs

    def site(self, value: Any, where: str, index: dict[str, int]) -> int:
        name = value if isinstance(value, str) else None
        if name is None and not isinstance(value, (dict, list)):
            raise self.fail(where, f"a site is named by a string, got {_kind(value)}: quote it")
        if name not in index:
            raise self.fail(where, f"unknown site {value!r} (sites: {', '.join(index)})")
        return index[name]

    def worker(self, value: Any) -> Link | None:
        spec = self.table(value, "[worker]", ("link",))
        if "link" not in spec:
            raise self.fail("[worker]", "missing link (site, nvlink or {rtt, bw})")
        link = spec["link"]
        if isinstance(link, str):
            if link.strip().lower() not in WORKER_LINKS:
                raise self.fail("[worker] link", f"expected {', '.join(WORKER_LINKS)} or {{rtt, bw}}, got {link!r}")
            return WORKER_LINKS[link.strip().lower()]
        return self.link(link, "[worker] link")

    def compute(self, value: Any) -> float:
        spec = self.table(value, "[compute]", ("step",))
        if "step" not in spec:
            raise self.fail("[compute]", 'missing step (a full-speed worker\'s step time, e.g. step = "250ms")')
        step = self.convert("[compute] step", parse_time, self.string(spec["step"], "[compute] step"), "step")
        if not 0 < step < math.inf:
            raise self.fail("[compute] step", f"must be a positive finite time, got {spec['step']!r}")
        return step

    def schedule(self, value: Any, where: str, index: dict[str, int], sites: int) -> LinkSchedule:
        spec = self.table(value, where, _SCHEDULE)
        pairs = self.schedule_links(spec.get("links"), f"{where} links", index, sites)
        steps = tuple(
            self.step(s, f"{where} steps[{i}]")
            for i, s in enumerate(self.array(spec.get("steps", []), f"{where} steps"))
        )
        traffic = self.traffic(spec["traffic"], f"{where} traffic") if "traffic" in spec else None
        return self.convert(where, LinkSchedule, pairs, steps, traffic)

    def schedule_links(self, value: Any, where: str, index: dict[str, int], sites: int) -> tuple[tuple[int, int], ...]:
        if value is None:
            raise self.fail(where, 'missing: "all", or a list of [a, b] pairs, {from, to} or site names')
        if isinstance(value, str) and value.strip().lower() == "all":
            return ()
        out: list[tuple[int, int]] = []
        for i, item in enumerate(self.array(value, where)):
            here = f"{where}[{i}]"
            if isinstance(item, str):
                s = self.site(item, here, index)
                out.append((s, s))
            elif isinstance(item, list):
                if len(item) != 2:
                    raise self.fail(here, f"expected two site names, got {len(item)}")
                a, b = (self.site(e, here, index) for e in item)
                out += [(a, b), (b, a)]
            else:
                pair = self.table(item, here, ("from", "to"))
                out.append(
                    (self.site(pair.get("from"), f"{here} from", index), self.site(pair.get("to"), f"{here} to", index))
                )
        return tuple(dict.fromkeys(out))

    def step(self, value: Any, where: str) -> Step:
        spec = self.table(value, where, _STEP)
        if "at" not in spec:
            raise self.fail(where, 'missing at (a run time, e.g. at = "60s")')
        at = self.convert(where, parse_time, self.string(spec["at"], f"{where} at"), "at")
        return self.convert(
            where,
            lambda: Step(
                at_s=at,
                bandwidth_bps=parse_rate(self.string(spec["bw"], f"{where} bw"), "bw") if "bw" in spec else None,
                scale=self.number(spec["scale"], f"{where} scale") if "scale" in spec else None,
                rtt_s=parse_time(self.string(spec["rtt"], f"{where} rtt"), "rtt") if "rtt" in spec else None,
            ),
        )

    def traffic(self, value: Any, where: str) -> Traffic:
        spec = self.table(value, where, _TRAFFIC)
        missing = [k for k in ("seed", "every", "low") if k not in spec]
        if missing:
            raise self.fail(where, f"missing {', '.join(missing)} (e.g. {{ seed = 1, every = \"10s\", low = 0.5 }})")
        seed = spec["seed"]
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise self.fail(f"{where} seed", f"expected a whole number >= 0, got {seed!r}")
        return self.convert(
            where,
            lambda: Traffic(
                seed=seed,
                period_s=parse_time(self.string(spec["every"], f"{where} every"), "every"),
                low=self.number(spec["low"], f"{where} low"),
                high=self.number(spec.get("high", 1.0), f"{where} high"),
            ),
        )


def _names(index: dict[str, int]) -> list[str]:
    return sorted(index, key=index.__getitem__)


def _kind(value: Any) -> str:
    return {
        dict: "a table",
        list: "an array",
        str: "a string",
        bool: "a boolean",
        int: "a number",
        float: "a number",
    }.get(type(value), type(value).__name__) + ("" if isinstance(value, (dict, list)) else f" ({value!r})")
