"""How fast is ``memtrace estimate --what-if`` on Qwen2.5-1.5B? (issue 12: <= 60 s and <= 2 GiB RSS on 2 cores)

Runs, side by side in one run, the console script as a user runs it (interpreter, imports, model built on the meta
device, today's estimate and every remedy's):

    memtrace estimate --config qwen2.5-1.5b.json --batch-size 16 --seq-len 256 --what-if [--jobs 1]

once with the default workers (the CPUs here, at most 4) and once with ``--jobs 1`` (one process), and prints each
one's wall time and the highest RSS of any of its processes, and whether both print the same table.

usage: python benchmarks/what_if_speed.py [--config PATH] [--batch-size 16] [--seq-len 256]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
QWEN_1_5B = ROOT.parent / "shared" / "reference" / "configs" / "qwen2.5-1.5b.json"

# Runs the command and reports its wall time and the largest RSS among the processes it waited for.
_WRAPPER = (
    "import json, resource, subprocess, sys, time\n"
    "t = time.perf_counter()\n"
    "r = subprocess.run(sys.argv[1:], capture_output=True, text=True)\n"
    "u = resource.getrusage(resource.RUSAGE_CHILDREN)\n"
    "print('RESULT ' + json.dumps({'seconds': time.perf_counter() - t, 'rss': u.ru_maxrss * 1024,\n"
    "      'rc': r.returncode, 'out': r.stdout, 'err': r.stderr[-2000:]}))\n"
)


def _run(command: list[str]) -> dict:
    done = subprocess.run([sys.executable, "-c", _WRAPPER, *command], capture_output=True, text=True, check=False)
    line = next(x for x in done.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line[len("RESULT ") :])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=QWEN_1_5B)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=256)
    args = parser.parse_args()
    if not args.config.is_file():
        print(f"config missing: {args.config}", file=sys.stderr)
        return 2
    script = Path(sys.executable).with_name("memtrace")
    base = [str(script) if script.exists() else "memtrace", "estimate", "--config", str(args.config)]
    base += ["--batch-size", str(args.batch_size), "--seq-len", str(args.seq_len), "--what-if"]
    print(f"{os.cpu_count()} CPUs; load average {os.getloadavg()[0]:.2f}")
    runs = {"default workers": _run(base), "--jobs 1": _run([*base, "--jobs", "1"])}
    for label, r in runs.items():
        if r["rc"] != 0:
            print(f"{label}: exit {r['rc']}\n{r['err']}", file=sys.stderr)
            return 1
        print(f"  {label:<16} {r['seconds']:6.1f} s wall   max RSS {r['rss'] / 2**30:.2f} GiB")
    fast, slow = runs["default workers"], runs["--jobs 1"]
    print(f"speed-up: {slow['seconds'] / fast['seconds']:.2f}x; same table: {fast['out'] == slow['out']}")
    print(fast["out"].split("what if", 1)[-1].rstrip())
    ok = fast["seconds"] <= 60 and fast["rss"] <= 2 * 2**30 and fast["out"] == slow["out"]
    print(f"target <= 60 s and <= 2 GiB (default workers): {'met' if ok else 'NOT met'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
