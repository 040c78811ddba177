"""The in-process profiler: ProfileSession (step boundaries, ledger, timing) and its collectors.
Imports device, trace and patching; never reads a trace back or plans (docs/architecture.md).
"""
