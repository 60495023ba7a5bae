"""In-process builder, runner and progress lines for MetaSchedule tuning (see tune.py for why)."""

from __future__ import annotations

import itertools
import tempfile
import time
from pathlib import Path

import tvm
from tvm.ir.utils import derived_object
from tvm.s_tir.meta_schedule.builder import BuilderResult, PyBuilder
from tvm.s_tir.meta_schedule.measure_callback import PyMeasureCallback
from tvm.s_tir.meta_schedule.runner import EvaluatorConfig, PyRunner
from tvm.s_tir.meta_schedule.runner.local_runner import LocalRunnerFuture, default_alloc_argument
from tvm.s_tir.meta_schedule.runner.utils import run_evaluator_common


@derived_object
class InProcessBuilder(PyBuilder):
    """Builds each candidate kernel here, as MetaSchedule's default_build does, into work_dir.

    shared_library: a .so (linked with cross_compiler when given) that a device loads over RPC
    without a compiler of its own; otherwise a tar of objects that this host links when loading."""

    def __init__(self, work_dir, shared_library: bool = False, cross_compiler: str | None = None) -> None:
        super().__init__()
        self.work_dir = Path(work_dir)
        self.work_dir.mkdir(parents=True, exist_ok=True)
        self.counter = itertools.count()
        self.shared_library, self.cross_compiler = shared_library, cross_compiler

    def build(self, build_inputs):
        from tvm.s_tir.transform import RemoveWeightLayoutRewriteBlock
        from tvm.support.tar import tar

        results = []
        for item in build_inputs:
            try:
                mod = RemoveWeightLayoutRewriteBlock(skip_tensor_rewrite=True)(item.mod)
                # MetaSchedule's RemoveBuildArtifact deletes the artifact's whole folder: one each
                folder = tempfile.mkdtemp(prefix=f"candidate{next(self.counter)}-", dir=self.work_dir)
                built = tvm.compile(mod, target=item.target)
                if self.shared_library:
                    path = str(Path(folder) / "kernel.so")
                    if self.cross_compiler:
                        from tvm.support.cc import cross_compiler

                        built.export_library(path, fcompile=cross_compiler(self.cross_compiler))
                    else:
                        built.export_library(path)
                else:
                    path = str(Path(folder) / f"kernel.{tar.output_format}")
                    built.export_library(path, fcompile=tar)
                results.append(BuilderResult(path, None))
            except Exception as err:  # a candidate that does not build is a measured failure, not a crash
                results.append(BuilderResult(None, f"{type(err).__name__}: {err}"))
        return results


@derived_object
class InProcessRunner(PyRunner):
    """Times each built kernel on this CPU (random inputs, the mean of 3 runs, >= 20 ms)."""

    def __init__(self) -> None:
        super().__init__()
        self.config = EvaluatorConfig(number=3, repeat=1, min_repeat_ms=20, enable_cpu_cache_flush=False)

    def run(self, runner_inputs):
        futures = []
        for item in runner_inputs:
            try:
                module = tvm.runtime.load_module(item.artifact_path)
                device = tvm.cpu()
                args = default_alloc_argument(device, [a.as_json() for a in item.args_info], 1)
                futures.append(LocalRunnerFuture(res=run_evaluator_common(module, device, self.config, args)))
            except Exception as err:
                futures.append(LocalRunnerFuture(res=None, error_message=f"{type(err).__name__}: {err}"))
        return futures


def progress_callback(task_names: list[str], trials: int, start: float, log):
    """A measure callback printing tasks done / total, trials measured, elapsed and ETA."""

    @derived_object
    class Progress(PyMeasureCallback):
        def __init__(self) -> None:
            super().__init__()
            self.measured = dict.fromkeys(range(len(task_names)), 0)
            self.done: set[int] = set()
            self.last = None

        def apply(self, task_scheduler, task_id, measure_candidates, builder_results, runner_results):
            asked = min(trials - self.measured[task_id], 32)
            self.measured[task_id] += len(measure_candidates)
            if self.measured[task_id] >= trials or len(measure_candidates) < asked:
                self.done.add(task_id)  # enough trials, or the search space had no more
            total = trials * len(task_names)
            count = sum(min(m, trials) for m in self.measured.values())
            count = max(count, total - sum(trials - min(self.measured[t], trials) for t in range(len(task_names))
                                           if t not in self.done))
            if (count, len(self.done)) == self.last:
                return  # a task whose search space is spent is asked again; nothing new to say
            self.last = (count, len(self.done))
            elapsed = time.perf_counter() - start
            eta = elapsed / max(count, 1) * (total - count)
            log(f"tuning: tasks done {len(self.done)}/{len(task_names)}, trials {count}/{total}, "
                f"elapsed {elapsed:.0f} s, ETA {eta:.0f} s ({task_names[task_id]})")

    return Progress()
