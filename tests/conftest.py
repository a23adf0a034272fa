"""The test process runs torch on one thread. Tests run many small ranks and workers side by side
on few cores, and the CLI tests host the launcher in this process (cli_harness): a launcher may
fork its workers only while torch has not started its OpenMP team (workerproc.can_fork)."""
import torch

torch.set_num_threads(1)
