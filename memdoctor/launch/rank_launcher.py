"""torch's launcher as memdoctor starts it: ``torch.distributed.run``'s own parse and run, unchanged
(its rendezvous, its workers, its tear-down of the others when one fails), with three differences that
keep the terminal memdoctor's:

- its failure summary and traceback (``ChildFailedError``) are left out: which rank failed first and
  why comes from the ranks themselves (``memdoctor.launch.rank_outcome``), and a tear-down is not an
  error of the launcher's;
- its log is kept to errors (``LOGLEVEL``, which some of torch's elastic loggers read when they are
  made, and the level of the others' parent);
- it stops when memdoctor dies (the kernel sends it SIGTERM, on which it tears its workers down).

Started by ``memdoctor.launch.ranks`` as ``python -m memdoctor.launch.rank_launcher TORCHRUN-ARGS``.
"""

from __future__ import annotations

import logging
import os
import signal
import sys

from memdoctor.exitcodes import SIGNAL_BASE
from memdoctor.launch.control import set_parent_death_signal

LAUNCH_FAILED = 1  # the exit code when torch.distributed.run itself failed, or a worker did


def main(argv: list[str]) -> int:
    set_parent_death_signal(signal.SIGTERM)
    previous = os.environ.get("LOGLEVEL")
    os.environ["LOGLEVEL"] = "ERROR"
    try:
        from torch.distributed import run as torchrun
        from torch.distributed.elastic.multiprocessing import SignalException
        from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    except ImportError as exc:  # a torch built without torch.distributed
        print(f"memdoctor: error: this torch has no torch.distributed.run ({exc})", file=sys.stderr)
        return LAUNCH_FAILED

    logging.getLogger("torch.distributed.elastic").setLevel(logging.ERROR)
    # its line per failed worker and per worker it stops: the ranks' own lines say it, and better
    logging.getLogger("torch.distributed.elastic.multiprocessing").setLevel(logging.CRITICAL)
    if previous is None:  # the workers, and the script, see the environment as it was
        del os.environ["LOGLEVEL"]
    else:
        os.environ["LOGLEVEL"] = previous
    try:
        torchrun.run(torchrun.parse_args(argv))
    except ChildFailedError:  # a rank failed: each rank says how, memdoctor which came first
        return LAUNCH_FAILED
    except SignalException as exc:
        return SIGNAL_BASE + int(exc.sigval)
    except Exception as exc:  # the rendezvous or the launch itself: one line, the ranks never ran
        text = " ".join(str(exc).split()) or type(exc).__name__
        print(f"memdoctor: error: torch.distributed.run: {type(exc).__name__}: {text}", file=sys.stderr)
        return LAUNCH_FAILED
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
