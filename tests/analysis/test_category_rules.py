"""User rules for categories (``--rule NAME=REGEX``, ``category_rules``): matching order, precedence over inferred
categories (not recorded ones), exact bytes on a synthetic snapshot and on a real one."""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from rules_snapshots import ATTN, CACHE, MLP, MODEL, SOFTMAX, TRAIN, alloc_event, synthetic
from shared_files import fixture_path

from lightning_memtrace.analysis.loader import SnapshotError, load_snapshot
from lightning_memtrace.analysis.replay import replay
from lightning_memtrace.analysis.rules import CategoryRules, RuleError, compile_rules, frame_text
from lightning_memtrace.report.style import CATEGORY_COLORS, RULE_COLORS, category_color
from lightning_memtrace.types import CATEGORIES


def test_rule_categories_exact_bytes_and_order() -> None:
    plain = replay(synthetic())
    assert plain.peak.live_bytes == 64 + 1000 + 300 + 200
    assert plain.peak.by_category == {"activations": 1500, "pre_existing": 64}
    assert plain.categories == CATEGORIES and plain.category_rules == {}

    rep = replay(synthetic(), rules=["kv_cache=cache_utils\\.py", "attention=attn"])
    assert rep.categories == (*CATEGORIES, "kv_cache", "attention")
    assert rep.main.rule_categories == ("kv_cache", "attention")
    assert rep.category_rules == {"kv_cache": "cache_utils\\.py", "attention": "attn"}
    # the live block made in attn.py (its block frames) is named by the rule too, before "pre_existing"
    assert rep.peak.live_bytes == plain.peak.live_bytes
    assert rep.peak.by_category == {"attention": 1064, "kv_cache": 300, "activations": 200}
    al = rep.main.allocations
    assert list(al["category"].astype(str)) == ["attention", "attention", "kv_cache", "activations", "attention"]
    assert bool(al["inferred"].all())  # rule categories are not recorded ones
    # sites still add up to categories
    sites = rep.peak.sites
    assert sites.groupby("category")["bytes"].sum().to_dict() == rep.peak.by_category
    # the timeline's categories are the allocations' ones
    assert list(rep.main.timeline["category"].astype(str)) == [
        "attention",
        "attention",
        "attention",
        "kv_cache",
        "activations",
    ]
    assert rep.main.category_series().iloc[-1].to_dict() == {"activations": 200, "kv_cache": 300, "attention": 1064}


def test_innermost_frame_wins_then_rule_order() -> None:
    # B's innermost frame is cache_utils.py: "model" (given first) matches only an outer frame, "kv" the innermost
    rep = replay(synthetic(), rules={"model": "model\\.py", "kv": "cache_utils"})
    al = rep.main.allocations
    assert list(al["category"].astype(str)) == ["model", "model", "kv", "model", "pre_existing"]
    # at one frame, the first rule given wins: "cache_utils.py:40 update" matches both
    rep = replay(synthetic(), rules=["first=cache|attn", "second=cache_utils"])
    assert list(rep.main.allocations["category"].astype(str)) == ["first", "first", "first", "activations", "first"]
    assert rep.categories[len(CATEGORIES) :] == ("first", "second")  # a rule that never matched is still listed
    # the text searched is "file:line function": a line number and a function name match
    rep = replay(synthetic(), rules=["at_line_12=attn\\.py:12 ", "updates=\\bupdate$"])
    assert list(rep.main.allocations["category"].astype(str)) == [
        "activations",
        "at_line_12",
        "updates",
        "activations",
        "pre_existing",
    ]


def test_rule_named_like_a_category_maps_to_it() -> None:
    rep = replay(synthetic(), rules=["parameters=mlp\\.py", "attention=attn"])
    assert rep.categories == (*CATEGORIES, "attention")  # no second "parameters"
    assert rep.peak.by_category == {"attention": 1364, "parameters": 200}


def test_recorded_categories_stay_and_header_rules_apply() -> None:
    snap = synthetic()
    trace = snap["device_traces"][0]
    trace[0]["category"] = "parameters"  # recorded by MemTrace: a rule does not change it
    trace[3]["category"] = "unknown"  # left uncategorised: rules apply
    snap["memtrace"] = {"format": 1, "device": "cpu", "rank": 0, "category_rules": {"attention": "attn"}}
    rep = replay(snap)
    assert rep.is_memtrace and rep.category_rules == {"attention": "attn"}
    cats = list(rep.main.allocations["category"].astype(str))
    assert cats == ["parameters", "attention", "attention", "activations", "attention"]
    assert list(rep.main.allocations["inferred"]) == [False, True, True, True, True]
    # --rule comes first and a rule of the same name replaces the header's
    rep = replay(snap, rules=["attention=nothing_matches", "cache=cache_utils"])
    assert rep.category_rules == {"attention": "nothing_matches", "cache": "cache_utils"}
    cats = list(rep.main.allocations["category"].astype(str))
    assert cats == ["parameters", "intermediates", "cache", "activations", "pre_existing"]


def test_bad_rules_are_one_line_errors() -> None:
    with pytest.raises(RuleError, match=r"rule 'x': bad regular expression '\(': missing \)"):
        replay(synthetic(), rules=["x=("])
    for bad, fragment in (
        ("noequals", "expected NAME=REGEX"),
        ("=abc", "non-empty name"),
        ("a b=abc", "letters, digits"),
        ("x=", "non-empty text"),
    ):
        with pytest.raises(RuleError, match=re.escape(fragment)):
            compile_rules([bad])
    snap = synthetic()
    snap["memtrace"] = {"format": 1, "category_rules": {"broken": "[a-"}}
    with pytest.raises(SnapshotError, match=r"the header's category_rules: rule 'broken': bad regular expression"):
        replay(snap, source="s.pickle")


def test_frame_text_and_windows_paths() -> None:
    frame = {"filename": "C:\\u\\attn.py", "line": 7, "name": "forward"}
    assert frame_text(frame) == "C:/u/attn.py:7 forward"
    assert frame_text("not a frame") is None
    rules = CategoryRules.of({"attn": "/u/attn\\.py:7 forward$"})
    code = len(CATEGORIES)
    assert rules.stack_codes([[frame], [], [MODEL], ["odd", frame]]).tolist() == [code, -1, -1, code]


def test_rule_colors_in_order() -> None:
    rules = ("kv_cache", "attention")
    assert category_color("kv_cache", rules) == RULE_COLORS[0]
    assert category_color("attention", rules) == RULE_COLORS[1]
    assert category_color("activations", rules) == CATEGORY_COLORS["activations"]
    assert not set(RULE_COLORS) & {*CATEGORY_COLORS.values(), "#2ca02c"}  # nor the reserved line's


def _text(frame: dict[str, Any]) -> str:
    return f"{str(frame.get('filename', '')).replace(chr(92), '/')}:{frame.get('line', 0)} {frame.get('name', '')}"


def test_real_snapshot_rule_bytes_equal_matching_allocations() -> None:
    """MAGMA27 (Windows paths): ``attention=attention`` gives a category whose bytes at the peak are the live
    allocations whose stack has a frame matching, computed here from the raw trace and segments."""
    snap = load_snapshot(fixture_path("MAGMA27_assignment2_memory_snapshot.pickle"))
    plain = replay(snap)
    rep = replay(snap, rules=["attention=attention"])
    trace = snap.device_traces[0]
    pattern = re.compile("attention")

    def matches(frames: Any) -> bool:
        return any(isinstance(f, dict) and pattern.search(_text(f)) for f in frames or [])

    peak = plain.main.peak.index
    al = plain.main.allocations
    live = al[(al["alloc_index"] <= peak) & (al["end_index"] > peak)]
    in_trace = live[live["alloc_index"] >= 0]
    expected = sum(int(s) for i, s in zip(in_trace["alloc_index"], in_trace["size"]) if matches(trace[i]["frames"]))
    # blocks alive at dump time that the trace never mentions: their own frames
    mentioned = {e.get("addr") for e in trace}
    for seg in snap.segments:
        for block in seg.get("blocks", []):
            alive = str(block.get("state", "")).startswith("active") and block.get("address") not in mentioned
            if alive and matches(block.get("frames")):
                expected += int(block.get("requested_size") or block.get("size"))
    assert expected > 0
    assert rep.peak.index == peak and rep.peak.live_bytes == plain.peak.live_bytes
    assert rep.peak.by_category["attention"] == expected == 2_732_064_768
    # the bytes came out of the inferred categories only, and every category still adds up to the peak
    assert sum(rep.peak.by_category.values()) == rep.peak.live_bytes
    assert sites_add_up(rep.peak)


def sites_add_up(peak: Any) -> bool:
    return peak.sites.groupby("category")["bytes"].sum().to_dict() == peak.by_category


def test_rules_evaluated_once_per_distinct_frame(monkeypatch: pytest.MonkeyPatch) -> None:
    """A trace whose events share a few frame dicts: each distinct frame text is searched once, however many events."""
    frames = [[ATTN, MODEL, TRAIN], [MLP, MODEL, TRAIN]]
    trace = [alloc_event(k + 1, 10, k, frames[k % 2]) for k in range(2000)]
    searched: list[str] = []
    rules = CategoryRules.of({"attention": "attn"})
    original = CategoryRules.text_code

    def counting(self: CategoryRules, text: str | None, codes: np.ndarray) -> int:
        searched.append(str(text))
        return original(self, text, codes)

    monkeypatch.setattr(CategoryRules, "text_code", counting)
    rep = replay({"segments": [], "device_traces": [trace]}, rules=rules)
    assert sorted(searched) == sorted({_text(f) for f in (ATTN, MODEL, TRAIN, MLP)})
    assert rep.peak.by_category == {"attention": 10_000, "activations": 10_000}


_POOL = [ATTN, MODEL, TRAIN, CACHE, MLP, SOFTMAX, {"name": "x", "filename": "??", "line": 0}]
_RULES = [("attention", "attn"), ("kv", "cache"), ("model", "model\\.py:5"), ("activations", "mlp"), ("fn", " x$")]


@settings(max_examples=120, deadline=None)
@given(
    st.lists(st.lists(st.integers(0, len(_POOL) - 1), max_size=5), min_size=1, max_size=40),
    st.lists(st.integers(0, len(_RULES) - 1), min_size=1, max_size=4, unique=True),
)
def test_rules_match_a_brute_force_reading(stacks: list[list[int]], chosen: list[int]) -> None:
    """Against the rule as stated: innermost frame first, at each frame the rules in order; no match: the category
    the replay infers without rules."""
    trace = [alloc_event(k + 1, 10 + k, k, [dict(_POOL[i]) for i in stack]) for k, stack in enumerate(stacks)]
    rules = [_RULES[i] for i in chosen]
    plain = replay({"segments": [], "device_traces": [trace]})
    rep = replay({"segments": [], "device_traces": [trace]}, rules=[f"{n}={p}" for n, p in rules])
    expected = []
    for event, fallback in zip(trace, plain.main.allocations["category"].astype(str)):
        found = next((name for frame in event["frames"] for name, p in rules if re.search(p, _text(frame))), fallback)
        expected.append(found)
    assert list(rep.main.allocations["category"].astype(str)) == expected
    assert int(rep.main.timeline["live_bytes"].iloc[-1]) == int(plain.main.timeline["live_bytes"].iloc[-1])
