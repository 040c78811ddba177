"""Regenerate the README's screenshot from the committed sample report, with headless Chromium.

    python benchmarks/readme_screenshot.py   # writes docs/images/report-bert-8gib-first-screen.png

Uses the same Chromium driver as the browser test (tests/browser.py).
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from browser import find_chromium, screenshot  # noqa: E402

SAMPLE = ROOT / "sample_reports" / "bert-base-b32-s512-8gib-reprofiled" / "report.html"
IMAGE = ROOT / "docs" / "images" / "report-bert-8gib-first-screen.png"


def main() -> int:
    chromium = find_chromium()
    if chromium is None:
        print("no chromium binary: install Debian's chromium package", file=sys.stderr)
        return 1
    with tempfile.TemporaryDirectory() as work:
        # the report's first screen, in the 1400x900 window the browser test checks it at
        screenshot(chromium, SAMPLE, IMAGE, Path(work), size="1400,900")
    print(f"Wrote {IMAGE.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
