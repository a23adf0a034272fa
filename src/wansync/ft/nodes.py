"""A fault-tolerant run across torchrun's nodes: what the workers' supervisors tell each other in torchrun's store.

Under torchrun each fault-tolerant worker is supervised by the process torchrun started for its first
rank (`runner.launch`, `ft.supervisor`); the workers share no process group (a dead one must not be on
any collective's path), so their supervisors meet in the store torchrun's agents serve
(`TorchrunEnv.store`):

- worker 0's starts the lighthouse, on every interface, and publishes its address (node 0's address,
  the one torchrun gave every rank to meet at); the others read it there;
- a supervisor whose worker finished the run says so (`end`): one whose worker left the run for good
  waits for that before it exits, so its torchrun agent reaches torchrun's exit barrier with the
  others' (one that exits first leaves the others' agents waiting there 300 s), and no worker is
  restarted once the run has ended;
- at the end every supervisor reports what its worker went through (failures, restarts, heals, the
  slots it took part in, read from its own host's logs), and worker 0's adds them up into
  summary.json as the local launcher does (`ft.supervisor.record`).
"""

from __future__ import annotations


import json
import time
from typing import Any

from ..errors import ConfigError
from ..runner.torchrun import TorchrunEnv
from ..trust.listen import address_of

LIGHTHOUSE_KEY = "ft/lighthouse"
ENDED_KEY = "ft/ended"
REPORT_KEY = "ft/report/worker{worker}"
POLL_S = 0.5


class Nodes:
    """A worker's supervisor's view of the others (module docstring); `timeout_s`: how long a read waits."""

    def __init__(self, torchrun: TorchrunEnv, timeout_s: float, ranks_per_worker: int = 1):
        if not torchrun.agent_store:
            raise ConfigError(
                "--fault-tolerant with RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT set by hand needs "
                "torchrun (its agents' store is where the ranks meet): start it with torchrun, or "
                "unset them to launch local workers"
            )
        self.env, self.timeout_s, self.ranks_per_worker = torchrun, timeout_s, ranks_per_worker
        self._store = torchrun.store(timeout_s)

    @property
    def worker(self) -> int:
        """The worker this process supervises (its first rank's process: `runner.run.run_rank`)."""
        return self.env.rank // self.ranks_per_worker

    def lighthouse_url(self, port: int) -> str:
        """The address the others reach rank 0's lighthouse at: node 0's, where torchrun met them."""
        host = self.env.master_addr
        return f"http://{f'[{host}]' if ':' in host else host}:{port}"

    def own_address(self) -> str:
        """The address node 0 was met at, as this host (node 0's) listens on it: one interface, not all."""
        return address_of(self.env.master_addr, "the lighthouse")

    def publish_lighthouse(self, address: str) -> None:
        self._store.set(LIGHTHOUSE_KEY, address)

    def lighthouse(self) -> str:
        """Rank 0's lighthouse (waits up to the timeout for rank 0 to start it)."""
        return self._store.get(LIGHTHOUSE_KEY).decode()

    def end(self) -> None:
        """This rank's worker finished the run."""
        self._store.set(ENDED_KEY, "1")

    def ended(self) -> bool:
        """Has a worker finished the run? (False when the store cannot be asked any more.)"""
        try:
            return self._store.check([ENDED_KEY])
        except RuntimeError:
            return False

    def wait_for_end(self, workers: int) -> bool:
        """Until a worker has finished the run: True. False when none will: every rank reported and
        none finished (all failed), or the store is gone (node 0 with it)."""
        reports = [REPORT_KEY.format(worker=w) for w in range(workers)]
        while True:
            try:
                if self._store.check([ENDED_KEY]):
                    return True
                if self._store.check(reports) and not self._store.check([ENDED_KEY]):
                    return False
            except RuntimeError:
                return False
            time.sleep(POLL_S)

    def report(self, report: dict[str, Any]) -> None:
        self._store.set(REPORT_KEY.format(worker=self.worker), json.dumps(report))

    def reports(self, workers: int, within_s: float) -> dict[int, dict[str, Any] | None]:
        """Every worker's report, waiting up to `within_s` in all; None for a worker that gave none (its
        node is gone)."""
        deadline, out = time.monotonic() + within_s, {}
        for rank in range(workers):
            key = REPORT_KEY.format(worker=rank)
            while rank not in out:
                try:
                    if self._store.check([key]):
                        out[rank] = json.loads(self._store.get(key))
                    elif time.monotonic() >= deadline:
                        out[rank] = None
                    else:
                        time.sleep(POLL_S / 5)
                except RuntimeError:
                    out[rank] = None
        return out
