"""The what-if model (workload, memory, time), the planner for a named budget, the rules and the nine-grid.
Imports analysis and trace; pure data, never draws or writes files (docs/architecture.md, docs/planner.md).
"""

from __future__ import annotations
