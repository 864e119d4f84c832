"""``python -m lightning_memtrace.cli``: the ``memtrace`` command."""

import sys

from lightning_memtrace.cli.parser import main

sys.exit(main())
