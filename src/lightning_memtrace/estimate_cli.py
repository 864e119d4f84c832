"""``python -m lightning_memtrace.estimate_cli``: kept working for scripts that run it; the command lives in
:mod:`lightning_memtrace.cli.estimate`."""

from lightning_memtrace.cli.estimate import main

if __name__ == "__main__":
    raise SystemExit(main())
