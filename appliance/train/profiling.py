"""`--profile [STEPS]` / `[profile]`: torch.profiler over a window of optimizer steps after warm-up,
and where each step's time went.

The loop wraps its phases in `profiler.phase(name)`. Off (the default) that is one shared no-op
context: no profiler, no record_function, no synchronisation. On, each phase is a record_function
range in the trace; in the window's active steps it is also timed on the host clock, and on CUDA
the phase ends with a synchronisation so its time includes its kernels (the window then shows
no overlap between phases, which is what a split of the step needs). Communication that overlaps
compute (DDP's gradient all-reduce during backward) is taken from the profiler's own events:
only the part of it during which no compute ran counts as all-reduce time, and is taken out of
the phase it happened in. Whatever the phases do not cover (logging, the per-step stop/NaN
agreement, Python between phases) is "other", so the shares add up to the measured step time.

Nothing here touches RNG streams, the data order or the step count: a profiled run trains the
same weights as an unprofiled one.
"""

from __future__ import annotations

import contextlib
import os
import resource
import time
from pathlib import Path

import torch

PHASES = ("data_wait", "h2d_copy", "forward", "backward", "optimizer", "allreduce", "checkpoint", "validation",
          "other")
PHASE_WORDS = {"data_wait": "data wait", "h2d_copy": "host-to-device copy", "forward": "forward",
               "backward": "backward", "optimizer": "optimizer", "allreduce": "gradient all-reduce (exposed)",
               "checkpoint": "checkpointing", "validation": "validation", "other": "other"}
TIMED = ("data_wait", "h2d_copy", "forward", "backward", "optimizer", "checkpoint", "validation")
RANGE_PREFIX = "appliance/"
TRACE_DIR = "profile"  # under RUN_DIR/tb: `tensorboard --logdir RUN_DIR/tb` shows it as the run "profile"


class _Off:
    """Profiling off: every call does nothing."""

    enabled = False
    _none = contextlib.nullcontext()

    def phase(self, name: str):
        return self._none

    def step_done(self, step: int) -> dict | None:
        return None

    def close(self) -> None:
        pass


OFF = _Off()


def window(steps: int, wait: int, warmup: int, remaining: int) -> tuple[int, int, int]:
    """(wait, warmup, active) shrunk to fit the steps this attempt has left: active first, then warmup, then wait."""
    active = min(steps, remaining)
    warmup = min(warmup, remaining - active)
    wait = min(wait, remaining - active - warmup)
    return wait, warmup, active


def _is_comm(name: str) -> bool:
    n = name.lower()
    return "nccl" in n or n.startswith("gloo:") or n.startswith("c10d::") or "allreduce" in n or "all_reduce" in n


class StepProfiler:
    """torch.profiler with schedule(wait, warmup, active) stepped once per optimizer step; phase timing
    in the active steps. step_done returns this rank's summary once, right after the window."""

    enabled = True

    def __init__(self, device: torch.device, wait: int, warmup: int, active: int, first_step: int,
                 trace_dir: Path, rank: int, top_operators: int = 15):
        from torch.profiler import ProfilerActivity, profile, schedule

        self.device, self.rank, self.top_operators = device, rank, top_operators
        self.wait, self.warmup, self.active, self.first_step = wait, warmup, active, first_step
        self.trace_dir = Path(trace_dir)
        self.k = 0  # steps done since the profiler started
        self.phase_s = dict.fromkeys(TIMED, 0.0)
        self.step_s: list[float] = []
        self.trace_path: Path | None = None
        self.summary: dict | None = None
        activities = [ProfilerActivity.CPU]
        if device.type == "cuda":
            activities.append(ProfilerActivity.CUDA)
        else:
            # Without a GPU, Kineto logs "ERROR: gpuGetDeviceCount failed" for nothing, and at its top
            # level (5, USDT) "profiler_start"/"profiler_stop" per rank: 6 is above every level. On a GPU
            # its errors (CUPTI permissions) matter and stay. A user's own setting wins.
            os.environ.setdefault("KINETO_LOG_LEVEL", "6")
        self.activities = [a.name for a in activities]
        self._prof = profile(activities=activities, schedule=schedule(wait=wait, warmup=warmup, active=active, repeat=1),
                             on_trace_ready=self._trace_ready, record_shapes=False, profile_memory=False,
                             with_stack=False)
        self._prof.start()
        self._running = True
        self._last = time.perf_counter()

    @property
    def recording(self) -> bool:
        return self._running and self.wait + self.warmup <= self.k < self.wait + self.warmup + self.active

    @contextlib.contextmanager
    def phase(self, name: str):
        if not self._running:
            yield
            return
        timed = self.recording
        start = time.perf_counter()
        with torch.profiler.record_function(RANGE_PREFIX + name):
            try:
                yield
            finally:
                if timed and self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)  # the phase's kernels belong to the phase
        if timed:
            self.phase_s[name] += time.perf_counter() - start

    def step_done(self, step: int) -> dict | None:
        """Called by every rank after each optimizer step (all ranks at the same steps)."""
        if not self._running:
            return None
        now = time.perf_counter()
        if self.recording:
            self.step_s.append(now - self._last)
        self.k += 1
        self._prof.step()  # after the last active step: _trace_ready runs here
        self._last = time.perf_counter()  # the trace export is not part of the next step
        if self.k >= self.wait + self.warmup + self.active:
            self._stop()
            return self.summary
        return None

    def close(self) -> None:
        """The run ended (or stopped) before the window did: no summary."""
        if self._running:
            self._stop()

    def _stop(self) -> None:
        self._running = False
        self._prof.stop()

    def _trace_ready(self, prof) -> None:
        self.trace_dir.mkdir(parents=True, exist_ok=True)
        # tensorboard_trace_handler's layout and name (<worker>.<time>.pt.trace.json), which
        # TensorBoard's profiler plugin and Perfetto (ui.perfetto.dev, offline build) both open.
        self.trace_path = self.trace_dir / f"rank{self.rank}.{int(time.time() * 1000)}.pt.trace.json"
        prof.export_chrome_trace(str(self.trace_path))
        self.summary = self._summarise(prof)

    def _summarise(self, prof) -> dict:
        events = list(prof.events())
        exposed, comm_total = exposed_communication(events, cuda=self.device.type == "cuda")
        phases = dict(self.phase_s)
        allreduce = 0.0
        for name in ("forward", "backward"):
            taken = min(exposed.get(name, 0.0), phases[name])
            phases[name] -= taken
            allreduce += taken
        phases["allreduce"] = allreduce
        total = sum(self.step_s)
        phases["other"] = max(total - sum(phases.values()), 0.0)
        return {"rank": self.rank, "device": str(self.device), "activities": self.activities,
                "steps": [self.first_step + self.wait + self.warmup + 1,
                          self.first_step + self.wait + self.warmup + self.active],
                "step_s": self.step_s, "total_s": total, "phase_s": phases,
                "communication_s": comm_total, "top_operators": top_operators(prof, self.device, self.top_operators),
                "memory": peak_memory(self.device), "trace": str(self.trace_path)}


# ---- from the profiler's events -------------------------------------------------------------------

def _merge(intervals) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for start, end in sorted(intervals):
        if end <= start:
            continue
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return [(a, b) for a, b in out]


def _intersect(a, b) -> list[tuple[float, float]]:
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if start < end:
            out.append((start, end))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def _subtract(a, b) -> list[tuple[float, float]]:
    """a minus b, both merged."""
    out, j = [], 0
    for start, end in a:
        while j < len(b) and b[j][1] <= start:
            j += 1
        k, cursor = j, start
        while k < len(b) and b[k][0] < end:
            if b[k][0] > cursor:
                out.append((cursor, b[k][0]))
            cursor = max(cursor, b[k][1])
            k += 1
        if cursor < end:
            out.append((cursor, end))
    return out


def _length(intervals) -> float:
    return sum(b - a for a, b in intervals)


def exposed_communication(events, cuda: bool) -> tuple[dict[str, float], float]:
    """({phase: seconds of communication inside that phase's ranges while no compute ran}, seconds
    of communication in all, hidden or not).

    CPU (gloo): communication is the c10d/gloo events on any thread; compute is what the phase's
    own thread runs meanwhile. CUDA (NCCL): communication is the NCCL kernels, compute every other
    kernel or copy."""
    ranges: dict[str, list] = {}
    main_threads = set()
    for e in events:
        if e.name.startswith(RANGE_PREFIX) and e.device_type == torch.autograd.DeviceType.CPU:
            ranges.setdefault(e.name[len(RANGE_PREFIX):], []).append((e.time_range.start, e.time_range.end))
            main_threads.add(e.thread)
    if cuda:
        device = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
        comm = _merge((e.time_range.start, e.time_range.end) for e in device if "nccl" in e.name.lower())
        compute = _merge((e.time_range.start, e.time_range.end) for e in device if "nccl" not in e.name.lower())
    else:
        cpu = [e for e in events if e.device_type == torch.autograd.DeviceType.CPU]
        comm = _merge((e.time_range.start, e.time_range.end) for e in cpu if _is_comm(e.name))
        compute = _merge((e.time_range.start, e.time_range.end) for e in cpu
                         if e.thread in main_threads and not _is_comm(e.name)
                         and not e.name.startswith((RANGE_PREFIX, "ProfilerStep")))
    exposed = {name: _length(_subtract(_intersect(comm, _merge(spans)), compute)) / 1e6
               for name, spans in ranges.items()}
    return exposed, _length(comm) / 1e6


def top_operators(prof, device: torch.device, n: int) -> list[dict]:
    """The n operators with the most self time (CUDA time on a GPU, else CPU time), our ranges left out."""
    rows = []
    for avg in prof.key_averages():
        if avg.key.startswith((RANGE_PREFIX, "ProfilerStep")):
            continue
        rows.append({"name": avg.key, "calls": int(avg.count), "self_cpu_ms": avg.self_cpu_time_total / 1e3,
                     "self_cuda_ms": getattr(avg, "self_device_time_total", 0.0) / 1e3 if device.type == "cuda" else None})
    key = "self_cuda_ms" if device.type == "cuda" else "self_cpu_ms"
    rows.sort(key=lambda r: -(r[key] or 0.0))
    return rows[:n]


def peak_memory(device: torch.device) -> dict:
    """Peak since the process started: CUDA memory allocated by tensors (and the device's size), or the process's RSS."""
    if device.type == "cuda":
        return {"kind": "cuda_allocated", "peak_mb": torch.cuda.max_memory_allocated(device) / 2**20,
                "reserved_mb": torch.cuda.max_memory_reserved(device) / 2**20,
                "device_total_mb": torch.cuda.get_device_properties(device).total_memory / 2**20}
    return {"kind": "rss", "peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "device_total_mb": None}
