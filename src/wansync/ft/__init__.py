"""Fault tolerance, one part: quorum exchanges through torchft, healing from a live peer, the
lighthouse, and what the quorum logs say (docs/fault_tolerance.md)."""
