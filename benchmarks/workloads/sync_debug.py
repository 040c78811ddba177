"""Run another workload script with ``torch.cuda.set_sync_debug_mode("warn")`` and log the Python stack
of every host-device synchronisation it triggers (one JSON line each, to the file named by the
environment variable SYNC_LOG), so that benchmarks/sync_check.py can tell memdoctor's syncs from the
script's own:

    SYNC_LOG=/tmp/syncs.jsonl memdoctor profile benchmarks/workloads/sync_debug.py -- \
        benchmarks/workloads/bert_story.py --steps 12
"""

from __future__ import annotations

import json
import os
import runpy
import sys
import traceback
import warnings

import torch

_log = open(os.environ["SYNC_LOG"], "a", encoding="utf-8")  # noqa: SIM115 (open for the whole run)
_show = warnings.showwarning


def _record(message, category, filename, lineno, file=None, line=None):  # type: ignore[no-untyped-def]
    if "synchroniz" not in str(message).lower():
        return _show(message, category, filename, lineno, file, line)
    stack = [f"{f.filename}:{f.lineno}:{f.name}" for f in traceback.extract_stack()[:-1]]
    _log.write(json.dumps({"message": str(message)[:160], "stack": stack}) + "\n")
    _log.flush()
    return None


warnings.showwarning = _record
warnings.simplefilter("always")
torch.cuda.set_sync_debug_mode("warn")
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
