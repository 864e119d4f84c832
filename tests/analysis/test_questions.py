"""Questions of time (issue 16, point 3): every answer of ``analysis.questions`` checked exactly against a brute-force
replay of small synthetic snapshots (a dict of live blocks, event by event)."""

from __future__ import annotations

import random
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

from lightning_memtrace.analysis.answers import summary_object
from lightning_memtrace.analysis.questions import Question, QuestionError, ask, file_lines, phase_peaks
from lightning_memtrace.analysis.replay import replay
from lightning_memtrace.analysis.source import LoadedSnapshot, ReportSource

USER = "/home/me/project/train.py"
OTHER = "/home/me/project/model/layers.py"
STAGES = ("forward", "backward", "optimizer_step")
CATS = ("parameters", "gradients", "optimizer_state", "activations", "other")
PRE = "<pre-existing>"


def _frames(file: str, line: int) -> list[dict[str, Any]]:
    return [{"filename": file, "line": line, "name": f"fn{line}"}]


def synthetic(seed: int, n: int = 70) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """A MemTrace-tagged snapshot (steps 0 to 2, three stages each) with a block seeded from ``segments`` and frees of
    blocks older than the trace; and, for the brute force, the blocks live before the first event."""
    rng = random.Random(seed)
    seeded = {"address": 1 << 40, "size": 4096, "requested_size": 3000, "state": "active_allocated"}
    seeded |= {"category": "parameters", "frames": _frames(OTHER, 5)}
    before = [{"addr": 1 << 40, "size": 3000, "category": "parameters", "site": f"{OTHER}:5"}]
    trace, live, next_addr, t = [], {}, 4096, 100
    for i in range(n):
        step, stage = min(i * 3 // n, 2), STAGES[(i * 9 // n) % 3]
        t += rng.choice((0, 1, 3, 7))  # equal times too: windows include both ends
        tag = {"user_metadata": f"phase={stage} step={step}", "time_us": t}
        roll = rng.random()
        if roll < 0.08:  # a free of a block made before recording
            cat, size = rng.choice(CATS), rng.randrange(1, 5000)
            addr = (1 << 41) + i * 64
            before.append({"addr": addr, "size": size, "category": cat, "site": PRE})
            trace.append({"action": "free_completed", "addr": addr, "size": size, "category": cat, **tag})
        elif roll < 0.4 and live:
            addr = rng.choice(sorted(live))
            size, cat, file, line = live.pop(addr)
            trace.append({"action": "free_completed", "addr": addr, "size": size, "category": cat, **tag})
        else:
            size, cat = rng.randrange(1, 1 << 20), rng.choice(CATS)
            file, line = rng.choice(((USER, 10), (USER, 11), (USER, 12), (OTHER, 7)))
            addr, next_addr = next_addr, next_addr + 4096
            live[addr] = (size, cat, file, line)
            trace.append({"action": "alloc", "addr": addr, "size": size, "category": cat})
            trace[-1] |= {"frames": _frames(file, line), **tag}
    segment = {"device": 0, "address": 1 << 40, "total_size": 1 << 22, "blocks": [seeded]}
    return {"segments": [segment], "device_traces": [trace]}, before


def brute_states(snapshot: dict[str, Any], before: list[dict[str, Any]]) -> list[dict[int, tuple]]:
    """The live blocks before the first event (index 0) and after each event (index i + 1)."""
    live = {b["addr"]: (b["size"], b["category"], b["site"]) for b in before}
    states = [dict(live)]
    for e in snapshot["device_traces"][0]:
        if e["action"] == "alloc":
            frame = e["frames"][0]
            live[e["addr"]] = (e["size"], e["category"], f"{frame['filename']}:{frame['line']}")
        else:
            live.pop(e["addr"])
        states.append(dict(live))
    return states


def totals(state: dict[int, tuple]) -> tuple[int, dict[str, int], dict[tuple[str, str], tuple[int, int]]]:
    by_cat: dict[str, int] = defaultdict(int)
    by_site: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0])
    for size, cat, site in state.values():
        by_cat[cat] += size
        by_site[(site, cat)][0] += size
        by_site[(site, cat)][1] += 1
    return sum(by_cat.values()), dict(by_cat), {k: (v[0], v[1]) for k, v in by_site.items()}


def replay_sites(sites) -> dict[tuple[str, str], tuple[int, int]]:
    out = {}
    for r in sites.to_dict("records"):
        label = str(r["site"]) if str(r["file"]) else PRE  # blocks older than the trace, without a stack
        key = (label, str(r["category"]))
        bytes_, count = out.get(key, (0, 0))
        out[key] = (bytes_ + int(r["bytes"]), count + int(r["count"]))
    return out


def assert_state(moment, state: dict[int, tuple]) -> None:
    total, by_cat, by_site = totals(state)
    assert moment.live_bytes == total
    assert moment.by_category == {c: b for c, b in by_cat.items() if b}
    assert replay_sites(moment.sites) == by_site


def first_max(states: list[dict[int, tuple]], rows: list[int], start_row: int | None) -> int:
    """Brute force: the row (``-1``: before the first event) of the highest state, the first one on a tie, the state
    at the start only when it holds strictly more."""
    live = {row: totals(states[row + 1])[0] for row in rows}
    best = max(rows, key=lambda r: (live[r], -r)) if rows else start_row
    if start_row is not None and rows and totals(states[start_row + 1])[0] > live[best]:
        return start_row
    return best


@pytest.mark.parametrize("seed", range(6))
def test_at_every_event_is_the_brute_force_state(seed: int) -> None:
    snap, before = synthetic(seed)
    states = brute_states(snap, before)
    dev = replay(snap).devices[0]
    for i in range(dev.num_events):
        answer = ask(dev, Question(at=i))
        assert answer.moment.index == i and answer.at == i
        assert_state(answer.moment, states[i + 1])
    assert_state(dev.peak_at(-1), states[0])


@pytest.mark.parametrize("seed", range(6))
def test_window_peak_includes_the_state_at_its_start(seed: int) -> None:
    snap, before = synthetic(seed)
    states = brute_states(snap, before)
    times = [e["time_us"] for e in snap["device_traces"][0]]
    dev = replay(snap).devices[0]
    rng = random.Random(seed)
    windows = [(times[0], times[-1]), (0, 10), (times[-1] + 1, times[-1] + 5)]
    windows += [tuple(sorted(rng.sample(range(times[0] - 2, times[-1] + 2), 2))) for _ in range(25)]
    for start, end in windows:
        rows = [i for i, t in enumerate(times) if start <= t <= end]
        start_row = rows[0] - 1 if rows else max([i for i, t in enumerate(times) if t < start], default=-1)
        answer = ask(dev, Question(window=(start, end)))
        expected_row = first_max(states, rows, start_row)
        assert answer.events == len(rows)
        assert answer.moment.index == expected_row, (start, end)
        assert_state(answer.moment, states[expected_row + 1])


@pytest.mark.parametrize("seed", range(6))
def test_step_and_phase_peaks(seed: int) -> None:
    snap, before = synthetic(seed)
    states = brute_states(snap, before)
    tags = [e["user_metadata"] for e in snap["device_traces"][0]]
    dev = replay(snap).devices[0]
    table = phase_peaks(dev).set_index(["phase", "step"])
    for step in (None, 0, 1, 2):
        for stage in (None, *STAGES):
            if step is None and stage is None:
                continue
            rows = [
                i
                for i, tag in enumerate(tags)
                if (step is None or tag.endswith(f" step={step}")) and (stage is None or f"phase={stage} " in tag)
            ]
            answer = ask(dev, Question(step=step, phase=stage))
            expected_row = first_max(states, rows, None)
            assert answer.events == len(rows) and answer.moment.index == expected_row
            assert_state(answer.moment, states[expected_row + 1])
            if step is not None and stage is not None:
                row = table.loc[(stage, step)]
                assert int(row["peak_bytes"]) == answer.moment.live_bytes
                assert int(row["peak_event"]) == expected_row and int(row["events"]) == len(rows)


@pytest.mark.parametrize("seed", range(6))
def test_file_lines_at_the_peak(seed: int) -> None:
    snap, before = synthetic(seed)
    states = brute_states(snap, before)
    dev = replay(snap).devices[0]
    peak = dev.peak
    per_line: dict[int, list[int]] = defaultdict(lambda: [0, 0])
    for size, _, site in states[peak.index + 1].values():
        if site.startswith(USER + ":"):
            per_line[int(site.rsplit(":", 1)[1])][0] += size
            per_line[int(site.rsplit(":", 1)[1])][1] += 1
    for path in ("train.py", "project/train.py", USER):
        lines = ask(dev, Question(file=path)).lines
        assert lines is not None
        assert {x.line: [x.bytes, x.count] for x in lines} == dict(per_line)
        assert all(x.file == USER and x.function == f"fn{x.line}" for x in lines)
    assert file_lines(dev, peak, "layers.py")  # another file of the trace
    with pytest.raises(QuestionError, match="ain.py"):
        file_lines(dev, peak, "ain.py")  # a suffix, but not at a path separator


def test_sites_of_a_category_add_up_to_it() -> None:
    for seed in range(6):
        snap, _ = synthetic(seed)
        question = Question(step=1, phase="backward")
        loaded = LoadedSnapshot(Path("synthetic.pickle"), replay(snap))
        obj = summary_object("synthetic.pickle", [ReportSource(Path("x"), [loaded], None)], question, None)
        (device,) = obj["devices"]
        sums: dict[str, int] = defaultdict(int)
        for site in device["sites"]:
            sums[site["category"]] += site["bytes"]
        assert {c: b for c, b in sums.items() if b} == device["categories"]
        assert sum(device["categories"].values()) == device["peak_bytes"]
        assert device["site_count"] == len(device["sites"])


def test_bad_questions_are_one_line_errors() -> None:
    snap, _ = synthetic(0)
    dev = replay(snap).devices[0]
    cases = [
        (Question(window=(5, 3)), "end is before the start"),
        (Question(at=dev.num_events), f"has {dev.num_events} events"),
        (Question(at=-1), "numbered from 0"),
        (Question(step=9), "steps 0 to 2"),
        (Question(phase="fwd"), "unknown phase 'fwd'"),
        (Question(step=0, phase="validation"), "no event of phase validation in step 0"),
        (Question(at=1, step=0), "cannot be combined"),
        (Question(window=(1, 2), phase="forward"), "cannot be combined"),
        (Question(file="nothing.py"), "nothing.py"),
    ]
    for question, fragment in cases:
        with pytest.raises(QuestionError, match=fragment) as info:
            ask(dev, question)
        assert "\n" not in str(info.value)


def test_no_question_is_the_peak() -> None:
    snap, _ = synthetic(3)
    dev = replay(snap).devices[0]
    answer = ask(dev, Question())
    assert answer.moment is dev.peak and answer.scope == "whole trace" and answer.lines is None
    full = ask(dev, Question(window=(-(10**12), 10**12)))
    assert full.moment.index == dev.peak.index and full.moment.live_bytes == dev.peak.live_bytes
