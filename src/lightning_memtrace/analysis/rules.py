"""User rules for categories: ``NAME=REGEX`` pairs that name the memory a piece of code makes.

Semantics (the README states them the same way):

* Each frame of an allocation's stack is matched as the text ``"<file>:<line> <function>"`` (the file with ``/``
  separators, as :mod:`~lightning_memtrace.analysis.frames` reads it), with :func:`re.search` (so a rule matches
  anywhere in that text: ``attention`` matches ``/m/attention.py:12 forward`` and ``x.py:3 attention_scores``).
* Frames are tried innermost first; at each frame the rules in the order given; the first (frame, rule) that matches
  names the allocation's category. So the rule of the innermost matching frame wins, and among rules matching that
  same frame, the first given.
* Rules come before inferred categories: they apply to every allocation whose category is not recorded (all of them
  in a torch snapshot; in a MemTrace snapshot those it left uncategorised), the blocks alive at dump time with an
  allocation stack included. Categories MemTrace recorded (parameters, gradients, optimizer state, inputs, activations
  it saw saved for backward) stay.
* A rule's name is a category like any other; a rule named like a built-in category (``activations``) puts its
  allocations in that category.

Rules are evaluated once per distinct stack (and each regex once per distinct frame), so a million-event snapshot
costs what its distinct frames cost.

No torch import here, and no pandas at import time: the capture side validates ``RecorderConfig(category_rules=...)``
with :func:`compile_rules` during training.
"""

from __future__ import annotations

import dataclasses
import itertools
import re
from collections.abc import Iterable, Mapping
from typing import Any, Union

import numpy as np

from lightning_memtrace.analysis.frames import normalize_path
from lightning_memtrace.types import CATEGORIES

#: What a set of rules can be given as: ``{name: pattern}``, ``[(name, pattern), ...]`` or ``["NAME=REGEX", ...]``.
RulesLike = Union[Mapping[str, str], Iterable[Any], "CategoryRules", None]
#: The longest rule name accepted.
MAX_NAME = 64


class RuleError(ValueError):
    """A rule that cannot be used (a bad regular expression, an empty name): one line naming it."""


def parse_rule(text: str) -> tuple[str, str]:
    """``"NAME=REGEX"`` → ``(name, regex)`` (split at the first ``=``; the regex may hold more).

    Raises:
        RuleError: No ``=``, or an empty name or regex.
    """
    name, sep, pattern = str(text).partition("=")
    if not sep:
        raise RuleError(f"rule {text!r}: expected NAME=REGEX (e.g. attention=attn|attention)")
    return name.strip(), pattern


_NAME_RE = re.compile(r"[\w.\-]+")


def _check_name(name: Any) -> str:
    """A rule's name, stripped: letters, digits, ``_``, ``.``, ``-`` (it shows as a category in tables and JSON)."""
    if not isinstance(name, str) or not name.strip():
        raise RuleError(f"rule name {name!r}: a category needs a non-empty name")
    name = name.strip()
    if len(name) > MAX_NAME or not _NAME_RE.fullmatch(name):
        raise RuleError(f"rule name {name!r}: use at most {MAX_NAME} letters, digits, '_', '.' or '-'")
    return name


def compile_rule(name: Any, pattern: Any) -> tuple[str, re.Pattern[str]]:
    """One checked rule: its name (stripped) and its compiled regex.

    Raises:
        RuleError: The name is empty, or the pattern is not text or not a valid regular expression.
    """
    name = _check_name(name)
    if not isinstance(pattern, str) or not pattern:
        raise RuleError(f"rule {name!r}: the regular expression must be non-empty text, not {pattern!r}")
    try:
        return name, re.compile(pattern)
    except (re.error, RecursionError, OverflowError) as error:
        raise RuleError(f"rule {name!r}: bad regular expression {pattern!r}: {error}") from None


def _pairs(rules: RulesLike) -> list[tuple[Any, Any]]:
    if rules is None:
        return []
    if isinstance(rules, CategoryRules):
        return [(name, pattern.pattern) for name, pattern in rules.rules]
    if isinstance(rules, Mapping):
        return list(rules.items())
    if isinstance(rules, str):
        return [parse_rule(rules)]
    pairs: list[tuple[Any, Any]] = []
    for item in rules:
        if isinstance(item, str):
            pairs.append(parse_rule(item))
        elif isinstance(item, (tuple, list)) and len(item) == 2:
            pairs.append((item[0], item[1]))
        else:
            raise RuleError(f"rule {item!r}: expected NAME=REGEX or a (name, regex) pair")
    return pairs


def compile_rules(rules: RulesLike) -> tuple[tuple[str, re.Pattern[str]], ...]:
    """Every rule of ``rules``, checked and compiled, in order; a name given twice keeps its last regex at the place
    of its first.

    Raises:
        RuleError: A rule that cannot be used (the message names it).
    """
    compiled: dict[str, re.Pattern[str]] = {}
    for name, pattern in _pairs(rules):
        key, regex = compile_rule(name, pattern)
        compiled[key] = regex
    return tuple(compiled.items())


def frame_text(frame: Any) -> str | None:
    """The text rules are matched against: ``"<file>:<line> <function>"`` (None for what is not a frame dict)."""
    if not isinstance(frame, dict):
        return None
    filename = frame.get("filename", "")
    name = frame.get("name", "")
    line = frame.get("line", 0)
    filename = normalize_path(filename) if isinstance(filename, str) else ""
    name = name if isinstance(name, str) else ""
    return f"{filename}:{_line_number(line)} {name}"


def _line_number(value: Any) -> int:
    """A frame's line as the stack analysis reads it (equal values, ``7 == 7.0``, give equal text; odd ones 0)."""
    try:
        line = int(value or 0)
    except (TypeError, ValueError, OverflowError):
        return 0
    return line if 0 <= line < 2**31 else 0


@dataclasses.dataclass(frozen=True)
class CategoryRules:
    """Compiled rules and the category list they give a replay.

    Attributes:
        rules: ``(name, compiled regex)`` in matching order.
        categories: :data:`~lightning_memtrace.types.CATEGORIES`, then the rule names that are not among them, in
            rule order: the replay's category codes index this tuple.
    """

    rules: tuple[tuple[str, re.Pattern[str]], ...] = ()

    @classmethod
    def of(cls, rules: RulesLike) -> CategoryRules:
        """Rules from any :data:`RulesLike` (checked)."""
        if isinstance(rules, CategoryRules):
            return rules
        return cls(compile_rules(rules))

    @classmethod
    def combine(cls, given: RulesLike, recorded: RulesLike) -> CategoryRules:
        """The rules a replay applies: ``given`` (the command line's ``--rule``) first, in order, then the
        ``recorded`` ones (the snapshot header's ``category_rules``) whose names ``given`` does not use."""
        first = cls.of(given)
        names = set(first.names)
        rest = tuple(rule for rule in cls.of(recorded).rules if rule[0] not in names)
        return cls(first.rules + rest)

    def __bool__(self) -> bool:
        return bool(self.rules)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.rules)

    @property
    def categories(self) -> tuple[str, ...]:
        extra = [name for name in dict.fromkeys(self.names) if name not in CATEGORIES]
        return CATEGORIES + tuple(extra)

    def as_dict(self) -> dict[str, str]:
        """``{name: pattern}`` in order (what a header stores and the JSON shows)."""
        return {name: pattern.pattern for name, pattern in self.rules}

    def codes(self) -> np.ndarray:
        """The category code (into :attr:`categories`) of each rule."""
        index = {name: code for code, name in enumerate(self.categories)}
        return np.array([index[name] for name in self.names], dtype=np.int16)

    def text_code(self, text: str | None, codes: np.ndarray) -> int:
        """The category code of the first rule whose regex is found in ``text`` (-1: none)."""
        if text is None:
            return -1
        for k, (_, pattern) in enumerate(self.rules):
            if pattern.search(text):
                return int(codes[k])
        return -1

    def stack_codes(self, stacks: list[Any]) -> np.ndarray:
        """Per stack (frame list, innermost first), the category code its first matching (frame, rule) gives, -1
        where none matches. Each distinct frame dict is matched once (and each distinct frame text once)."""
        m = len(stacks)
        out = np.full(m, -1, dtype=np.int16)
        if not self.rules or not m:
            return out
        import pandas as pd

        from lightning_memtrace.analysis.events import first_positions

        clean = [f if isinstance(f, list) else (list(f) if isinstance(f, tuple) else []) for f in stacks]
        lengths = np.fromiter(map(len, clean), dtype=np.int64, count=m)
        total = int(lengths.sum())
        if total == 0:
            return out
        all_frames = list(itertools.chain.from_iterable(clean))
        frame_codes, unique_ids = pd.factorize(np.fromiter(map(id, all_frames), dtype=np.int64, count=total))
        codes = self.codes()
        by_text: dict[str | None, int] = {}
        per_unique = np.empty(len(unique_ids), dtype=np.int16)
        for k, pos in enumerate(first_positions(frame_codes, len(unique_ids)).tolist()):
            text = frame_text(all_frames[pos])
            code = by_text.get(text)
            if code is None:
                code = by_text[text] = self.text_code(text, codes)
            per_unique[k] = code
        del all_frames
        per_frame = per_unique[frame_codes]
        nonempty = lengths > 0
        starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])[nonempty]
        big = np.int64(total + 1)
        positions = np.arange(total, dtype=np.int64)
        first_pos = np.full(m, big, dtype=np.int64)
        first_pos[nonempty] = np.minimum.reduceat(np.where(per_frame >= 0, positions, big), starts)
        found = first_pos < big
        out[found] = per_frame[first_pos[found]]
        return out


NO_RULES = CategoryRules()
