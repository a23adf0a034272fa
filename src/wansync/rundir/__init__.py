"""The run directory on disk: its files, who writes them and what they say (the summary's time to
target and divergence flag), checkpoints that resume bit-exactly, the lock a running command holds,
and JSON every reader accepts."""
