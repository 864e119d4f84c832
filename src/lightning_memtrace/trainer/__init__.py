"""What the :class:`~lightning_memtrace.MemTrace` callback needs of the Lightning Trainer: when and how to log, the
maxima over ranks, and the extras around a fit (estimate, report)."""
