"""Reading what MemTrace and PyTorch wrote: snapshots, stacks, replay, findings, the per-phase table (no torch)."""
