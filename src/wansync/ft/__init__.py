"""Fault tolerance, one part (docs/fault_tolerance.md): the quorum the strategies' exchanges average
through (`quorum`, healing over `transport`), the worker's side of a run (`member`), the launcher's
(`supervisor`, starting the `lighthouse`), what the logs say (`quorums`) and what is supported
(`support`)."""
