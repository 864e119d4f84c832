"""Reading a report page as a browser would: the URLs it would load, the chart's traces, the embedded summary."""

from __future__ import annotations

import json
import re
from html.parser import HTMLParser
from typing import Any

_URL_ATTRS = {
    "script": ("src",),
    "link": ("href",),
    "img": ("src", "srcset"),
    "iframe": ("src",),
    "frame": ("src",),
    "embed": ("src",),
    "object": ("data",),
    "source": ("src", "srcset"),
    "video": ("src", "poster"),
    "audio": ("src",),
    "track": ("src",),
    "input": ("src",),
    "image": ("href", "xlink:href"),
    "use": ("href",),
}
_CSS_URL = re.compile(r"url\(\s*['\"]?\s*(?!data:|#)([^'\")\s]+)", re.I)
_CSS_IMPORT = re.compile(r"@import\s+['\"]", re.I)


class _LoadFinder(HTMLParser):
    """Collects every URL the page would load: src/href of loading tags, CSS url() and @import, meta refresh."""

    def __init__(self) -> None:
        super().__init__()
        self.loads: list[str] = []
        self.scripts = 0
        self._in_style = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        values = dict(attrs)
        for attr in _URL_ATTRS.get(tag, ()):
            if values.get(attr):
                self.loads.append(f"{tag}[{attr}]={values[attr]}")
        if tag == "link" and values.get("rel"):
            self.loads.append(f"link rel={values['rel']}")
        if tag == "meta" and (values.get("http-equiv") or "").lower() == "refresh":
            self.loads.append("meta refresh")
        if values.get("style"):
            self.loads.extend(_CSS_URL.findall(values["style"] or ""))
        if tag == "script":
            self.scripts += 1
        self._in_style = tag == "style"

    def handle_endtag(self, tag: str) -> None:
        if tag == "style":
            self._in_style = False

    def handle_data(self, data: str) -> None:
        if self._in_style:
            self.loads.extend(_CSS_URL.findall(data))
            if _CSS_IMPORT.search(data):
                self.loads.append("@import")


def external_loads(page: str) -> list[str]:
    finder = _LoadFinder()
    finder.feed(page)
    return finder.loads


#: A ``Plotly.newPlot`` call of the page's own: on a div named by a string. plotly.js itself holds such calls in its
#: messages (``Plotly.newPlot(gd, data, ...`` in plotly.js 2.27, bundled with plotly 5.18).
PLOTLY_CALL = re.compile(r'Plotly\.newPlot\(\s*"')


def plotly_data(page: str) -> list[dict[str, Any]]:
    """The traces passed to the page's first ``Plotly.newPlot`` call."""
    call = PLOTLY_CALL.search(page)
    assert call, "no Plotly.newPlot call"
    rest = page[call.end() - 1 :]
    rest = rest[rest.index(",") + 1 :].lstrip()
    data, _ = json.JSONDecoder().raw_decode(rest)
    return data


def summary_json(page: str) -> dict[str, Any]:
    found = re.search(r'<script type="application/json" id="memtrace-summary">(.*?)</script>', page, re.S)
    assert found
    return json.loads(found.group(1))
