"""``memtrace summary``'s questions of time (``--window``, ``--at``, ``--step``, ``--phase``, ``--file``) and
``--json``: the options, and the tables that show an answer. The answers are computed by
:mod:`lightning_memtrace.analysis.questions` and :mod:`lightning_memtrace.analysis.answers`."""

from __future__ import annotations

import argparse
import json
from typing import Any

from lightning_memtrace.analysis.view import stage_and_step
from lightning_memtrace.cli.errors import CliError
from lightning_memtrace.units import format_bytes


def window_arg(text: str) -> tuple[int, int]:
    """``START_US:END_US`` (integers, microseconds; the end may not be before the start)."""
    start, sep, end = text.partition(":")
    try:
        if not sep:
            raise ValueError
        window = (int(start), int(end))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a window START_US:END_US: {text!r} (e.g. 1000:250000)") from None
    if window[1] < window[0]:
        raise argparse.ArgumentTypeError(f"window {text!r}: the end is before the start")
    return window


def event_arg(text: str) -> int:
    """An event index: an integer from 0."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an event index: {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"event {text!r}: events are numbered from 0")
    return value


def add_question_options(parser: argparse.ArgumentParser) -> None:
    """The options of the questions of time, ``--device`` and ``--json``."""
    group = parser.add_argument_group("questions of time (answered on each device; see the README)")
    group.add_argument("--window", type=window_arg, metavar="START_US:END_US", help="the peak inside a time window")
    group.add_argument("--at", type=event_arg, metavar="N", help="the live state after event N (0-based)")
    group.add_argument("--step", type=int, metavar="N", help="the peak over the events of step N")
    group.add_argument("--phase", metavar="NAME", help="the peak over the events of a phase (forward, backward...)")
    group.add_argument("--file", metavar="PATH", help="live bytes per line of the source file ending with PATH")
    group.add_argument("--device", type=int, metavar="D", help="answer on device D only (default: every device)")
    parser.add_argument("--json", action="store_true", help="print one JSON object (schema in the README)")


def question_of(args: argparse.Namespace) -> Any:
    """The :class:`~lightning_memtrace.analysis.questions.Question` the options ask (checked)."""
    from lightning_memtrace.analysis.questions import Question, QuestionError

    question = Question(args.window, args.at, args.step, args.phase, args.file)
    try:
        question.check()
    except QuestionError as error:
        raise CliError(str(error)) from None
    return question


def json_object(args: argparse.Namespace, sources: list[Any], question: Any) -> dict[str, Any]:
    """``summary --json``'s object for the loaded ``sources``."""
    from lightning_memtrace.analysis.answers import summary_object
    from lightning_memtrace.analysis.questions import QuestionError

    try:
        return summary_object(args.path, sources, question, args.sites, args.device)
    except QuestionError as error:
        raise CliError(str(error)) from None


def summary_payload(args: argparse.Namespace, progress: Any = None) -> dict[str, Any]:
    """``memtrace summary --json``'s object for parsed ``args``: the question checked, the sources loaded (with the
    size limit of ``--max-bytes``), the answer. What the command prints and what the MCP ``summary`` tool returns."""
    from lightning_memtrace.analysis.source import load_sources
    from lightning_memtrace.cli.args import loader_kwargs

    question = question_of(args)
    sources = load_sources(args.path, progress=progress, **loader_kwargs(args))
    return json_object(args, sources, question)


def print_json(args: argparse.Namespace, sources: list[Any], question: Any) -> None:
    """``summary --json``: one object on stdout."""
    print(json.dumps(json_object(args, sources, question), indent=2))


def _bytes(value: int) -> str:
    return f"{format_bytes(value)} ({value:,} B)"


def _when(peak: Any) -> str:
    if peak.index < 0:
        return "before the first event"
    return f"event {peak.index} (t = {peak.time_us:,} us), {stage_and_step(peak.stage, peak.step)}"


def moment_table(answer: Any, name: str) -> Any:
    """The question, its scope and the moment answered."""
    from rich.table import Table

    moment = answer.moment
    rows = [["question", answer.scope], ["events in scope", f"{answer.events:,}"]]
    if answer.at is not None:
        rows += [["live bytes", _bytes(moment.live_bytes)], ["at", _when(moment)]]
        rows += [["peak of the trace", f"{_bytes(answer.peak.live_bytes)} at {_when(answer.peak)}"]]
    else:
        rows += [["peak in scope", _bytes(moment.live_bytes)], ["peak at", _when(moment)]]
    table = Table(title=f"{name} (device {answer.device})", show_header=False)
    table.add_column("figure")
    table.add_column("value", justify="right")
    for row in rows:
        table.add_row(*row)
    return table


def lines_table(answer: Any, path: str) -> Any:
    """``--file``: live bytes per line of the file at the moment answered."""
    from rich.table import Table

    where = f"after event {answer.at}" if answer.at is not None else "at the peak"
    table = Table(title=f"live {where}, by line of {path}")
    for column, justify in (("line", "right"), ("function", "left"), ("bytes", "right"), ("exact", "right")):
        table.add_column(column, justify=justify)  # type: ignore[arg-type]
    table.add_column("count", justify="right")
    for line in answer.lines:
        table.add_row(str(line.line), line.function, format_bytes(line.bytes), f"{line.bytes:,}", f"{line.count:,}")
    total = sum(line.bytes for line in answer.lines)
    table.add_row("total", "", format_bytes(total), f"{total:,}", "")
    return table


def _answer(source: Any, question: Any, device: int | None) -> tuple[Any, Any]:
    from lightning_memtrace.analysis.questions import QuestionError, ask

    main = source.main
    if main is None:
        raise CliError(f"{source.label}: no snapshot to answer the question (only the phases CSV)")
    devices = main.replay.devices
    if device is not None and device not in devices:
        raise CliError(f"--device {device}: the snapshot has devices {', '.join(map(str, sorted(devices)))}")
    dev = devices[device] if device is not None else main.replay.main
    try:
        return dev, ask(dev, question)
    except QuestionError as error:
        raise CliError(str(error)) from None


def print_moment(out: Any, source: Any, question: Any, args: argparse.Namespace) -> None:
    """One run's answer (the device asked for, else the one with the highest peak) as terminal tables; ``--file``
    alone adds its table to the usual summary."""
    from lightning_memtrace.analysis.view import moment_view
    from lightning_memtrace.cli.summary import categories_table, print_source, sites_table

    dev, answer = _answer(source, question, args.device)
    if question.asks_time or args.device is not None:
        view = moment_view(source.main, dev, answer.moment, max_sites=args.sites)
        where = f"after event {answer.at}" if answer.at is not None else "at the peak in scope"
        out.print(moment_table(answer, source.main.path.name))
        out.print(categories_table(view, f"live {where}, by category"))
        out.print(sites_table(view, out.width, f"largest allocation sites {where}"))
    else:
        print_source(out, source, args.sites)
    if answer.lines is not None:
        out.print(lines_table(answer, question.file))
