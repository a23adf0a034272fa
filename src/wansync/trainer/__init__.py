"""One rank's training loop: the workload, the strategy, the profiler, evaluation and checkpoints,
with the inner optimizer and its learning-rate schedule."""
