"""A configurator in the shape of nanoGPT's ``configurator.py``, written for memdoctor's corpus.

A training script runs it with ``exec(open(...).read())`` after setting its defaults as module-level
globals: each ``--name=value`` entry of ``sys.argv`` overrides the global ``name`` with a value of the
same type (a path without ``--`` is a config file of assignments, run over the same globals). No
argparse: nothing but the script's globals says which knobs exist.
"""

import sys
from ast import literal_eval

for _arg in sys.argv[1:]:
    if not _arg.startswith("--"):
        with open(_arg) as _f:
            exec(_f.read())
        continue
    _key, _, _val = _arg[2:].partition("=")
    if _key not in globals():
        raise ValueError(f"unknown config key: {_key}")
    try:
        _attempt = literal_eval(_val)
    except (SyntaxError, ValueError):
        _attempt = _val
    if type(_attempt) is not type(globals()[_key]):
        raise TypeError(f"{_key}: {_attempt!r} is not a {type(globals()[_key]).__name__}")
    print(f"Overriding: {_key} = {_attempt}")
    globals()[_key] = _attempt
