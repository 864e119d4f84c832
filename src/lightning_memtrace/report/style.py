"""The report's look: colours per category and phase, the page's CSS, and HTML escaping."""

from __future__ import annotations

import html
from typing import Any

#: Colours per category (stable across charts).
CATEGORY_COLORS: dict[str, str] = {
    "pre_existing": "#9e9e9e",
    "parameters": "#1f77b4",
    "optimizer_state": "#9467bd",
    "gradients": "#d62728",
    "unsharded_parameters": "#aec7e8",  # the light shade of parameters' blue: full copies of them
    "unsharded_gradients": "#ff9896",  # the light shade of gradients' red
    "inputs": "#8c564b",
    "activations": "#ff7f0e",
    "intermediates": "#ffbb78",
    "optimizer_intermediates": "#c5b0d5",
    "other": "#17becf",  # not a grey: pre-existing is the grey one
}
#: Colours of the categories user rules add (``--rule``, ``category_rules``), given in rule order (then again from the
#: first): none is a colour of the built-in categories, of the reserved line (#2ca02c) or a grey.
RULE_COLORS: tuple[str, ...] = ("#e377c2", "#bcbd22", "#393b79", "#637939", "#8c6d31", "#843c39", "#7b4173", "#5254a3")


def category_color(category: str, rule_categories: tuple[str, ...] | list[str] = ()) -> str:
    """The colour of a category: the built-in one's, else the one of its place among the rule categories."""
    color = CATEGORY_COLORS.get(category)
    if color is not None:
        return color
    if category in rule_categories:
        return RULE_COLORS[list(rule_categories).index(category) % len(RULE_COLORS)]
    return "#444"


PHASE_COLORS = {
    "forward": "rgba(255,127,14,0.07)",
    "backward": "rgba(214,39,40,0.07)",
    "optimizer_step": "rgba(148,103,189,0.10)",
    "zero_grad": "rgba(44,160,44,0.10)",
    "init": "rgba(31,119,180,0.07)",
    "validation": "rgba(23,190,207,0.08)",
    "after_step": "rgba(127,127,127,0.06)",
}

CSS = """
body{font-family:-apple-system,Segoe UI,Helvetica,Arial,sans-serif;margin:24px;color:#222;max-width:1400px}
h1{font-size:22px;margin:0 0 4px} h2{font-size:17px;margin:28px 0 8px;border-bottom:1px solid #ddd;padding-bottom:4px}
.meta{color:#666;font-size:13px} table{border-collapse:collapse;font-size:13px;margin:6px 0}
td,th{border:1px solid #ddd;padding:4px 8px;text-align:left;vertical-align:top} th{background:#f5f5f5}
td.num{text-align:right;font-variant-numeric:tabular-nums;white-space:nowrap}
ul.findings li{margin:6px 0} li.warning{color:#8a3b00}
.swatch{display:inline-block;width:10px;height:10px;margin-right:6px}
code{font-size:12px;word-break:break-all}
pre{background:#f7f7f7;padding:8px;overflow:auto;font-size:12px;max-height:300px}
"""


def esc(value: Any) -> str:
    """HTML-escape any value (every string taken from a snapshot goes through here)."""
    return html.escape(str(value), quote=True)
