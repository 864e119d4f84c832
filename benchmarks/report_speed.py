"""How fast is ``memtrace report`` on a long recording? (target: <= 5 s and <= 2 GiB peak RSS on 2 cores)

Builds a 1,000,000-event snapshot from the kkaitlyn111 fixture the way a long recording looks (distinct event dicts,
times and addresses shifted per repetition, frame lists shared as torch shares them), then times, each in a fresh
process:

* ``pickle.load`` of the file alone: the floor any reader pays;
* ``torch.cuda._memory_viz.trace(data)``: torch's own Python reader (after its ``pickle.load``), with a time limit;
* ``memtrace report FILE -o OUT.html``: in-process (imports done), and as a command end to end.

With ``--repeat N`` the snapshot is instead the fixture's whole trace N times over (``--repeat 50``: 967,100 events,
35 million frame references), addresses and times fresh per repetition and each repetition with its own frame lists
(the frame dicts shared, as torch's snapshots share them, and lists shared within a repetition as in the fixture): the
shape of a long real recording, where every event has its own list. ``memtrace summary`` is timed on it too.

usage: python benchmarks/report_speed.py [--events 1000000 | --repeat 50] [--out build/bench] [--torch-timeout 120]
    [--skip-torch] [--summary-only] [--targets [--runs 2]]

With ``--targets`` (issue 16, point 7: use with ``--repeat 50``) it prints side by side, from one run: ``pickle.load``
with the garbage collector paused, ``memtrace summary --json`` and ``memtrace report`` (each in-process with imports
done, and as the console script in a subprocess with its peak RSS), and the ratios against the targets: summary
within 2.5x of the paused ``pickle.load`` and <= 1 GiB peak RSS, report within 4x.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = ROOT.parent / "shared" / "fixtures" / "snapshots" / "kkaitlyn111_memory_files_memory_ctx128_fullstep.pickle"

# Runs in a fresh interpreter; prints one JSON line with the seconds it measured and its own peak RSS.
_RUNNER = r"""
import json, resource, sys, time
kind, path, out = sys.argv[1], sys.argv[2], sys.argv[3]
if kind == "lazy":
    # what the command costs when the package __init__ does not import the Lightning callback eagerly
    import importlib.util, types
    spec = importlib.util.find_spec("lightning_memtrace")
    pkg = types.ModuleType("lightning_memtrace")
    pkg.__path__ = list(spec.submodule_search_locations)
    sys.modules["lightning_memtrace"] = pkg
t_import = time.perf_counter()
if kind in ("pickle", "pickle_nogc"):
    import gc, pickle
    if kind == "pickle_nogc":
        gc.disable()
elif kind == "torch":
    import pickle
    from torch.cuda import _memory_viz
else:
    from lightning_memtrace.cli import main
    # "in-process" means with the imports done: the modules the command loads lazily (pandas among them) too
    import lightning_memtrace.analysis.source, lightning_memtrace.report.page  # noqa: F401
t0 = time.perf_counter()
c0 = time.process_time()
if kind in ("pickle", "pickle_nogc"):
    with open(path, "rb") as f:
        pickle.load(f)
elif kind == "torch":
    with open(path, "rb") as f:
        data = pickle.load(f)
    t_loaded = time.perf_counter()
    text = _memory_viz.trace(data)
elif kind in ("summary", "summary_json"):
    import contextlib, io
    with contextlib.redirect_stdout(io.StringIO()):
        code = main(["summary", path] + (["--json"] if kind == "summary_json" else []))
    assert code == 0
else:
    code = main(["report", path, "-o", out])
    assert code == 0
t1 = time.perf_counter()
c1 = time.process_time()
rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
result = {"seconds": t1 - t0, "cpu": c1 - c0, "import_seconds": t0 - t_import, "rss": rss}
if kind == "torch":
    result["trace_seconds"] = t1 - t_loaded
print("RESULT " + json.dumps(result))
"""


def build_snapshot(events: int, source: Path = FIXTURE) -> dict[str, Any]:
    """``events`` trace entries made of repetitions of the fixture's trace."""
    with open(source, "rb") as handle:
        data = pickle.load(handle)
    base = data["device_traces"][0]
    span = base[-1]["time_us"] - base[0]["time_us"] + 1_000
    addr_shift = 1 << 40
    trace: list[dict[str, Any]] = []
    rep = 0
    while len(trace) < events:
        dt = rep * span
        da = rep * addr_shift
        for e in base:
            if len(trace) >= events:
                break
            entry = dict(e)  # a distinct dict per event; "frames" stays the same list object (shared)
            entry["time_us"] = e["time_us"] + dt
            entry["addr"] = e["addr"] + da
            trace.append(entry)
        rep += 1
    data["device_traces"] = [trace]
    return data


def build_repeated(repeat: int, source: Path = FIXTURE) -> dict[str, Any]:
    """The fixture's trace ``repeat`` times over: fresh addresses and times per repetition, and per repetition fresh
    frame lists holding the fixture's frame dicts (lists shared between events within a repetition as they are in the
    fixture)."""
    with open(source, "rb") as handle:
        data = pickle.load(handle)
    base = data["device_traces"][0]
    span = base[-1]["time_us"] - base[0]["time_us"] + 1_000
    trace: list[dict[str, Any]] = []
    for rep in range(repeat):
        lists: dict[int, list[Any]] = {}
        for e in base:
            entry = dict(e)
            entry["time_us"] = e["time_us"] + rep * span
            entry["addr"] = e["addr"] + rep * (1 << 40)
            frames = e.get("frames")
            if rep and isinstance(frames, list):
                copy = lists.get(id(frames))
                if copy is None:
                    copy = lists[id(frames)] = list(frames)
                entry["frames"] = copy
            trace.append(entry)
    data["device_traces"] = [trace]
    return data


def _run(kind: str, path: Path, out: Path, timeout: float, command: list[str] | None = None) -> dict[str, Any]:
    """Run one measurement in a fresh interpreter; ``seconds``/``cpu`` exclude interpreter start unless a command."""
    start = time.perf_counter()
    args = [sys.executable, "-c", _RUNNER, kind, str(path), str(out)]
    if command:
        # the console script as a user runs it: wall time, CPU time and peak RSS of the whole child process
        wrapper = (
            "import json, resource, subprocess, sys, time\n"
            "t = time.perf_counter()\n"
            "r = subprocess.run(sys.argv[1:], capture_output=True)\n"
            "u = resource.getrusage(resource.RUSAGE_CHILDREN)\n"
            "print('RESULT ' + json.dumps({'seconds': time.perf_counter() - t, 'cpu': u.ru_utime + u.ru_stime,\n"
            "      'rss': u.ru_maxrss * 1024, 'rc': r.returncode}))\n"
            "sys.stderr.write(r.stderr.decode())\n"
        )
        args = [sys.executable, "-c", wrapper, *command]
    try:
        result = subprocess.run(args, check=False, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"timeout": timeout, "seconds": float("inf"), "cpu": float("inf"), "rss": 0}
    line = next((x for x in result.stdout.splitlines() if x.startswith("RESULT ")), None)
    if line is None or json.loads(line[len("RESULT ") :]).get("rc", 0) != 0:
        raise RuntimeError(f"{kind} failed: {result.stderr.strip()[-2000:]}")
    measured = json.loads(line[len("RESULT ") :])
    measured["wall"] = time.perf_counter() - start
    return measured


def _row(label: str, r: dict[str, Any], note: str = "") -> None:
    if "timeout" in r:
        print(f"  {label:<42} > {r['timeout']:.0f} s (stopped)")
        return
    rss = f"{r['rss'] / 2**30:5.2f} GiB" if r.get("rss") else "        -"
    print(f"  {label:<42} {r['seconds']:7.2f} s wall {r['cpu']:7.2f} s CPU   {rss}  {note}")


def _console_script() -> str:
    script = Path(sys.executable).with_name("memtrace")
    return str(script) if script.exists() else "memtrace"


def _targets(snap_path: Path, html: Path, events: int, runs: int = 2) -> int:
    """Issue 16, point 7: summary --json within 2.5x of pickle.load (gc paused) and <= 1 GiB RSS; report within 4x."""
    script = _console_script()
    plan: dict[str, tuple[str, list[str] | None]] = {
        "floor": ("pickle_nogc", None),
        "summary": ("summary_json", None),
        "summary_cmd": ("command", [script, "summary", "--json", str(snap_path)]),
        "report": ("inprocess", None),
        "report_cmd": ("command", [script, "report", str(snap_path), "-o", str(html)]),
        # an empty command: what the interpreter, the imports and the package cost before any file is read
        "bare_cmd": ("command", [script, "--version"]),
    }
    # each measured `runs` times, interleaved (so that a burst of other work hits every row alike); the fastest run
    # of each, and the highest RSS
    best: dict[str, dict[str, Any]] = {}
    rounds: list[dict[str, dict[str, Any]]] = []
    for _ in range(runs):
        rounds.append({})
        for key, (kind, command) in plan.items():
            r = rounds[-1][key] = _run(kind, snap_path, html, 300, command=command)
            if key not in best or r["seconds"] < best[key]["seconds"]:
                best[key] = {**r, "rss": max(r.get("rss", 0), best.get(key, {}).get("rss", 0))}
            else:
                best[key]["rss"] = max(best[key]["rss"], r.get("rss", 0))
    floor, summary, summary_cmd = best["floor"], best["summary"], best["summary_cmd"]
    report, report_cmd, bare_cmd = best["report"], best["report_cmd"], best["bare_cmd"]
    print(f"best of {runs} runs each:")
    print(f"{events:,}-event snapshot ({snap_path.stat().st_size / 1e6:.1f} MB):")
    _row("pickle.load, gc paused (the floor)", floor)
    _row("memtrace summary --json, in-process", summary)
    _row("memtrace summary --json, console script", summary_cmd, "(subprocess: max RSS of the child)")
    _row("memtrace report, in-process", report)
    _row("memtrace report, console script", report_cmd)
    _row("memtrace --version, console script", bare_cmd, "(interpreter + imports alone)")
    print()
    s_ratio = summary["seconds"] / floor["seconds"]
    s_cmd_ratio = summary_cmd["seconds"] / floor["seconds"]
    s_net_ratio = (summary_cmd["seconds"] - bare_cmd["seconds"]) / floor["seconds"]
    r_ratio = report["seconds"] / floor["seconds"]
    r_cmd_ratio = report_cmd["seconds"] / floor["seconds"]
    print(
        f"summary --json / pickle.load: {s_ratio:.2f}x in-process, {s_cmd_ratio:.2f}x console script "
        f"({s_net_ratio:.2f}x less the interpreter and imports); target <= 2.5x"
    )
    print(
        f"summary --json peak RSS: {summary['rss'] / 2**30:.2f} GiB in-process, "
        f"{summary_cmd['rss'] / 2**30:.2f} GiB console script; target <= 1 GiB"
    )
    print(f"report / pickle.load: {r_ratio:.2f}x in-process, {r_cmd_ratio:.2f}x console script; target <= 4x")
    if runs > 1:
        # the ratio within each round (the rows measured minutes apart, under the same load), then their median
        for label, key in (("summary --json", "summary"), ("report", "report")):
            for clock in ("seconds", "cpu"):
                each = sorted(r[key][clock] / r["floor"][clock] for r in rounds)
                shown = ", ".join(f"{x:.2f}x" for x in each)
                print(
                    f"{label} / pickle.load per round ({clock}, in-process): {shown}; median {each[len(each) // 2]:.2f}x"
                )
    ok = s_ratio <= 2.5 and summary_cmd["rss"] <= 2**30 and r_ratio <= 4.0
    print(f"targets (in-process times, console-script RSS): {'met' if ok else 'NOT met'}")
    return 0 if ok else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=1_000_000)
    parser.add_argument("--out", type=Path, default=ROOT / "build" / "bench")
    parser.add_argument(
        "--torch-timeout",
        type=float,
        default=120.0,
        help="seconds after which torch's reader is stopped (reported as a lower bound)",
    )
    parser.add_argument("--skip-torch", action="store_true")
    parser.add_argument("--repeat", type=int, default=None, help="the fixture's trace this many times (see above)")
    parser.add_argument("--summary-only", action="store_true", help="time pickle.load and memtrace summary only")
    parser.add_argument(
        "--targets", action="store_true", help="pickle.load (gc paused), summary --json and report side by side"
    )
    parser.add_argument("--runs", type=int, default=2, help="with --targets: runs of each measurement (the best)")
    args = parser.parse_args()
    if not FIXTURE.is_file():
        print(f"fixture missing: {FIXTURE}", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    t = time.perf_counter()
    if args.repeat is not None:
        snap_path = args.out / f"long_repeat{args.repeat}.pickle"
        data = build_repeated(args.repeat)
    else:
        snap_path = args.out / f"long_{args.events}.pickle"
        data = build_snapshot(args.events)
    events = len(data["device_traces"][0])
    references = sum(len(e.get("frames") or []) for e in data["device_traces"][0])
    with open(snap_path, "wb") as handle:
        pickle.dump(data, handle)
    del data
    size = snap_path.stat().st_size
    print(
        f"built {snap_path.name}: {events:,} events, {references:,} frame references, {size / 1e6:.1f} MB "
        f"({time.perf_counter() - t:.1f} s)"
    )
    try:
        load = os.getloadavg()[0]
        print(f"load average {load:.2f} on {os.cpu_count()} CPUs (wall times inflate when other work runs)")
    except OSError:
        pass
    html = args.out / "long_report.html"

    if args.targets:
        return _targets(snap_path, html, events, args.runs)
    floor = _run("pickle", snap_path, html, 300)
    floor_nogc = _run("pickle_nogc", snap_path, html, 300)
    summary = _run("summary", snap_path, html, 300)
    if args.summary_only:
        print(f"{events:,}-event snapshot:")
        _row("pickle.load alone (the floor)", floor)
        _row("pickle.load alone, gc disabled", floor_nogc)
        _row("memtrace summary, in-process", summary)
        return 0
    inproc = _run("inprocess", snap_path, html, 300)
    html_size = html.stat().st_size
    lazy = _run("lazy", snap_path, html, 300)
    script = Path(sys.executable).with_name("memtrace")
    cmd = [str(script) if script.exists() else "memtrace", "report", str(snap_path), "-o", str(html)]
    full = _run("command", snap_path, html, 300, command=cmd)
    print(f"{events:,}-event snapshot:")
    _row("pickle.load alone (the floor)", floor)
    _row("pickle.load alone, gc disabled", floor_nogc, "(memtrace's loader pauses the gc too)")
    _row("memtrace summary, in-process", summary)
    _row("memtrace report, in-process", inproc, f"HTML {html_size / 2**20:.1f} MiB")
    _row("memtrace report, command (lazy package)", lazy, "interpreter + imports + report")
    _row("memtrace report, console script", full, "+ lightning_memtrace/__init__ (imports Lightning)")
    torch_r: dict[str, Any] | None = None
    if not args.skip_torch:
        torch_r = _run("torch", snap_path, html, args.torch_timeout)
        if "timeout" not in torch_r:
            torch_r = {**torch_r, "seconds": torch_r["trace_seconds"], "cpu": torch_r["trace_seconds"]}
        _row("torch.cuda._memory_viz.trace(data)", torch_r, "(after its own pickle.load)")
        small_torch = _run("torch", FIXTURE, html, args.torch_timeout)
        small_ours = _run("inprocess", FIXTURE, args.out / "fixture_report.html", 300)
        print("19,342-event fixture (kkaitlyn111):")
        if "timeout" not in small_torch:
            small_torch = {**small_torch, "seconds": small_torch["trace_seconds"], "cpu": small_torch["trace_seconds"]}
        _row("torch.cuda._memory_viz.trace(data)", small_torch)
        _row("memtrace report, in-process", small_ours)
    print()
    for label, key in (("wall", "seconds"), ("CPU", "cpu")):
        print(
            f"ratio report / pickle.load ({label}): {inproc[key] / floor[key]:.2f}x in-process; "
            f"{inproc[key] / floor_nogc[key]:.2f}x against pickle.load with the gc paused"
        )
    if torch_r is not None:
        if "timeout" in torch_r:
            print(
                f"ratio report / torch _memory_viz.trace: < {inproc['seconds'] / args.torch_timeout:.3f}x "
                f"(torch stopped after {args.torch_timeout:.0f} s)"
            )
        else:
            print(f"ratio report / torch _memory_viz.trace: {inproc['seconds'] / torch_r['seconds']:.3f}x")
    ok = inproc["seconds"] <= 5.0 and inproc["rss"] <= 2 * 2**30 and html_size < 10 * 2**20
    ok_cpu = inproc["cpu"] <= 5.0
    print(
        f"target <= 5 s, <= 2 GiB, HTML < 10 MB (in-process): {'met' if ok else 'NOT met'} on wall time, "
        f"{'met' if ok_cpu else 'NOT met'} on CPU time"
    )
    return 0 if ok or ok_cpu else 1


if __name__ == "__main__":
    sys.exit(main())
