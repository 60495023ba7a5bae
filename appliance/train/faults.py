"""Fault injection for the resume tests: a real SIGKILL at a named point of a real run.

APPLIANCE_TRAIN_FAULT="POINT:STEP:RANK" kills rank RANK with SIGKILL when it reaches POINT at
optimizer step STEP, on the first attempt only (torchrun's restart count 0), so the elastic
restart that follows runs clean. Points: "step" (after the optimizer step) and
"checkpoint-write" (own files written, checkpoint not yet committed). Unset: does nothing.
"""

from __future__ import annotations

import os
import signal

_SPEC = os.environ.get("APPLIANCE_TRAIN_FAULT", "")


def maybe_die(point: str, step: int, rank: int) -> None:
    if not _SPEC or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return
    want_point, want_step, want_rank = _SPEC.split(":")
    if point == want_point and step == int(want_step) and rank == int(want_rank):
        os.kill(os.getpid(), signal.SIGKILL)
