"""The test process runs torch on one thread: two pytest workers (make test: -n 2) share few cores
with the ranks and workers the tests start.

`make test` hands whole files to its two workers (`--dist loadfile`) in collection order
(`--no-loadscope-reorder`: xdist would otherwise order files by their number of tests, which put
the few slow tests of the multi-host and torchrun files last, one worker finishing them alone).
The order here is the longest first, so the last files to run are short ones and both workers
finish together: seconds of work per file (`pytest --durations=0`, 2026-12-06, 2 cores, three
workers; the six files cut later that day scaled by their measured after/before ratio), the files
not named after them in their usual order."""

import torch

torch.set_num_threads(1)

SECONDS = {
    "test_fault_tolerance.py": 114,
    "test_chaos.py": 46,
    "test_sharded_workers.py": 60,
    "test_secure_bed.py": 31,
    "test_hosts.py": 27,
    "test_adapt.py": 47,
    "test_reliability.py": 28,
    "test_hf_trainer.py": 42,
    "test_async_diloco.py": 40,
    "test_muon.py": 24,
    "test_planner_validation.py": 12,
    "test_options_consumed.py": 25,
    "test_run_dirs_rule.py": 21,
    "test_bad_inputs_by_class.py": 20,
    "test_slow_policies.py": 19,
    "test_cli_train.py": 8,
    "test_torchrun_nodes.py": 16,
    "test_stall.py": 15,
    "test_your_model.py": 15,
    "test_robust_mean.py": 14,
    "test_links.py": 14,
    "test_bounded_waits.py": 14,
    "test_replicas.py": 13,
    "test_link_schedules.py": 11,
    "test_bed_pairs.py": 10,
    "test_cocodc_stability.py": 10,
    "test_bad_inputs.py": 10,
    "test_net_backend.py": 10,
    "test_lossy_mean.py": 10,
    "test_bad_input_round3.py": 9,
    "test_profiler.py": 9,
    "test_round_overlap.py": 8,
    "test_ft_own_loop.py": 8,
    "test_checkpoint_durability.py": 8,
    "test_workerproc.py": 8,
    "test_experiments.py": 7,
    "test_sparse_strategies.py": 6,
    "test_vision_models.py": 6,
    "test_lighthouse.py": 6,
    "test_own_loop_run.py": 6,
    "test_signals.py": 5,
    "test_heal_transport.py": 5,
    "test_run_directory.py": 5,
    "test_exchange.py": 5,
    "test_report.py": 5,
    "test_gpu_check.py": 4,
    "test_vision_data.py": 4,
    "test_results.py": 4,
    "test_memory.py": 4,
    "test_planner.py": 4,
    "test_plan_async.py": 10,
    "test_vision_cli.py": 3,
    "test_results_readable.py": 3,
    "test_site_mean.py": 3,
    "test_lm_workload.py": 3,
    "test_wireguard_bed.py": 3,
}


def pytest_collection_modifyitems(session, config, items):
    items.sort(key=lambda item: -SECONDS.get(item.path.name, 0))  # stable: a file's tests keep their order
