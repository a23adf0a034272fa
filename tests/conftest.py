"""The test process runs torch on one thread: two pytest workers (make test: -n 2) share few cores
with the ranks and workers the tests start.

`make test` hands whole files to its two workers (`--dist loadfile`) in collection order
(`--no-loadscope-reorder`: xdist would otherwise order files by their number of tests, which put
the few slow tests of the multi-host and torchrun files last, one worker finishing them alone).
The order here is the longest first, so the last files to run are short ones and both workers
finish together: seconds of work per file (`pytest --durations=0`, 2026-12-02, 2 cores), the files
not named after them in their usual order."""

import torch

torch.set_num_threads(1)

SECONDS = {
    "test_sharded_workers.py": 105,
    "test_hosts.py": 60,
    "test_chaos.py": 80,
    "test_rejoin.py": 5,
    "test_fault_tolerance.py": 125,
    "test_signals.py": 52,
    "test_net_backend.py": 52,
    "test_bad_inputs_by_class.py": 42,
    "test_reliability.py": 36,
    "test_your_model.py": 31,
    "test_profiler.py": 31,
    "test_experiments.py": 31,
    "test_vision_data.py": 28,
    "test_bad_inputs.py": 28,
    "test_memory.py": 25,
    "test_torchrun_nodes.py": 23,
    "test_net_replicas.py": 23,
    "test_cocodc_stability.py": 23,
    "test_replicas.py": 20,
    "test_workerproc.py": 19,
    "test_bounded_waits.py": 19,
    "test_own_loop_run.py": 16,
    "test_cli_train.py": 16,
    "test_lossy_mean.py": 15,
    "test_report.py": 12,
    "test_planner.py": 12,
    "test_lighthouse.py": 10,
    "test_slow_policies.py": 14,
    "test_link_schedules.py": 7,
    "test_bed_pairs.py": 5,
    "test_site_mean.py": 3,
    "test_hf_trainer.py": 22,
    "test_adapt.py": 30,
    "test_checkpoint_durability.py": 12,
    "test_stall.py": 20,
    "test_rendezvous_one_host.py": 14,
    "test_results_readable.py": 8,
    "test_demo_verdict.py": 6,
    "test_bad_input_round3.py": 18,
}


def pytest_collection_modifyitems(session, config, items):
    items.sort(key=lambda item: -SECONDS.get(item.path.name, 0))  # stable: a file's tests keep their order
