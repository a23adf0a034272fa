"""The healing fetch waits for its source: torchft's transport refuses a request that comes before the
source stages the step (a race on a loaded machine); ours asks again until the timeout."""

from __future__ import annotations

import threading
import time
import urllib.error
from datetime import timedelta

import pytest
import torch

pytest.importorskip("torchft")

from torchft.checkpointing.http_transport import HTTPTransport  # noqa: E402

from wansync.ft.transport import HealTransport  # noqa: E402

TIMEOUT = timedelta(seconds=20)
STATE = {"model": {"w": torch.arange(6.0).reshape(2, 3)}, "step": 80}


def serve_later(source, step: int, after_s: float) -> threading.Thread:
    t = threading.Thread(target=lambda: (time.sleep(after_s), source.send_checkpoint([1], step, STATE, TIMEOUT)))
    t.start()
    return t


def test_a_fetch_before_the_source_serves_that_step_is_refused_by_torchfts_transport():
    source, receiver = HTTPTransport(TIMEOUT, num_chunks=0), HTTPTransport(TIMEOUT, num_chunks=0)
    try:
        source.send_checkpoint([1], 75, STATE, TIMEOUT)  # still serving its previous heal
        with pytest.raises(urllib.error.HTTPError, match="invalid checkpoint requested"):
            receiver.recv_checkpoint(0, source.metadata(), 80, TIMEOUT)
    finally:
        source.shutdown(wait=False)
        receiver.shutdown(wait=False)


def test_ours_waits_until_the_source_serves_the_step_and_gets_its_state():
    source, receiver = HealTransport(TIMEOUT, num_chunks=0), HealTransport(TIMEOUT, num_chunks=0)
    try:
        source.send_checkpoint([1], 75, STATE, TIMEOUT)
        later = serve_later(source, 80, after_s=0.5)
        got = receiver.recv_checkpoint(0, source.metadata(), 80, TIMEOUT)
        later.join()
        assert got["step"] == 80 and torch.equal(got["model"]["w"], STATE["model"]["w"])
    finally:
        source.shutdown(wait=False)
        receiver.shutdown(wait=False)


def test_ours_gives_up_at_the_timeout_when_the_source_never_serves_it():
    source, receiver = HealTransport(TIMEOUT, num_chunks=0), HealTransport(TIMEOUT, num_chunks=0)
    try:
        source.send_checkpoint([1], 75, STATE, TIMEOUT)
        t0 = time.monotonic()
        with pytest.raises(urllib.error.HTTPError, match="invalid checkpoint requested"):
            receiver.recv_checkpoint(0, source.metadata(), 80, timedelta(seconds=1))
        assert time.monotonic() - t0 < 15  # bounded by the timeout, not forever
    finally:
        source.shutdown(wait=False)
        receiver.shutdown(wait=False)
