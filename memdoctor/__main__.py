"""``python -m memdoctor``: the same as the ``memdoctor`` command."""

from __future__ import annotations

from memdoctor.cli import main_entry

if __name__ == "__main__":
    main_entry()
