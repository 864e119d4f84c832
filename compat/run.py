"""`make compat`: one venv per torch / Lightning / transformers combination, and the smoke subset run in each.

Each venv gets only the dependencies (torch, lightning and transformers pinned exactly, the rest newest) and runs
``compat/test_smoke.py`` against this checkout's ``src`` through ``PYTHONPATH``, so the venvs serve any checkout and a
rerun reinstalls nothing: a venv whose stamp file lists the same requirements is reused. Venvs live under
``$COMPAT_DIR`` (default ``.compat/`` in the repository root, ignored by git); identical large files of different
venvs (the same CUDA libraries, the same torch) are hard-linked to each other to save disk.

The table (combination, result, how MemTrace counts on CPU there, seconds, first error line) is printed and written
to ``$COMPAT_DIR/results.md`` (results of combinations not run this time are kept from earlier runs, in
``results.json``); logs, ``pip freeze`` of each venv and pytest output are in ``$COMPAT_DIR/logs/``. Exit status 1
when a combination that installed fails its smoke tests; a combination that does not install, or one listed in
``UNSUPPORTED`` (kept in the matrix to show why it is left out of the supported range), is reported, not failed.

    python compat/run.py                 # every combination
    python compat/run.py --only 2.13     # combinations whose name contains "2.13"
    python compat/run.py --list          # the combinations, nothing run
    python compat/run.py --prune         # delete each venv after its run (small disks; reruns reinstall)

A new venv is not started with less than ``--min-free-gib`` (default 12) GiB free on the disk of ``$COMPAT_DIR``.

Torch wheels on PyPI for Linux are CUDA builds (several GB with their nvidia-* dependencies); they import and run on a
machine without a GPU. ``torch==2.13.0+cpu`` needs a CPU wheel index or a local wheel: pass pip options through
``COMPAT_PIP_ARGS`` (e.g. ``--extra-index-url https://download.pytorch.org/whl/cpu``).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SMOKE = "compat/test_smoke.py"

LIGHTNING_NEWEST = "2.6.6"
TRANSFORMERS_4 = "4.57.6"  # newest 4.x
TRANSFORMERS_5 = "5.24.0"  # the 5.x of the torch rows (5.x needs torch >= 2.6)
#: Newest 5.x, in a combination of its own (it needs kernels>=0.19.1, which PyPI lacked until December 2026).
TRANSFORMERS_5_NEWEST = "5.25.0"
#: Newest patch of every torch minor from 2.4; 2.13.0 as the CPU build.
TORCHES = [
    "2.15.0", "2.14.1", "2.13.0+cpu", "2.12.1", "2.11.0", "2.10.0", "2.9.1", "2.8.0", "2.7.1", "2.6.0", "2.5.1", "2.4.1"
]
#: Oldest torch that passes (the lower bound in pyproject.toml).
OLDEST_TORCH = "2.5.1"
#: Torch versions left below the supported range, and why.
UNSUPPORTED = {
    "2.4.1": "the smoke subset passes since MemTrace's saved-tensor hooks step aside for torch 2.4's vmap, but the "
    "whole suite had 20 failures there on 2026-12-06 (estimates against real runs, FSDP2, console, among others)",
}
#: Everything else the smoke subset needs (newest that pip resolves with the pins).
OTHERS = ["pandas", "numpy", "plotly", "matplotlib", "rich", "pytest", "tensorboard", "typing_extensions"]
#: The lower bounds of pyproject.toml for the libraries beside torch, Lightning and transformers, pinned together in a
#: combination of their own (plotly 5.5 brought ``to_html(div_id=...)``; rich before 12.5 draws headerless tables with
#: another border).
OLDEST_OTHERS = ("pandas==1.5.3", "numpy==1.23.5", "plotly==5.5.0", "matplotlib==3.6.3", "rich==12.5.0")


@dataclasses.dataclass(frozen=True)
class Combination:
    torch: str
    lightning: str
    transformers: str
    #: Why this combination is known not to work (outside the supported range): its failure does not fail the run.
    unsupported: str = ""
    #: Pins for the other libraries (default: the newest of each).
    others: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        name = f"torch{self.torch}-lightning{self.lightning}-transformers{self.transformers}"
        return name + "-oldest-libraries" if self.others else name

    @property
    def folder(self) -> str:
        return re.sub(r"[^A-Za-z0-9._-]", "_", self.name)

    def requirements(self) -> list[str]:
        pins = [f"torch=={self.torch}", f"lightning=={self.lightning}", f"transformers=={self.transformers}"]
        pinned = {re.split(r"[=<>]", pin)[0] for pin in self.others}
        return pins + list(self.others) + [name for name in OTHERS if name not in pinned]


def _minor(version: str) -> tuple[int, int]:
    major, minor = version.split(".")[:2]
    return int(major), int(minor)


def combinations() -> list[Combination]:
    """Every torch with the newest Lightning (and transformers 5 where it supports that torch, else 4); every
    Lightning minor with torch 2.13; transformers 4 with torch 2.13 and the oldest Lightning; all oldest together; the
    oldest of the other libraries with torch 2.13 and the newest Lightning and transformers."""
    out = [
        Combination(t, LIGHTNING_NEWEST, TRANSFORMERS_5 if _minor(t) >= (2, 6) else TRANSFORMERS_4,
                    UNSUPPORTED.get(t, ""))
        for t in TORCHES
    ]
    out += [
        Combination("2.13.0+cpu", "2.5.6", TRANSFORMERS_5),
        Combination("2.13.0+cpu", "2.4.0", TRANSFORMERS_5),
        Combination("2.13.0+cpu", "2.4.0", TRANSFORMERS_4),
        Combination(OLDEST_TORCH, "2.4.0", TRANSFORMERS_4),
        Combination("2.13.0+cpu", LIGHTNING_NEWEST, TRANSFORMERS_5_NEWEST),
        Combination("2.13.0+cpu", LIGHTNING_NEWEST, TRANSFORMERS_5_NEWEST, others=OLDEST_OTHERS),
    ]
    return out


@dataclasses.dataclass
class Result:
    name: str
    torch: str
    lightning: str
    transformers: str
    status: str  # "pass", "FAIL", "not installed"
    install_s: float = 0.0
    test_s: float = 0.0
    detail: str = ""
    versions: str = ""
    counting: str = ""
    date: str = ""
    reused: bool = False


def _run(cmd: list[str], log: Path, timeout: float, **kwargs) -> tuple[int, str]:
    """Run ``cmd`` with its output into ``log``; (exit status, output)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    try:
        proc = subprocess.run(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout, **kwargs
        )
        code, output = proc.returncode, proc.stdout
    except subprocess.TimeoutExpired as error:
        out = error.stdout or ""
        out = out.decode(errors="replace") if isinstance(out, bytes) else out
        code, output = 124, f"{out}\ntimed out after {timeout:.0f} s"
    log.write_text(f"$ {shlex.join(cmd)}\n{output}", encoding="utf-8")
    return code, output


def _first_error(output: str) -> str:
    """What went wrong, in one line: pytest's first failing test and its exception, else pip's last ERROR line."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    test = next((line.split(" - ")[0] for line in lines if re.match(r"(FAILED|ERROR) \S+", line)), None)
    if test is not None:
        exception = next((line[1:].strip() for line in lines if re.match(r"E\s+\S", line)), "")
        return f"{test}: {exception}"[:300] if exception else test[:300]
    errors = [line for line in lines if line.startswith("ERROR:") and "Ignored the following" not in line]
    if errors:
        return errors[-1][:300]
    for line in lines:
        if re.search(r"\w+(Error|Exception)\b|timed out", line):
            return line[:300]
    return lines[-1][:300] if lines else ""


def install(combo: Combination, venv: Path, logs: Path, python: str, pip_args: list[str]) -> tuple[bool, float, str]:
    stamp = venv / ".compat-complete"
    wanted = json.dumps({"requirements": combo.requirements(), "pip_args": pip_args})
    if stamp.is_file() and stamp.read_text() == wanted and (venv / "bin" / "python").is_file():
        return True, 0.0, "reused"
    start = time.monotonic()
    if venv.exists():
        shutil.rmtree(venv)
    code, output = _run([python, "-m", "venv", str(venv)], logs / f"{combo.folder}.venv.log", 600)
    if code == 0:
        cmd = [str(venv / "bin" / "python"), "-m", "pip", "install", "--no-cache-dir", "--disable-pip-version-check"]
        # Every requirement here is pinned exactly, so a machine-wide cap from pip's config (a `constraint` file,
        # `torch<=...`) would only keep the newest torch out of the table.
        env = {**os.environ, "PIP_CONSTRAINT": os.devnull}
        code, output = _run(cmd + pip_args + combo.requirements(), logs / f"{combo.folder}.install.log", 3600, env=env)
    seconds = time.monotonic() - start
    if code != 0:
        shutil.rmtree(venv, ignore_errors=True)
        return False, seconds, _first_error(output)
    freeze = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "freeze"], capture_output=True, text=True)
    (logs / f"{combo.folder}.freeze.txt").write_text(freeze.stdout, encoding="utf-8")
    stamp.write_text(wanted)
    return True, seconds, ""


def versions(venv: Path) -> tuple[str, str]:
    """The versions the venv really runs, and how MemTrace counts on CPU there (the private profiler entry points)."""
    code = (
        "import torch, lightning, transformers\n"
        "from lightning_memtrace.capture.reports_backend import unavailable_reason\n"
        "print(f'torch {torch.__version__} / lightning {lightning.__version__} / '\n"
        "      f'transformers {transformers.__version__}')\n"
        "print('allocator reports' if unavailable_reason() is None else f'dispatch mode: {unavailable_reason()}')\n"
    )
    env = dict(os.environ, PYTHONPATH=str(REPO / "src"))
    proc = subprocess.run([str(venv / "bin" / "python"), "-c", code], capture_output=True, text=True, cwd="/", env=env)
    if proc.returncode != 0:
        return f"import failed: {_first_error(proc.stderr)}", ""
    found, counting = (proc.stdout.strip().splitlines() + ["", ""])[:2]
    return found, counting


def smoke(combo: Combination, venv: Path, logs: Path) -> tuple[bool, float, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO / "src") + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["COLUMNS"] = "200"
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TRANSFORMERS_OFFLINE", "1")
    cmd = [str(venv / "bin" / "python"), "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfE", SMOKE]
    start = time.monotonic()
    code, output = _run(cmd, logs / f"{combo.folder}.test.log", 1800, cwd=REPO, env=env)
    return code == 0, time.monotonic() - start, "" if code == 0 else _first_error(output)


def dedupe(root: Path, min_bytes: int = 1 << 20) -> int:
    """Hard-link identical files (at least ``min_bytes``) under ``root`` to each other; the bytes saved."""
    groups: dict[tuple[int, str], list[Path]] = defaultdict(list)
    for dirpath, _, filenames in os.walk(root):
        for filename in filenames:
            path = Path(dirpath) / filename
            try:
                st = path.lstat()
            except OSError:
                continue
            if st.st_size >= min_bytes and path.is_file() and not path.is_symlink():
                groups[(st.st_size, filename)].append(path)
    saved = 0
    for (size, _), paths in groups.items():
        if len(paths) < 2 or len({p.stat().st_ino for p in paths}) == 1:
            continue
        by_hash: dict[str, Path] = {}
        for path in paths:
            digest = hashlib.sha256()
            with open(path, "rb") as handle:
                for chunk in iter(lambda: handle.read(1 << 23), b""):
                    digest.update(chunk)
            first = by_hash.setdefault(digest.hexdigest(), path)
            if first is path or first.stat().st_ino == path.stat().st_ino:
                continue
            tmp = path.with_name(path.name + ".compat-link")
            os.link(first, tmp)
            os.chmod(tmp, first.stat().st_mode)
            os.replace(tmp, path)
            saved += size
    return saved


def markdown(results: list[Result]) -> str:
    lines = [
        "| torch | Lightning | transformers | result | CPU counting | install s | smoke s | first error line |",
        "| --- | --- | --- | --- | --- | ---: | ---: | --- |",
    ]
    for r in results:
        detail = r.detail.replace("|", "\\|")
        transformers = r.transformers + (" (oldest other libraries)" if r.name.endswith("-oldest-libraries") else "")
        lines.append(
            f"| {r.torch} | {r.lightning} | {transformers} | {r.status} | {r.counting} "
            f"| {'reused' if r.reused else f'{r.install_s:.0f}'} "
            f"| {r.test_s:.0f} | {detail} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dir", default=os.environ.get("COMPAT_DIR", str(REPO / ".compat")), help="venvs and results")
    parser.add_argument("--only", action="append", default=[], help="run combinations whose name contains this")
    parser.add_argument("--list", action="store_true", help="list the combinations and exit")
    parser.add_argument("--prune", action="store_true", help="delete each venv after its run")
    parser.add_argument("--no-dedupe", action="store_true", help="do not hard-link identical files across venvs")
    parser.add_argument("--min-free-gib", type=float, default=float(os.environ.get("COMPAT_MIN_FREE_GIB", 12)),
                        help="do not start an install with less free disk than this (a CUDA torch venv takes 4-8 GiB)")
    parser.add_argument("--python", default=os.environ.get("COMPAT_PYTHON", sys.executable), help="base interpreter")
    args = parser.parse_args(argv)

    chosen = [c for c in combinations() if not args.only or any(o in c.name for o in args.only)]
    if args.list:
        for combo in chosen:
            print(combo.name)
        return 0
    root = Path(args.dir).resolve()
    venvs, logs = root / "venvs", root / "logs"
    venvs.mkdir(parents=True, exist_ok=True)
    logs.mkdir(parents=True, exist_ok=True)
    pip_args = shlex.split(os.environ.get("COMPAT_PIP_ARGS", ""))
    store = root / "results.json"
    previous = json.loads(store.read_text()) if store.is_file() else {}

    started = time.monotonic()
    failed = False
    for combo in chosen:
        venv = venvs / combo.folder
        print(f"== {combo.name}", flush=True)
        free_gib = shutil.disk_usage(root).free / 2**30
        if free_gib < args.min_free_gib and not (venv / ".compat-complete").is_file():
            ok, install_s, detail = False, 0.0, f"not tried: {free_gib:.1f} GiB free, below --min-free-gib"
        else:
            ok, install_s, detail = install(combo, venv, logs, args.python, pip_args)
        reused = ok and detail == "reused"
        detail = "" if reused else detail
        result = Result(combo.name, combo.torch, combo.lightning, combo.transformers, "not installed", install_s,
                        date=time.strftime("%Y-%m-%d"), reused=reused)
        if not ok:
            result.detail = detail
        else:
            result.versions, result.counting = versions(venv)
            passed, result.test_s, result.detail = smoke(combo, venv, logs)
            if combo.unsupported:
                result.status = "fails, as known (unsupported)" if not passed else "passes (listed unsupported)"
                result.detail = result.detail or combo.unsupported
            else:
                result.status = "pass" if passed else "FAIL"
                failed |= not passed
            if args.prune:
                shutil.rmtree(venv, ignore_errors=True)
            elif not args.no_dedupe and install_s > 0:
                saved = dedupe(venvs)
                if saved:
                    print(f"   hard-linked identical files across venvs: {saved / 2**30:.1f} GiB saved", flush=True)
        installed = "reused" if reused else f"{install_s:.0f} s"
        print(f"   {result.status}  install {installed}  smoke {result.test_s:.0f} s  {result.versions}  "
              f"{result.counting}"
              f"{'  ' + result.detail if result.detail else ''}", flush=True)
        previous[combo.name] = dataclasses.asdict(result)
        store.write_text(json.dumps(previous, indent=1))

    every = [Result(**previous[c.name]) for c in combinations() if c.name in previous]
    table = markdown(every)
    (root / "results.md").write_text(table, encoding="utf-8")
    print()
    print(table)
    print(f"{len(chosen)} combination(s) in {time.monotonic() - started:.0f} s; logs in {logs}; "
          f"table in {root / 'results.md'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
