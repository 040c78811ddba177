"""Where the code that allocated a tensor is: the first Python frame outside PyTorch and memdoctor.

The saved-tensors hook asks this for the tensors saved outside every child module (the root module's own
forward code, the training loop's loss), which no module's figures hold; the peak ledger
(``memdoctor.capture.history``) names its temporaries the same way (``file.py:LINE (function)``), so the
two can be matched by site. Only called for those tensors: a stack walk of a few microseconds, never on
the per-module hot path.
"""

from __future__ import annotations

import os
import sys

import torch

_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
# memdoctor's own frames (its hooks, a lever's forward wrapper) are not the allocating code either.
_OWN_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
UNKNOWN = "(no Python frame)"


def caller_site() -> str:
    """``file.py:LINE (function)`` of the innermost frame outside PyTorch and memdoctor."""
    frame = sys._getframe(1)
    while frame is not None:
        path = frame.f_code.co_filename
        if not path.startswith((_TORCH_DIR, _OWN_DIR, "<frozen")):
            return f"{os.path.basename(path)}:{frame.f_lineno} ({frame.f_code.co_name})"
        frame = frame.f_back  # type: ignore[assignment]
    return UNKNOWN
