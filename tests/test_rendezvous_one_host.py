"""`torchrun --rdzv-backend wansync` with two agents on one host (two nodes of one machine): both own
the endpoint's address, so the first to bind its port hosts the rendezvous store and the other joins
it as a client. They once both tried to host: one agent ended in a traceback ("address already in
use"), the other waited for it until killed. Here the store's side of it; two agents training so,
nodes of two ranks each: tests/test_torchrun_nodes.py."""

from __future__ import annotations

import datetime

import pytest
import torch.distributed as dist
from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError

from wansync.runner.rendezvous import rendezvous_store

pytestmark = pytest.mark.timeout(240)

TIMEOUT = datetime.timedelta(seconds=10)


def test_an_agent_that_finds_the_port_taken_joins_the_store_hosted_there():
    host = dist.TCPStore("127.0.0.1", 0, None, True, TIMEOUT)  # the agent that bound first
    joined, _ = rendezvous_store("127.0.0.1", host.port, None, TIMEOUT)
    joined.set("node1", "here")
    assert host.get("node1") == b"here"


def test_an_agent_told_to_host_where_the_port_is_taken_says_so():
    """`--rdzv-conf is_host=1` is obeyed: no quiet fallback to a client of whatever holds the port."""
    host = dist.TCPStore("127.0.0.1", 0, None, True, TIMEOUT)
    with pytest.raises(RendezvousConnectionError, match=f"cannot open the store at 127.0.0.1:{host.port}: .*in use"):
        rendezvous_store("127.0.0.1", host.port, True, TIMEOUT)
