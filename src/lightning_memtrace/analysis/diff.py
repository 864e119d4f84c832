"""Two sources compared at their peaks (``memtrace diff``): B - A per figure, category and allocation site."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pandas as pd

from lightning_memtrace.analysis.loader import SnapshotError
from lightning_memtrace.analysis.source import ReportSource
from lightning_memtrace.schema import header_is_cpu
from lightning_memtrace.types import CATEGORIES


@dataclasses.dataclass
class Diff:
    """Two sources side by side: ``b - a``.

    Attributes:
        a_name: Name of the first.
        b_name: Name of the second.
        summary: Rows ``peak``, ``reserved at peak``, ``events``... with columns ``a, b, delta``.
        by_category: Live bytes at each peak per category: ``category, a, b, delta``.
        by_site: Live bytes at each peak per site (``site``, ``function``): ``a, b, delta``, largest change first.
    """

    a_name: str
    b_name: str
    summary: pd.DataFrame
    by_category: pd.DataFrame
    by_site: pd.DataFrame


def _site_key_frame(sites: pd.DataFrame, name_by_script: bool) -> pd.DataFrame:
    frame = sites.copy()
    if name_by_script:
        # different script names for the same line (profile_grad.py vs profile_no_grad.py) still match by basename
        frame["key"] = frame["function"].astype(str) + " @ line " + frame["line"].astype(str)
    else:
        site, function = frame["site"].astype(str), frame["function"].astype(str)
        # a site without a line (memory allocated before recording) is named by its function alone already
        frame["key"] = site.where(site == function, site + " (" + function + ")")
    return frame.groupby("key", sort=False)["bytes"].sum()


def side_names(a: Path, b: Path) -> tuple[str, str]:
    """Names for two files: their names, or, when the names are equal, their paths from the last folder that differs
    (``run_a/memtrace/snapshot_rank0_steps1-2.pickle``)."""
    if a.name != b.name:
        return a.name, b.name
    pa, pb = a.resolve().parts, b.resolve().parts
    same = 0
    while same < min(len(pa), len(pb)) and pa[-1 - same] == pb[-1 - same]:
        same += 1
    if same >= min(len(pa), len(pb)):
        return str(a), str(b)
    return "/".join(pa[-1 - same :]), "/".join(pb[-1 - same :])


def _reserved_known(source: ReportSource) -> bool:
    rep = source.main.replay if source.main is not None else None
    return rep is not None and rep.main.reserved_known and not header_is_cpu(rep.memtrace)


def diff_sources(a: ReportSource, b: ReportSource) -> Diff:
    """Compare the main snapshots (highest peak) of two sources at their peaks."""
    if a.main is None or b.main is None:
        raise SnapshotError("diff needs a snapshot on each side (a log folder without snapshot cannot be diffed)")
    ra, rb = a.main.replay, b.main.replay
    pa, pb = ra.peak, rb.peak
    summary = pd.DataFrame(
        [
            {"figure": "peak allocated", "a": pa.live_bytes, "b": pb.live_bytes},
            {"figure": "reserved at peak", "a": pa.reserved_bytes, "b": pb.reserved_bytes},
            {"figure": "reserved at dump", "a": ra.reserved_end_bytes, "b": rb.reserved_end_bytes},
            {"figure": "events", "a": ra.num_events, "b": rb.num_events},
        ]
    )
    if not (_reserved_known(a) or _reserved_known(b)):  # CPU runs: no caching allocator, nothing reserved to show
        summary = summary[~summary["figure"].str.startswith("reserved")].reset_index(drop=True)
    summary["delta"] = summary["b"] - summary["a"]
    order = list(dict.fromkeys([*CATEGORIES, *ra.categories, *rb.categories]))  # user rules' names after the built-in
    cats = [c for c in order if c in pa.by_category or c in pb.by_category]
    by_category = pd.DataFrame(
        {
            "category": cats,
            "a": [int(pa.by_category.get(c, 0)) for c in cats],
            "b": [int(pb.by_category.get(c, 0)) for c in cats],
        }
    )
    by_category["delta"] = by_category["b"] - by_category["a"]
    files_a = set(pa.sites["file"].astype(str)) if len(pa.sites) else set()
    files_b = set(pb.sites["file"].astype(str)) if len(pb.sites) else set()
    by_script = not (files_a & files_b)
    sa = _site_key_frame(pa.sites, by_script) if len(pa.sites) else pd.Series(dtype="int64")
    sb = _site_key_frame(pb.sites, by_script) if len(pb.sites) else pd.Series(dtype="int64")
    by_site = pd.DataFrame({"a": sa, "b": sb}).fillna(0).astype("int64")
    by_site["delta"] = by_site["b"] - by_site["a"]
    by_site = by_site.reindex(by_site["delta"].abs().sort_values(ascending=False, kind="stable").index)
    by_site.index.name = "site"
    by_site = by_site.reset_index()
    return Diff(*side_names(a.main.path, b.main.path), summary, by_category, by_site)
