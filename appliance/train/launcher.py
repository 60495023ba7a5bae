"""`appliance train CONFIG.toml`: build the exact torchrun command and run it.

The library behind `appliance train` (handlers in appliance/train/cli.py): `launch_training` takes
a LaunchSpec and returns a TrainResult. One node: torchrun --standalone on loopback, one process per GPU (NCCL) or CPU processes (gloo).
Many nodes: --nnodes/--node-rank/--rdzv-endpoint with torchrun's c10d rendezvous; node rank 0
hosts the rendezvous store. `slurm_script` writes an sbatch script that runs the same command
under srun. We use torchrun as is: no home-made scheduler.
"""

from __future__ import annotations

import datetime as _dt
import os
import shlex
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from appliance import __version__
from appliance.core.errors import ApplianceError, ConfigError
from appliance.core.manifest import atomic_write_text
from appliance.core.progress import quiet
from appliance.core.values import nproc_problem
from appliance.train.checkpoint_files import check_resume
from appliance.train import faults, reaper, worker_error
from appliance.train.preflight import check_loopback, interface_address, network_env, split_endpoint
from appliance.train.config import load_config
from appliance.train.start_checks import check_before_start
from appliance.core.dirlock import directory_lock
from appliance.train.quality import QUALITY_JSON, Thresholds, write_quality
from appliance.train.result import TrainResult  # noqa: F401 (what launch_training returns)

LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")
FINISHED = worker_error.FINISHED_NAME


def gpu_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def resolve_nproc(value: str) -> int:
    """'auto' is one process per GPU, or one CPU process (it uses every core) without a GPU."""
    problem = nproc_problem(value)
    if problem:
        raise ConfigError(f"--nproc-per-node {problem}")
    return gpu_count() or 1 if value == "auto" else int(value)


def check_nproc_fits(nproc: int, gpus: int) -> None:
    """One process per GPU: more processes than the GPUs this machine shows is a ConfigError (NCCL
    refuses two ranks on one device, deep inside torchrun). Without a GPU (gpus == 0) the processes
    train on the CPU with gloo, any number of them."""
    if gpus and nproc > gpus:
        raise ConfigError(f"--nproc-per-node {nproc} is more than the {gpus} GPU{'s' if gpus > 1 else ''} of this "
                          f"machine (one process per GPU): use --nproc-per-node {gpus} or auto")


def torchrun_command(config: str, *, nproc: int | str, nnodes: int = 1, node_rank: int | None = 0,
                     rdzv_endpoint: str = "", rdzv_id: str = "appliance", max_restarts: int = 0,
                     resume: str = "auto", python: str = sys.executable, local_addr: str = "",
                     min_nnodes: int = 0, profile: int | None = None) -> list[str]:
    """The torchrun argv. node_rank None leaves the rendezvous host to c10d (Slurm); local_addr is
    the address this node binds and advertises (from --iface), instead of its hostname's;
    min_nnodes below nnodes is torchrun's elastic --nnodes MIN:MAX; profile: --profile STEPS for the workers."""
    cmd = [python, "-m", "appliance.train.agent"]  # torchrun, without its traceback
    if nnodes == 1 and not rdzv_endpoint:
        # --standalone: a private c10d store on a free localhost port; nothing listens outside.
        cmd += ["--standalone", "--local-addr", local_addr or "127.0.0.1"]
    else:
        if not rdzv_endpoint:
            raise ConfigError("--nnodes > 1 needs --rdzv-endpoint HOST:PORT (the node with --node-rank 0)")
        span = f"{min_nnodes}:{nnodes}" if 0 < min_nnodes < nnodes else str(nnodes)
        cmd += ["--nnodes", span, "--rdzv-backend", "c10d", "--rdzv-endpoint", rdzv_endpoint,
                "--rdzv-id", rdzv_id]
        if node_rank is not None:
            cmd += ["--rdzv-conf", f"is_host={int(node_rank == 0)}"]
        if local_addr:
            cmd += ["--local-addr", local_addr]
        elif rdzv_endpoint.rsplit(":", 1)[0].strip("[]") in LOOPBACK_HOSTS:
            cmd += ["--local-addr", "127.0.0.1"]
    cmd += ["--nproc-per-node", str(nproc), "--max-restarts", str(max_restarts),
            "-m", "appliance.train.loop", str(config), "--resume", resume]
    if profile is not None:
        cmd += ["--profile", str(profile)]
    return cmd


def launch_env(cmd: list[str], nproc: int, network: dict[str, str] | None = None) -> dict[str, str]:
    """Environment changes for the workers (shown by --dry-run as VAR=value prefixes). network:
    the site's choices ([distributed] env, the interface from --iface); the caller's own
    environment wins over them."""
    env = {k: v for k, v in (network or {}).items() if k not in os.environ}
    if "TORCH_DISABLE_SHARE_RDZV_TCP_STORE" not in os.environ:
        # Workers sharing the agent's rendezvous store read the previous attempt's addresses
        # after an elastic restart and fail to connect (pytorch/pytorch#135712).
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    if "--local-addr" in cmd and "GLOO_SOCKET_IFNAME" not in os.environ and "GLOO_SOCKET_IFNAME" not in env:
        env["GLOO_SOCKET_IFNAME"] = "lo"  # gloo would otherwise pick the interface of the hostname
    if "OMP_NUM_THREADS" not in os.environ and not gpu_count():
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // nproc))  # no oversubscription
    return env


def _run_torchrun(cmd: list[str], env: dict, pass_fds=(), finished: Path | None = None,
                  marker: tuple[str, str] | None = None) -> tuple[int, str, list[str]]:
    """Run torchrun to its end, even when we are signalled: (exit status, signal name or "", the
    processes of the run killed for hanging after `finished` appeared or for outliving torchrun).
    marker: (NAME, VALUE) in the environment of every process of this run (reaper.py)."""
    late_hang_s = faults.late_hang_seconds()  # a malformed test hook is one line before anything starts
    reaper.become_subreaper()
    proc = subprocess.Popen(cmd, env=env, pass_fds=pass_fds)
    received = []

    def on_signal(signum, frame):
        received.append(signal.Signals(signum).name)
        # Ctrl-C already reached torchrun and the workers (one process group); a SIGTERM sent
        # to us alone is passed on. The workers stop at a step boundary and save a checkpoint.
        if signum == signal.SIGTERM:
            proc.send_signal(signal.SIGTERM)

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        if finished is None or marker is None:
            returncode, hung = proc.wait(), []
        else:
            hung = reaper.wait_finished(proc, finished, marker, late_hang_s)
            returncode = proc.returncode
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    if marker is not None:
        hung += reaper.kill_run(marker)  # a loader worker stuck after its rank left holds our stdout
    return returncode, (received[0] if received else ""), hung


@dataclass(frozen=True)
class LaunchSpec:
    """How to start training on this node: what `appliance train` flags say, typed."""

    config: Path
    nproc_per_node: str = "auto"
    nnodes: int = 1
    min_nnodes: int = 0  # below nnodes: elastic, torchrun's --nnodes MIN:MAX
    node_rank: int = 0
    rdzv_endpoint: str = ""
    max_restarts: int = 0
    resume: str = "auto"
    iface: str = ""  # overrides [distributed] iface
    profile: int | None = None  # steps to profile; overrides [profile] steps




def check_nodes(spec: LaunchSpec) -> None:
    """--nnodes, --node-rank and --rdzv-endpoint agree, before a rendezvous waits for nodes that cannot come."""
    if not 0 <= spec.node_rank < spec.nnodes:
        raise ConfigError(f"--node-rank {spec.node_rank} is not a node of --nnodes {spec.nnodes} "
                          f"(ranks 0..{spec.nnodes - 1})")
    if spec.rdzv_endpoint:
        split_endpoint(spec.rdzv_endpoint)


def launch_command(spec: LaunchSpec) -> str:
    """The command line (environment first) that launch_training would run, after every check a real
    start makes (`appliance train --dry-run`)."""
    return _prepared(spec)[3]


def _prepared(spec: LaunchSpec):
    """(config, torchrun command, environment, printable line), validated and preflighted."""
    config = Path(spec.config)
    cfg = load_config(config)  # fail here, with one line, rather than in every worker
    nproc = resolve_nproc(spec.nproc_per_node)
    check_nproc_fits(nproc, gpu_count())  # before torchrun starts
    if spec.max_restarts < 0:
        raise ConfigError(f"--max-restarts must be 0 or more, got {spec.max_restarts}")
    check_nodes(spec)
    check_resume(spec.resume)
    iface = spec.iface or cfg.distributed.iface
    try:
        local_addr = interface_address(iface) if iface else ""
    except ConfigError as err:  # named as the user gave it: the flag, or the config's key
        raise ConfigError(f"--iface: {err}" if spec.iface else f"{cfg.source}: [distributed] iface: {err}") from None
    cmd = torchrun_command(str(config.resolve()), nproc=nproc, nnodes=spec.nnodes, node_rank=spec.node_rank,
                           rdzv_endpoint=spec.rdzv_endpoint, rdzv_id=cfg.run.name,
                           max_restarts=spec.max_restarts, resume=spec.resume, min_nnodes=spec.min_nnodes,
                           local_addr=local_addr, profile=spec.profile)
    env = launch_env(cmd, nproc, network_env(iface, cfg.distributed.env))
    printable = " ".join([*(f"{k}={v}" for k, v in env.items()), shlex.join(cmd)])
    check_before_start(cfg)  # --dry-run too: it promises what a real start would accept
    return cfg, cmd, env, printable


def launch_training(spec: LaunchSpec) -> TrainResult:
    """Validate, preflight, then run torchrun to its end on this node: the run's result. Raises
    ApplianceError with one line on any failure, a worker's own error line included."""
    cfg, cmd, env, printable = _prepared(spec)
    if "--standalone" in cmd or "127.0.0.1" in cmd:  # the rendezvous runs over loopback
        check_loopback()

    # One run per run directory, for the run's life: two would kill each other mid-save and mix
    # their checkpoints. The kernel drops the lock when the last holder dies; torchrun holds it
    # too (pass_fds), so a `kill -9` of this process leaves the directory locked while training goes on.
    # The nodes of one run may share the directory (a shared filesystem): one lock per node rank.
    lock_name = ".lock" if spec.nnodes == 1 else f".lock-node{spec.node_rank}"
    with directory_lock(cfg.run_dir, "run directory", lock_name) as lock:
        worker_error.clear(cfg.run_dir)
        finished = cfg.run_dir / FINISHED
        finished.unlink(missing_ok=True)
        if not quiet():
            print(f"appliance train: {printable}", file=sys.stderr, flush=True)
        error_file = cfg.run_dir / worker_error.FILE_NAME
        marker = (worker_error.LAUNCHER_ENV, str(error_file))  # this run's processes carry it
        returncode, stopped_by, hung = _run_torchrun(cmd, {**os.environ, **env, marker[0]: marker[1]},
                                                     pass_fds=(lock.fd,), finished=finished, marker=marker)
    if stopped_by:
        raise Interrupted(f"stopped by {stopped_by}; the workers saved a checkpoint in "
                          f"{cfg.run_dir / 'checkpoints'}: run the same command to resume",
                          exit_code=128 + getattr(signal, stopped_by))
    if (returncode != 0 or hung) and finished.is_file() and not worker_error.read(cfg.run_dir):
        # Every rank had committed the model and the manifest: the run is done, whatever came after.
        what = (f"{', '.join(hung)} hung while shutting down and {'was' if len(hung) == 1 else 'were'} killed"
                if hung else f"a worker {_exit_words(returncode)} while shutting down")
        print(f"appliance train: warning: the run finished (model and manifest committed), then {what}; "
              f"the results in {cfg.run_dir} are complete", file=sys.stderr, flush=True)
        returncode = 0
    if returncode != 0:
        line = worker_error.read(cfg.run_dir)
        if line:
            raise ApplianceError(line)
        if returncode > 128 and returncode - 128 in signal.valid_signals():
            name = signal.Signals(returncode - 128).name
            hint = " (the kernel's out-of-memory killer sends it: see `dmesg`)" if name == "SIGKILL" else ""
            raise ApplianceError(f"training failed: a worker was killed by {name}{hint}; the log above names its "
                                 f"rank (exitcode: -{returncode - 128}). Checkpoints: {cfg.run_dir / 'checkpoints'}")
        raise ApplianceError(f"training failed (torchrun exit status {returncode}); the log above names the "
                             f"failing rank. Checkpoints: {cfg.run_dir / 'checkpoints'}")
    result = TrainResult.from_run_dir(cfg.run_dir)
    return judge(result, cfg.train)


def _exit_words(returncode: int) -> str:
    if returncode > 128 and returncode - 128 in signal.valid_signals():
        return f"was killed by {signal.Signals(returncode - 128).name}"
    return f"exited with status {returncode} (torchrun's)"


def judge(result: TrainResult, train_section) -> TrainResult:
    """The result with its quality-gate figures, also written to RUN_DIR/quality.json (the training
    report of the gate); raising GateFailed is the caller's choice (`appliance train`, the pipeline)."""
    result = result.judged(Thresholds.of(train_section))
    if result.quality is not None:
        write_quality(result.run_dir / QUALITY_JSON, str(result.run_dir), result.quality)
    return result


class Interrupted(ApplianceError):
    """Training stopped by a signal; the workers checkpointed. exit_code follows the shell (128 + signal)."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


def slurm_script(config: Path, *, nodes: int, gpus_per_node: int = 0, nproc_per_node: str = "auto",
                 max_restarts: int = 0, profile: int | None = None, out: Path | None = None) -> Path:
    """Write an sbatch script that runs this launcher's torchrun command on `nodes` nodes under srun
    (profile: --profile STEPS for the workers, as `appliance train --profile`)."""
    cfg = load_config(config)  # first: a loop of links is its one line, not resolve()'s RuntimeError
    config = Path(config).resolve()
    if nodes < 1 or gpus_per_node < 0 or max_restarts < 0:
        raise ConfigError("--nodes must be at least 1, --gpus-per-node and --max-restarts 0 or more")
    nproc = nproc_per_node
    if nproc == "auto":
        nproc = "$SLURM_GPUS_ON_NODE" if gpus_per_node else "1"
    cmd = torchrun_command(str(config), nproc=nproc, nnodes=nodes, node_rank=None,
                           rdzv_endpoint="$head_node:29500", rdzv_id="$SLURM_JOB_ID",
                           max_restarts=max_restarts, resume="auto", profile=profile)
    # Variables are filled in by the shell on each node, so they get double quotes.
    line = " ".join(f'"{c}"' if "$" in c else shlex.quote(c) for c in cmd)
    out = Path(out) if out else cfg.run_dir / "train.sbatch"
    out.parent.mkdir(parents=True, exist_ok=True)
    # Slurm opens --output before the script runs: without the directory the job dies unstarted.
    Path(cfg.run_dir).mkdir(parents=True, exist_ok=True)
    gpus = f"#SBATCH --gpus-per-node={gpus_per_node}\n" if gpus_per_node else ""
    profiling = "" if profile is None else f" --profile {profile}"
    script = (
        "#!/bin/bash\n"
        f"# Generated by appliance {__version__} `appliance train slurm {config} --nodes {nodes}{profiling}`\n"
        f"# on {_dt.datetime.now(_dt.timezone.utc).isoformat(timespec='seconds')}. Submit: sbatch {out}\n"
        f"#SBATCH --job-name={cfg.run.name}\n"
        f"#SBATCH --nodes={nodes}\n"
        "#SBATCH --ntasks-per-node=1\n"
        f"{gpus}"
        f"#SBATCH --output={cfg.run_dir}/slurm-%j.out\n"
        "set -euo pipefail\n"
        "export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1  # elastic restarts work (pytorch/pytorch#135712)\n"
        "# Node 1 of the allocation hosts the c10d rendezvous; torchrun on every node finds it there.\n"
        'head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)\n'
        f"srun {line}\n"
    )
    atomic_write_text(out, script)
    out.chmod(0o755)
    return out
