"""The ``memdoctor run`` child: the user's script, run to its end as ``python SCRIPT ARGS`` would, with
the plan installed first (``memdoctor.levers.install``).

Started by ``memdoctor run`` as ``python -m memdoctor.launch.run_child`` with its settings in the
environment variable ``MEMDOCTOR_RUN`` (removed before the script runs; the allocator setting is
already in the environment, so CUDA reads it when it starts). Its exit code is the script's; a plan
part that cannot be applied prints one line and exits at once with a ``ConfigError``'s code (2),
before the step it would have changed.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import traceback
from typing import Any

from memdoctor.errors import ConfigError
from memdoctor.exitcodes import INTERRUPTED, SCRIPT_OK, SCRIPT_RAISED
from memdoctor.launch.control import set_parent_death_signal
from memdoctor.launch.leave import leave
from memdoctor.launch.script import exit_code, prepare_sys, run_target, user_tb

ENV_VAR = "MEMDOCTOR_RUN"


def main() -> int:
    cfg = json.loads(os.environ.pop(ENV_VAR))
    set_parent_death_signal(signal.SIGTERM)  # memdoctor run killed: the script does not run on alone
    from memdoctor.levers.install import install, say_stderr

    installation = install(cfg["config"], say=say_stderr, fail=_fail)
    prepare_sys({**cfg, "argv_extra": installation.argv_args()})
    code = _run(cfg)
    installation.finish()
    from memdoctor.levers.owngroup import started_a_group

    if started_a_group():  # parallel's or full_offload's: gloo's threads outlive it (launch/leave.py)
        leave(code)
    return code


def _run(cfg: dict[str, Any]) -> int:
    try:
        run_target(cfg)
    except SystemExit as exc:
        return exit_code(exc.code)
    except KeyboardInterrupt:
        return INTERRUPTED
    except BaseException as exc:  # as python would: the script's traceback, exit code 1
        traceback.print_exception(type(exc), exc, user_tb(exc.__traceback__))
        return SCRIPT_RAISED
    return SCRIPT_OK


def _fail(message: str) -> None:
    """A part of the plan cannot be applied: say which, and stop before it changes anything."""
    sys.stdout.flush()
    print(f"memdoctor: error: {message}", file=sys.stderr, flush=True)
    os._exit(ConfigError.exit_code)


if __name__ == "__main__":
    sys.exit(main())
