"""``memtrace mcp``: an MCP server (stdio) over the same answers as ``summary --json``, ``diff --json`` and
``estimate --json``.

Tools:

* ``summary`` (``path``; optional ``window`` ``"START_US:END_US"``, ``at``, ``step``, ``phase``, ``file``, ``device``,
  ``sites``, ``max_bytes``, ``rules``): exactly ``memtrace summary PATH --json ...``'s object;
* ``diff`` (``base``, ``other``; optional ``sites``, ``max_bytes``, ``rules``): ``memtrace diff BASE OTHER --json``;
* ``estimate`` (``config``, ``seq_len``; the options of ``memtrace estimate``): ``memtrace estimate ... --json``.

Each tool builds the command's arguments, parses them with the command's own parser and calls the function the command
prints (:func:`~lightning_memtrace.cli.moments.summary_payload`, :func:`~lightning_memtrace.cli.diff.diff_payload`,
:func:`~lightning_memtrace.cli.estimate.estimate_payload`): same checks, same size limit, same restricted unpickler
(a hostile pickle is refused, nothing in it runs). The result is the JSON text the command prints (and the same object
as structured content); an error is a tool error whose text is the command's one line ``memtrace: error: ...``.

Needs the ``mcp`` package (``pip install 'lightning_memtrace[mcp]'``); without it ``memtrace mcp`` fails in one line.
"""

# no "from __future__ import annotations": the SDK reads the tools' annotations, CallToolResult a local name

import argparse
import gc
import json
import threading
from collections.abc import Callable, Sequence
from typing import Any

from lightning_memtrace.cli.errors import READ_ERRORS, CliError, error_text, run_guarded

#: The requirement the server needs (the ``mcp`` extra).
MCP_REQUIREMENT = "mcp>=2.0"
MISSING_MCP = "the MCP server needs the mcp package: pip install 'lightning_memtrace[mcp]'"
SERVER_NAME = "memtrace"

# One tool call at a time: a call may hold a large snapshot in memory, and the garbage collector is paused during it.
_LOCK = threading.Lock()


def add_subcommand(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "mcp",
        help="serve summary, diff and estimate as MCP tools over stdio",
        description="An MCP server on stdin/stdout whose tools summary, diff and estimate return exactly the JSON of "
        "'memtrace summary --json', 'memtrace diff --json' and 'memtrace estimate --json'. Needs the mcp extra.",
    )
    parser.set_defaults(func=run)


def mcp_available() -> bool:
    from lightning_utilities.core.imports import RequirementCache

    return bool(RequirementCache(MCP_REQUIREMENT))


def run(args: argparse.Namespace) -> int:
    if not mcp_available():
        raise CliError(MISSING_MCP)
    server = build_server()
    # the command runs with the collector paused (cli.parser.main); a long-lived server pauses it per call instead
    was_enabled = gc.isenabled()
    gc.enable()
    try:
        server.run("stdio")
    finally:
        if not was_enabled:
            gc.disable()
    return 0


# --- the answers, as the commands compute them -------------------------------------------------------------------


def _parse(argv: Sequence[str]) -> argparse.Namespace:
    """``memtrace ARGV``'s arguments, parsed by the command's own parser; a bad value raises :class:`CliError` with
    the command's text."""
    from lightning_memtrace.cli.errors import RaisingParser
    from lightning_memtrace.cli.parser import build_parser

    return build_parser(RaisingParser).parse_args(list(argv))


def answer(argv: Sequence[str]) -> tuple[dict[str, Any] | None, str | None]:
    """``memtrace ARGV --json``'s object, or None and the command's one-line error (``memtrace: error: ...``).

    ``argv`` is one of ``summary ...``, ``diff ...``, ``estimate ...`` without ``--json``."""
    from lightning_memtrace.analysis.loader import SnapshotError
    from lightning_memtrace.collector import gc_paused

    result: dict[str, Any] = {}
    errors: list[str] = []

    def on_error(message: str) -> int:
        errors.append(error_text(message))
        return 2

    def interrupted() -> int:
        errors.append(error_text("interrupted"))
        return 130

    with _LOCK, gc_paused():
        try:
            args = _parse([argv[0], "--json", *argv[1:]])
        except CliError as error:
            return None, error_text(str(error))
        from lightning_memtrace.cli.diff import diff_payload
        from lightning_memtrace.cli.estimate import PLAIN_ERRORS, estimate_payload
        from lightning_memtrace.cli.moments import summary_payload

        # each command's function and the error handling of its command line (cli.parser.main, cli.estimate)
        commands: dict[str, tuple[Callable[[argparse.Namespace], dict[str, Any]], tuple[type[BaseException], ...], Any]]
        commands = {
            "summary": (summary_payload, (SnapshotError, CliError), READ_ERRORS),
            "diff": (diff_payload, (SnapshotError, CliError), READ_ERRORS),
            "estimate": (estimate_payload, PLAIN_ERRORS, None),
        }
        payload, plain, fixed = commands[args.command]

        def handler(parsed: argparse.Namespace) -> int:
            result["object"] = payload(parsed)
            return 0

        run_guarded(handler, args, on_error, interrupted, plain, fixed)
    if errors:
        return None, errors[0]
    return result["object"], None


def _options(pairs: Sequence[tuple[str, Any]]) -> list[str]:
    """``--name=value`` for the values given (a value starting with "-" stays a value); ``True`` gives the flag
    alone, ``False``/``None`` nothing."""
    argv: list[str] = []
    for flag, value in pairs:
        if value is None or value is False:
            continue
        argv.append(flag if value is True else f"{flag}={value}")
    return argv


def _rules(rules: Sequence[str] | None) -> list[str]:
    return [f"--rule={rule}" for rule in rules or ()]


def summary_argv(
    path: str,
    window: str | None = None,
    at: int | None = None,
    step: int | None = None,
    phase: str | None = None,
    file: str | None = None,
    device: int | None = None,
    sites: int | None = None,
    max_bytes: str | int | None = None,
    rules: Sequence[str] | None = None,
) -> list[str]:
    """The ``memtrace`` arguments of a ``summary`` tool call (without ``--json``)."""
    options = [("--window", window), ("--at", at), ("--step", step), ("--phase", phase), ("--file", file)]
    options += [("--device", device), ("--sites", sites), ("--max-bytes", max_bytes)]
    # "--" before the path: a path starting with "-" stays a path
    return ["summary", *_options(options), *_rules(rules), "--", path]


def diff_argv(
    base: str,
    other: str,
    sites: int | None = None,
    max_bytes: str | int | None = None,
    rules: Sequence[str] | None = None,
) -> list[str]:
    """The ``memtrace`` arguments of a ``diff`` tool call (without ``--json``)."""
    return ["diff", *_options([("--sites", sites), ("--max-bytes", max_bytes)]), *_rules(rules), "--", base, other]


def estimate_argv(
    config: str,
    seq_len: int | None = None,
    batch_size: int | None = None,
    precision: str | None = None,
    device: str | None = None,
    optimizer: str | None = None,
    gradient_checkpointing: bool = False,
    accumulate_grad_batches: int | None = None,
    attn_implementation: str | None = None,
    fsdp: int | None = None,
    device_memory: str | int | None = None,
    find_max_batch: bool = False,
    max_batch_size: int | None = None,
    ddp: bool = False,
    task: str | None = None,
    target_len: int | None = None,
    image_size: int | None = None,
    quantize: str | None = None,
    lora: bool = False,
    lora_rank: int | None = None,
    lora_dropout: float | None = None,
    lora_targets: str | None = None,
) -> list[str]:
    """The ``memtrace`` arguments of an ``estimate`` tool call (without ``--json``)."""
    options = [
        ("--config", config),
        ("--seq-len", seq_len),
        ("--batch-size", batch_size),
        ("--precision", precision),
        ("--device", device),
        ("--optimizer", optimizer),
        ("--gradient-checkpointing", bool(gradient_checkpointing)),
        ("--accumulate-grad-batches", accumulate_grad_batches),
        ("--attn-implementation", attn_implementation),
        ("--fsdp", fsdp),
        ("--device-memory", device_memory),
        ("--find-max-batch", bool(find_max_batch)),
        ("--max-batch-size", max_batch_size),
        ("--ddp", bool(ddp)),
        ("--task", task),
        ("--target-len", target_len),
        ("--image-size", image_size),
        ("--quantize", quantize),
        ("--lora", bool(lora)),
        ("--lora-rank", lora_rank),
        ("--lora-dropout", lora_dropout),
        ("--lora-targets", lora_targets),
    ]
    return ["estimate", *_options(options)]


# --- the server ---------------------------------------------------------------------------------------------------


def _result(argv: Sequence[str]) -> Any:
    """The tool's ``CallToolResult``: the command's JSON text (and object), or a tool error with its one line."""
    from mcp.types import CallToolResult, TextContent

    obj, error = answer(argv)
    if error is not None:
        return CallToolResult(content=[TextContent(type="text", text=error)], is_error=True)
    return CallToolResult(content=[TextContent(type="text", text=json.dumps(obj, indent=2))], structured_content=obj)


def build_server() -> Any:
    """The ``MCPServer`` with the tools ``summary``, ``diff`` and ``estimate``."""
    from mcp.server.mcpserver import MCPServer
    from mcp.types import CallToolResult, ToolAnnotations

    import lightning_memtrace

    server = MCPServer(
        SERVER_NAME,
        version=str(getattr(lightning_memtrace, "__version__", "")),
        instructions="Answers about PyTorch memory snapshots (summary, diff) and memory estimates of fine-tuning "
        "runs (estimate); each tool returns exactly the JSON of the memtrace command of the same name with --json "
        "(schema in the lightning_memtrace README, 'Machine-readable answers'). Snapshots are read with a "
        "restricted unpickler: a pickle that would run code is refused.",
    )
    read_only = ToolAnnotations(read_only_hint=True, destructive_hint=False, open_world_hint=False)

    @server.tool(name="summary", annotations=read_only)
    def summary(
        path: str,
        window: str | None = None,
        at: int | None = None,
        rules: list[str] | None = None,
        step: int | None = None,
        phase: str | None = None,
        file: str | None = None,
        device: int | None = None,
        sites: int | None = None,
        max_bytes: str | None = None,
    ) -> CallToolResult:
        """`memtrace summary PATH --json`: the peak, categories, allocation sites and findings of a snapshot or a
        MemTrace log folder, and the post-mortem of each out-of-memory error (why it died, what to change). window:
        "START_US:END_US", the peak inside a time window; at: the live state after event N (0-based); step / phase:
        the peak over a step's / a phase's events; file: live bytes per line of the source file ending with this path;
        device: answer on this device only; sites: how many allocation sites (default 10); max_bytes: refuse larger
        files (default 8GiB); rules: category rules NAME=REGEX (--rule)."""
        argv = summary_argv(path, window, at, step, phase, file, device, sites, max_bytes, rules)
        return _result(argv)

    @server.tool(name="diff", annotations=read_only)
    def diff(
        base: str,
        other: str,
        sites: int | None = None,
        max_bytes: str | None = None,
        rules: list[str] | None = None,
    ) -> CallToolResult:
        """`memtrace diff BASE OTHER --json`: two snapshots or runs at their peaks, OTHER - BASE, by figure, category
        and allocation site. sites: how many sites (default 10); max_bytes: refuse larger files (default 8GiB);
        rules: category rules NAME=REGEX (--rule)."""
        return _result(diff_argv(base, other, sites, max_bytes, rules))

    @server.tool(name="estimate", annotations=read_only)
    def estimate(
        config: str,
        seq_len: int | None = None,
        batch_size: int | None = None,
        precision: str | None = None,
        device: str | None = None,
        optimizer: str | None = None,
        gradient_checkpointing: bool = False,
        accumulate_grad_batches: int | None = None,
        attn_implementation: str | None = None,
        fsdp: int | None = None,
        device_memory: str | None = None,
        find_max_batch: bool = False,
        max_batch_size: int | None = None,
        ddp: bool = False,
        task: str | None = None,
        target_len: int | None = None,
        image_size: int | None = None,
        quantize: str | None = None,
        lora: bool = False,
        lora_rank: int | None = None,
        lora_dropout: float | None = None,
        lora_targets: str | None = None,
    ) -> CallToolResult:
        """`memtrace estimate ... --json`: the memory of training a Hugging Face model, per phase and category,
        from its config (run on fake tensors: no GPU, no weights). config: a config.json or a folder holding one;
        precision: 32-true, 16-mixed, bf16-mixed, bf16-true or 16-true; device: cuda or cpu; optimizer: adamw, adam,
        sgd or sgd-plain; fsdp: shard over N ranks; ddp: data-parallel with DDP's default gradient buckets (a second
        copy of the gradients on every rank); device_memory: e.g. "80GiB" (then "fits" is in the answer);
        find_max_batch: search the largest micro-batch that fits in device_memory (up to max_batch_size); task:
        causal-lm (default), masked-lm, seq2seq-lm (target_len: its label tokens), sequence-classification,
        token-classification, question-answering, image-classification (image_size: an image's side; no seq_len) or
        speech-seq2seq (Whisper: audio features from its config, target_len label tokens; no seq_len); quantize:
        nf4 (QLoRA's 4-bit base) or int8, as bitsandbytes loads it; lora: LoRA adapters, the base frozen (lora_rank,
        default 16; lora_dropout, default 0; lora_targets: attention (default), all-linear or layer names)."""
        argv = estimate_argv(
            config,
            seq_len,
            batch_size,
            precision,
            device,
            optimizer,
            gradient_checkpointing,
            accumulate_grad_batches,
            attn_implementation,
            fsdp,
            device_memory,
            find_max_batch,
            max_batch_size,
            ddp,
            task,
            target_len,
            image_size,
            quantize,
            lora,
            lora_rank,
            lora_dropout,
            lora_targets,
        )
        return _result(argv)

    return server
