"""The ``memdoctor run`` child: the user's script, run to its end as ``python SCRIPT ARGS`` would, with
the plan installed first (``memdoctor.levers.install``).

Started by ``memdoctor run`` as ``python -m memdoctor.launch.run_child`` with its settings in the
environment variable ``MEMDOCTOR_RUN`` (removed before the script runs; the allocator setting is
already in the environment, so CUDA reads it when it starts). Its exit code is the script's; a plan
part that cannot be applied prints one line and exits 2 at once, before the step it would have
changed.
"""

from __future__ import annotations

import json
import os
import runpy
import sys
import traceback

from memdoctor.launch.profile_child import _exit_code, _prepare_sys, _run_script, _user_tb

ENV_VAR = "MEMDOCTOR_RUN"
EXIT_CONFIG = 2  # memdoctor.errors.ConfigError's exit code


def main() -> int:
    cfg = json.loads(os.environ.pop(ENV_VAR))
    from memdoctor.levers.install import install, say_stderr

    installation = install(cfg["config"], say=say_stderr, fail=_fail)
    _prepare_sys(cfg)
    code = _run(cfg)
    installation.finish()
    return code


def _run(cfg: dict[str, object]) -> int:
    try:
        if cfg.get("module"):
            runpy.run_module(str(cfg["module"]), run_name="__main__", alter_sys=True)
        else:
            _run_script(str(cfg["script"]))
    except SystemExit as exc:
        return _exit_code(exc.code)
    except KeyboardInterrupt:
        return 130
    except BaseException as exc:  # as python would: the script's traceback, exit code 1
        traceback.print_exception(type(exc), exc, _user_tb(exc.__traceback__))
        return 1
    return 0


def _fail(message: str) -> None:
    """A part of the plan cannot be applied: say which, and stop before it changes anything."""
    sys.stdout.flush()
    print(f"memdoctor: error: {message}", file=sys.stderr, flush=True)
    os._exit(EXIT_CONFIG)


if __name__ == "__main__":
    sys.exit(main())
