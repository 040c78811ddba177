"""Headless Chromium for the report's browser test: load a page, dump its DOM, read its console log.

Debian's ``chromium`` package is driven directly (``--dump-dom``, ``--screenshot``) rather than through
Playwright or Selenium: Playwright's browsers cannot be downloaded here, and the command line is all the
test needs. The browser's log on stderr (``--enable-logging=stderr``) carries every console message
and Content-Security-Policy violation as a ``CONSOLE`` line.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass, field
from html.parser import HTMLParser
from pathlib import Path

TIMEOUT_S = 120
# Chromium's own chatter (no D-Bus in a container, no GPU) is not the page's: only these lines are.
_PAGE_PROBLEM = re.compile(r":CONSOLE[:\(\]]|Uncaught|Content Security Policy|Refused to", re.IGNORECASE)


def find_chromium() -> str | None:
    """``$MEMDOCTOR_CHROMIUM``, else ``chromium`` / ``chromium-browser`` on the PATH, else None."""
    explicit = os.environ.get("MEMDOCTOR_CHROMIUM")
    if explicit:
        return explicit
    for name in ("chromium", "chromium-browser", "/usr/bin/chromium"):
        found = shutil.which(name)
        if found:
            return found
    return None


def _run(chromium: str, page: Path, profile: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    cmd = [
        chromium,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        f"--user-data-dir={profile}",
        "--enable-logging=stderr",
        "--v=0",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-extensions",
        *extra,
        page.resolve().as_uri(),
    ]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S, check=False)


@dataclass
class Loaded:
    """What the browser made of the page: its DOM after load and the page's problems from the log."""

    dom: str
    problems: list[str]
    log: str


def load(chromium: str, page: Path, work: Path) -> Loaded:
    """Open ``page`` headless; the DOM as the browser built it and the log lines the page caused."""
    done = _run(chromium, page, work / "profile-dom", "--dump-dom")
    if done.returncode != 0 or not done.stdout:
        raise RuntimeError(f"chromium failed ({done.returncode}): {done.stderr[-2000:]}")
    problems = [line for line in done.stderr.splitlines() if _PAGE_PROBLEM.search(line)]
    return Loaded(done.stdout, problems, done.stderr)


def screenshot(chromium: str, page: Path, png: Path, work: Path, size: str = "1280,2400") -> Path:
    done = _run(chromium, page, work / "profile-shot", f"--screenshot={png}", f"--window-size={size}")
    if done.returncode != 0 or not png.is_file():
        raise RuntimeError(f"chromium made no screenshot ({done.returncode}): {done.stderr[-2000:]}")
    return png


@dataclass
class DomFacts:
    """The parts of a DOM the test checks: section ids, image sources, anything that would load."""

    h2_ids: list[str] = field(default_factory=list)
    img_srcs: list[str] = field(default_factory=list)
    img_alts: list[str | None] = field(default_factory=list)
    scripts: list[dict[str, str | None]] = field(default_factory=list)
    external: list[str] = field(default_factory=list)  # src/href/srcset/etc. that leave the page


class _Facts(HTMLParser):
    _URL_ATTRS = frozenset({"src", "href", "srcset", "action", "poster", "data", "background"})

    def __init__(self) -> None:
        super().__init__()
        self.facts = DomFacts()

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        if tag == "h2" and a.get("id"):
            self.facts.h2_ids.append(str(a["id"]))
        if tag == "img":
            self.facts.img_srcs.append(a.get("src") or "")
            self.facts.img_alts.append(a.get("alt"))
        if tag == "script":
            self.facts.scripts.append(a)
        for name, value in attrs:
            if name in self._URL_ATTRS and value and not _stays(value):
                self.facts.external.append(f"<{tag} {name}={value[:80]}>")


def _stays(url: str) -> bool:
    """In-page anchors and data: URIs load nothing from elsewhere."""
    return url.startswith(("#", "data:"))


def dom_facts(html: str) -> DomFacts:
    parser = _Facts()
    parser.feed(html)
    return parser.facts


# A measuring copy of a page: the page's own Content-Security-Policy forbids inline script, so the copy
# drops that one <meta> and appends a script that writes the layout into the DOM for --dump-dom to read.
_CSP_META = re.compile(r'<meta http-equiv="Content-Security-Policy"[^>]*>')
_LAYOUT_OUT = re.compile(r'<pre id="memdoctor-layout">(.*?)</pre>', re.S)
_LAYOUT_SCRIPT = """<script>
window.addEventListener("load", () => {
  const box = (el) => { const r = el.getBoundingClientRect();
    return {top: r.top + scrollY, bottom: r.bottom + scrollY, text: el.innerText}; };
  const ids = {};
  for (const el of document.querySelectorAll("[id]")) { ids[el.id] = box(el); }
  const out = document.createElement("pre");
  out.id = "memdoctor-layout";
  out.textContent = JSON.stringify({height: document.documentElement.scrollHeight,
    viewport: innerHeight, ids: ids});
  document.body.appendChild(out);
});
</script></body>"""


@dataclass
class Layout:
    """Where the page's elements sit, in CSS pixels from the top of the page, at one window size."""

    height: int  # the whole page's height (before the measuring element was added)
    viewport: int  # the window's inner height: what the first screen shows
    ids: dict[str, dict[str, object]]  # id -> {top, bottom, text (innerText)}

    def on_first_screen(self, element_id: str) -> bool:
        """The element starts within the first screen (its top above the window's bottom edge)."""
        box = self.ids.get(element_id)
        return box is not None and float(box["top"]) < self.viewport  # type: ignore[arg-type]


def layout(chromium: str, page: Path, work: Path, size: str = "1400,900") -> Layout:
    """Lay ``page`` out at ``size`` (width,height) and return every ``id``'s box and the page height."""
    import json

    html = page.read_text(encoding="utf-8")
    copy = work / f"measure-{page.stem}.html"
    copy.write_text(_CSP_META.sub("", html, count=1).replace("</body>", _LAYOUT_SCRIPT), encoding="utf-8")
    done = _run(
        chromium,
        copy,
        work / "profile-layout",
        "--dump-dom",
        f"--window-size={size}",
        "--virtual-time-budget=5000",
    )
    found = _LAYOUT_OUT.search(done.stdout)
    if done.returncode != 0 or found is None:
        raise RuntimeError(f"chromium laid out nothing ({done.returncode}): {done.stderr[-2000:]}")
    from html import unescape

    data = json.loads(unescape(found.group(1)))
    return Layout(int(data["height"]), int(data["viewport"]), data["ids"])
