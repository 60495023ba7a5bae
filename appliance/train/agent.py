"""torchrun, unchanged, minus its stack trace on a worker failure: `python -m appliance.train.agent ARGS`.

Takes exactly torchrun's arguments and runs torch.distributed.run's own `run`. When a worker fails,
torchrun raises ChildFailedError and prints ~30 lines (its traceback and a failure table) after
the worker has already printed its one-line error; here the agent exits with the worker's
status instead, and the launcher prints one line (the worker's, from RUN_DIR/.worker-error).
"""

from __future__ import annotations

import logging
import os
import sys

from appliance.train.worker_error import FINAL_NAME, LAUNCHER_ENV


def main(argv: list[str] | None = None) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    args = parse_args(sys.argv[1:] if argv is None else argv)
    _stop_signal_once()
    _signalled_worker_first()
    _no_restart_after_a_final_error()
    # A logger's own filters see the records made on it: the failure line is made on this one.
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").addFilter(_NoFailureTables())
    try:
        run(args)
    except ChildFailedError as err:
        _, failure = err.get_first_failure()
        if isinstance(failure.exitcode, int) and failure.exitcode < 0:
            return 128 - failure.exitcode  # killed by a signal: the shell's 128 + N, for the launcher's line
        return failure.exitcode if isinstance(failure.exitcode, int) and failure.exitcode > 0 else 1
    except SignalException as err:  # SIGTERM/SIGINT: torchrun has already stopped the workers (they checkpointed)
        return 128 + int(err.sigval)
    return 0


def _stop_signal_once() -> None:
    """torchrun turns SIGTERM/SIGINT into a SignalException, and then stops its workers (they save a
    checkpoint). A stop often comes twice: `kill` of the job's process group reaches the agent, and
    `appliance train` passes its own SIGTERM on. A second exception raised while the workers are being
    stopped cut into that shutdown (seen: a logging traceback in the middle of it), so only the first
    signal raises; the rest are ignored until the agent exits (SIGKILL still ends it)."""
    from torch.distributed.elastic.multiprocessing import api

    first = api._terminate_process_handler  # installed by name when the workers start, so this is what runs
    raised = []

    def once(signum, frame):
        if not raised:
            raised.append(signum)
            first(signum, frame)

    api._terminate_process_handler = once


def _signalled_worker_first() -> None:
    """A worker killed by a signal (SIGKILL from the kernel's out-of-memory killer, most often) is the
    cause when it fails together with its peers, who then fail in a collective ("Connection reset
    by peer"). torchrun names the failure with the earliest timestamp as the first, in whole
    seconds, and a worker that wrote no error file gets the time torchrun noticed it: so it
    named a peer, at random. Here a worker that died of a signal before torchrun stopped the
    group counts as the earliest. Private torch API: with another torch, torchrun's choice stays."""
    from torch.distributed.elastic.multiprocessing import api

    context = getattr(api, "SubprocessContext", None)
    capture, close = (getattr(context, name, None) for name in ("_capture_process_failures", "close"))
    if capture is None or close is None:
        return

    def capture_signalled_first(self, done_local_ranks):
        capture(self, done_local_ranks)
        if getattr(self, "_appliance_closing", False):
            return  # the SIGTERMs torchrun sends while it stops the group are effects, not causes
        for failure in self._failures.values():
            if isinstance(failure.exitcode, int) and failure.exitcode < 0 and not os.path.isfile(failure.error_file):
                failure.timestamp = 0

    def close_marked(self, *args, **kwargs):
        self._appliance_closing = True
        return close(self, *args, **kwargs)

    context._capture_process_failures = capture_signalled_first
    context.close = close_marked


def _no_restart_after_a_final_error() -> None:
    """--max-restarts restarts the workers after a crash; a worker that stopped on a bad record or a bad
    config (its line is final, worker_error.FINAL_NAME) would stop the same way each time, so a
    segmentation run with a damaged mask printed its line after three restarts. While that marker exists
    the agent's remaining restarts read 0: it stops at once. Private torch API
    (SimpleElasticAgent._remaining_restarts): with another torch, restarts stay as torchrun makes them."""
    from torch.distributed.elastic.agent.server import api

    said = os.environ.get(LAUNCHER_ENV, "")
    agent = getattr(api, "SimpleElasticAgent", None)
    if not said or agent is None:
        return
    final = os.path.join(os.path.dirname(said), FINAL_NAME)

    def remaining(self) -> int:
        return 0 if os.path.exists(final) else self.__dict__.get("_appliance_remaining_restarts", 0)

    def set_remaining(self, value: int) -> None:
        self.__dict__["_appliance_remaining_restarts"] = value

    agent._remaining_restarts = property(remaining, set_remaining)


class _NoFailureTables(logging.Filter):
    """Drop the agent's failure records (the failed rank; SIGTERM sent to the others) when a worker has already said why in one line (its
    .worker-error file exists); a worker killed by a signal still shows as `exitcode: -9`."""

    def filter(self, record: logging.LogRecord) -> bool:
        said = os.environ.get(LAUNCHER_ENV, "")
        return not (said and os.path.exists(said) and record.levelno >= logging.WARNING
                    and any(m in record.getMessage() for m in ("failed (exitcode", "Sending process")))


if __name__ == "__main__":
    sys.exit(main())
