"""The ``memtrace`` command: ``report``, ``summary``, ``diff``, ``estimate``, ``mcp`` (and subcommands other modules
register).

Every error prints one line ``memtrace: error: ...`` on stderr and exits with status 2; no traceback.

Modules: :mod:`.parser` (the one parser, :func:`main`), :mod:`.errors` (the shared error handling), :mod:`.args`
(shared argument types), :mod:`.console`, and one module per subcommand.
"""

from __future__ import annotations

from lightning_memtrace.cli.errors import CliError
from lightning_memtrace.cli.parser import SUBCOMMAND_MODULES, build_parser, main, register_subcommand

__all__ = ["SUBCOMMAND_MODULES", "CliError", "build_parser", "main", "register_subcommand"]
