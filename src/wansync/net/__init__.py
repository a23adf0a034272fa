"""The WAN emulator: a link model and a torch.distributed backend that runs collectives under it.

Typical use, in every worker process::

    from wansync import net
    emulator = net.Emulator(net.parse_wan("two-site"), seed=0)
    torch.distributed.init_process_group(net.install(), pg_options=emulator, ...)
    ...
    emulator.records()          # one CollectiveRecord per collective
    # a group that runs as one of 2 parallel copies sharing the sites' uplinks:
    torch.distributed.new_group([0, 2], pg_options=net.shared_uplink(2))

Nothing here knows about training; see :mod:`wansync.net.cost` for the cost model.
"""

from wansync.net.backend import (
    BACKEND_NAME,
    EmulatedProcessGroup,
    SharedUplink,
    emulator_of,
    install,
    machine_identity,
    shared_uplink,
)
from wansync.net.cost import collective_duration, exchange_seconds, in_worker_seconds, jitter_draw
from wansync.net.emulator import Emulator
from wansync.net.link import NVLINK, Link
from wansync.net.topology import Topology
from wansync.net.wan import PRESETS, parse_wan
from wansync.net.records import CollectiveRecord
from wansync.net.work import EmulatedWork

__all__ = [
    "BACKEND_NAME",
    "CollectiveRecord",
    "EmulatedProcessGroup",
    "EmulatedWork",
    "Emulator",
    "Link",
    "NVLINK",
    "PRESETS",
    "SharedUplink",
    "Topology",
    "collective_duration",
    "emulator_of",
    "exchange_seconds",
    "in_worker_seconds",
    "install",
    "jitter_draw",
    "machine_identity",
    "parse_wan",
    "shared_uplink",
]
