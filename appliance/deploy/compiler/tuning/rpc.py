"""`appliance compile --tune N --rpc HOST:PORT`: MetaSchedule candidates timed on a device over TVM's RPC.

The device runs the RPC server of its own TVM wheel (`python -m tvm.exec.rpc_server --host 0.0.0.0
--port 9090`; TVM_USE_RUNTIME_LIB=1 makes it start in seconds on a small board). No tracker: this
host connects to the server directly (tvm.rpc.connect), uploads each candidate as a shared
library built here (cross-compiled for ARM), and times it there with the runtime's time_evaluator.
MetaSchedule's own RPCRunner needs a tracker and a pool of worker processes that each import TVM.
"""

from __future__ import annotations

import itertools
import os
import socket
from pathlib import Path

import numpy as np

from tvm.ir.utils import derived_object
from tvm.s_tir.meta_schedule.runner import EvaluatorConfig, PyRunner
from tvm.s_tir.meta_schedule.runner.local_runner import LocalRunnerFuture
from tvm.s_tir.meta_schedule.runner.utils import alloc_argument_common, run_evaluator_common

from appliance.core.errors import DataError, EnvironmentProblem

SERVER_COMMAND = "python3 -m tvm.exec.rpc_server --host 0.0.0.0 --port 9090"


def parse_address(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise DataError(f"--rpc {text}: expected HOST:PORT of a TVM RPC server, e.g. 192.168.1.20:9090")
    return host, int(port)


def connect(address: str, key: str = ""):
    """A session with the RPC server; one line when it cannot be reached."""
    from tvm import rpc

    host, port = parse_address(address)
    try:  # tvm.rpc.connect waits on a refused port for a minute; a plain socket says so at once
        socket.create_connection((host, port), timeout=10).close()
        return rpc.connect(host, port, key=key)
    except Exception as err:  # OSError, or whatever TVM raises for a failed handshake
        reason = (err.strerror if isinstance(err, OSError) and err.strerror
                  else (str(err).strip().splitlines() or [type(err).__name__])[-1])
        raise EnvironmentProblem(f"--rpc {address}: cannot reach a TVM RPC server ({reason}); start one on the "
                                 f"device with `{SERVER_COMMAND}`") from None


def remote_cores(session) -> int:
    """The threads the device's TVM runtime uses (its cores): MetaSchedule's num-cores for the target."""
    return int(session.get_function("runtime.NumThreads")())


@derived_object
class RPCDeviceRunner(PyRunner):
    """Times each built kernel on the RPC server's CPU (random inputs, the mean of 3 runs, >= 20 ms)."""

    def __init__(self, address: str, key: str = "") -> None:
        super().__init__()
        self.address, self.key = address, key
        self.config = EvaluatorConfig(number=3, repeat=1, min_repeat_ms=20, enable_cpu_cache_flush=False)
        self.measured = 0  # candidates timed on the device: the database header records it
        self.names = itertools.count()
        self.lost: EnvironmentProblem | None = None  # why the server could not be reached mid-search

    def run(self, runner_inputs):
        try:
            session = connect(self.address, self.key)
        except EnvironmentProblem as err:  # the device went away: tune() raises it once the search stops
            self.lost = self.lost or err
            return [LocalRunnerFuture(res=None, error_message=str(err)) for _ in runner_inputs]
        try:
            fill = session.get_function("tvm.contrib.random.random_fill_for_measure")
        except Exception:  # AttributeError, or TVM's own error for a missing function
            fill = None
        if fill is None:  # a runtime-only server (TVM_USE_RUNTIME_LIB=1) has no random module
            rng = np.random.default_rng(0)

            def fill(arg):
                dtype = np.dtype(str(arg.dtype))
                values = (rng.integers(-64, 64, arg.shape) if dtype.kind in "iu" else rng.uniform(-1, 1, arg.shape))
                arg.copyfrom(values.astype(dtype))

        device = session.cpu(0)
        futures = []
        for item in runner_inputs:
            name = f"{os.getpid()}-{next(self.names)}-{Path(item.artifact_path).name}"
            try:
                session.upload(item.artifact_path, name)
                module = session.load_module(name)
                args = alloc_argument_common(fill, device, [a.as_json() for a in item.args_info], 1)
                futures.append(LocalRunnerFuture(res=run_evaluator_common(module, device, self.config, args)))
                self.measured += 1
            except Exception as err:  # a candidate that fails on the device is a measured failure
                futures.append(LocalRunnerFuture(res=None, error_message=f"{type(err).__name__}: {err}"))
            finally:
                try:
                    session.remove(name)
                except Exception:
                    pass
        return futures
