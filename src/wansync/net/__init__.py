"""The WAN emulator: a link model and a torch.distributed backend that runs collectives under it.

Typical use, in every worker process::

    from wansync import net
    backend = net.install(net.parse_wan("two-site"), seed=0)
    torch.distributed.init_process_group(backend, ...)

Nothing here knows about training; see :mod:`wansync.net.cost` for the cost model.
"""

from wansync.net.backend import BACKEND_NAME, EmulatedProcessGroup, EmulatedWork, install, installed_topology, is_emulated
from wansync.net.cost import collective_duration, jitter_draw
from wansync.net.link import PRESETS, Link, Topology, parse_wan
from wansync.net.records import CollectiveRecord
from wansync.net.records import records as emulator_records
from wansync.net.records import reset_records as reset_emulator_records
from wansync.net.records import summary as emulator_summary

__all__ = [
    "BACKEND_NAME",
    "CollectiveRecord",
    "EmulatedProcessGroup",
    "EmulatedWork",
    "Link",
    "PRESETS",
    "Topology",
    "collective_duration",
    "emulator_records",
    "emulator_summary",
    "install",
    "installed_topology",
    "is_emulated",
    "jitter_draw",
    "parse_wan",
    "reset_emulator_records",
]
