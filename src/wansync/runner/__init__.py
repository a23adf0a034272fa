"""Starting and watching processes: one run (validate, lay out the run directory, launch the
workers locally or adopt torchrun's), grids of runs (compare, sweep, demo), and each worker
process's entry point."""
