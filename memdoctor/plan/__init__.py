"""The doctor: a what-if memory and time model calibrated from a trace, a planner for a named budget,
rules with evidence, and the nine-grid. Pure analysis (no torch): it reads a trace and its summary.

See ``docs/planner.md`` for what is modelled, every assumption, and what is not done yet.
"""

from __future__ import annotations
