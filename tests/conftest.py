"""The test process runs torch on one thread: two pytest workers (make test: -n 2) share few cores
with the ranks and workers the tests start.

`make test` hands whole files to its two workers (`--dist loadfile`) in collection order
(`--no-loadscope-reorder`: xdist would otherwise order files by their number of tests, which put
the few slow tests of the multi-host and torchrun files last, one worker finishing them alone).
The order here is the longest first, so the last files to run are short ones and both workers
finish together: seconds of work per file (two workers, 2 cores, each file's tests from start to end;
2026-12-06, and 2026-12-07 for the files that use tests/forked_python.py's stand-in), the files not
named after them in their usual order. And a worker that is free takes
a file that waits only when no other worker runs one (`WAITING`, below)."""

import pytest
import torch

torch.set_num_threads(1)

SECONDS = {
    "test_fault_tolerance.py": 84,
    "test_sharded_workers.py": 59,
    "test_adapt.py": 38,
    "test_async_diloco.py": 36,
    "test_chaos.py": 31,
    "test_reliability.py": 30,
    "test_muon.py": 24,
    "test_options_consumed.py": 21,
    "test_hf_trainer.py": 21,
    "test_slow_policies.py": 20,
    "test_secure_bed.py": 17,
    "test_stall.py": 15,
    "test_link_schedules.py": 14,
    "test_bad_inputs.py": 13,
    "test_planner_validation.py": 12,
    "test_bed_pairs.py": 11,
    "test_bounded_waits.py": 11,
    "test_bad_inputs_by_class.py": 10,
    "test_vision_cli.py": 10,
    "test_replicas.py": 9,
    "test_profiler.py": 8,
    "test_your_model.py": 8,
    "test_experiments.py": 8,
    "test_run_dirs_rule.py": 7,
    "test_workerproc.py": 7,
    "test_cocodc_stability.py": 7,
    "test_ft_own_loop.py": 7,
    "test_memory.py": 7,
    "test_hosts.py": 7,
    "test_checkpoint_durability.py": 6,
    "test_round_overlap.py": 6,
    "test_robust_mean.py": 6,
    "test_bad_input_round3.py": 6,
    "test_heal_transport.py": 6,
    "test_lighthouse.py": 6,
    "test_net_backend.py": 6,
    "test_lossy_mean.py": 5,
    "test_accelerate.py": 5,
    "test_sparse_strategies.py": 5,
    "test_plan_strategies.py": 4,
    "test_report.py": 4,
    "test_gpu_check.py": 4,
    "test_own_loop_run.py": 4,
    "test_exchange.py": 4,
    "test_vision_data.py": 4,
    "test_results_readable.py": 4,
    "test_lm_workload.py": 4,
    "test_forked_python.py": 3,
    "test_planner.py": 3,
    "test_signals.py": 3,
    "test_links.py": 3,
    "test_site_mean.py": 3,
    "test_torchrun_nodes.py": 3,
}

# the files whose tests mostly wait (timeouts, a stopped peer, a link's drop, an emulated slow worker): their
# CPU-seconds run alone were under 0.9 of their wall-clock seconds
WAITING = {
    "test_fault_tolerance.py",
    "test_adapt.py",
    "test_async_diloco.py",
    "test_reliability.py",
    "test_slow_policies.py",
    "test_stall.py",
    "test_link_schedules.py",
    "test_bed_pairs.py",
    "test_bounded_waits.py",
    "test_profiler.py",
    "test_ft_own_loop.py",
    "test_round_overlap.py",
    "test_heal_transport.py",
    "test_lighthouse.py",
    "test_wireguard_bed.py",
}


def pytest_collection_modifyitems(session, config, items):
    items.sort(key=lambda item: -SECONDS.get(item.path.name, 0))  # stable: a file's tests keep their order


def pytest_xdist_make_scheduler(config, log):
    """`--dist loadfile`, a file that waits beside files that compute: a worker that takes its next file
    takes the longest left that waits when no other worker runs one, else the longest left that
    computes. Files that wait side by side leave the cores idle (13 % of the suite's core-seconds in
    collection order with two workers); one of them beside the others fills them."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    def waits(scope: str) -> bool:
        return scope.rpartition("/")[2].partition("::")[0] in WAITING

    class Paired(LoadFileScheduling):
        def _assign_work_unit(self, node):
            newest = [  # each other worker's newest file with tests left
                [scope for scope, tests in units.items() if not all(tests.values())][-1:]
                for other, units in self.assigned_work.items()
                if other is not node
            ]
            want = not any(waits(scope) for scopes in newest for scope in scopes)
            pick = next((scope for scope in self.workqueue if waits(scope) == want), None)
            if pick is not None:  # the queue is longest first within each kind
                self.workqueue.move_to_end(pick, last=False)
            super()._assign_work_unit(node)

    return Paired(config, log)


@pytest.fixture(scope="session")
def forked_python(tmp_path_factory):
    """A `python` whose processes are forks of one that imported torch (tests/forked_python.py): for
    torchrun's workers and the bed's hosts, one per pytest worker."""
    import forked_python

    stand_in = forked_python.started(tmp_path_factory.mktemp("forked-python"))
    yield stand_in
    stand_in.close()
