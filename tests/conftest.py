"""The test process runs torch on one thread: two pytest workers (make test: -n 2) share few cores
with the ranks and workers the tests start."""
import torch

torch.set_num_threads(1)
