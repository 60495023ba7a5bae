"""`appliance train CONFIG.toml`: build the exact torchrun command and run it.

The library behind `appliance train` (handlers in appliance/train/cli.py): `launch_training` takes
a LaunchSpec and returns a TrainResult. One node: torchrun --standalone on loopback, one process per GPU (NCCL) or CPU processes (gloo).
Many nodes: --nnodes/--node-rank/--rdzv-endpoint with torchrun's c10d rendezvous; node rank 0
hosts the rendezvous store. `slurm_script` writes an sbatch script that runs the same command
under srun. We use torchrun as is: no home-made scheduler.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import shlex
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from appliance import __version__
from appliance.core.errors import ApplianceError, ConfigError, DataError
from appliance.core.manifest import atomic_write_text
from appliance.core.progress import quiet
from appliance.core.values import nproc_problem, shown
from appliance.train.checkpoint_files import check_resume
from appliance.tasks import task_for
from appliance.train import faults, reaper, worker_error
from appliance.train.preflight import check_loopback, interface_address, network_env, split_endpoint
from appliance.train.config import check_data_report, load_config
from data_tools.example import decode_example
from data_tools.index import build_index, read_index_file
from data_tools.tfrecord import read_records
from appliance.train.ddp import prepare_model
from appliance.core.dirlock import directory_lock
from appliance.train.quality import QUALITY_JSON, Thresholds, write_quality, quality_figures
from appliance.core.manifest import MANIFEST_NAME, read_manifest

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


@dataclass(frozen=True)
class TrainResult:
    """What a finished training run produced: its directories and its final validation figures."""

    run_dir: Path
    model_dir: Path
    checkpoints_dir: Path
    metrics_path: Path
    manifest_path: Path
    steps: int
    val_acc: float | None  # top-1 on the validation set at the last evaluation (None without [data] val)
    val_loss: float | None
    val_confusion: tuple | None = None  # [true][predicted] counts at the last evaluation
    class_names: tuple[str, ...] = ()
    quality: dict | None = None  # the quality gate's figures (appliance.train.quality), once judged
    task: dict | None = None  # the model card's [task] (None: classification)

    def judged(self, thresholds) -> "TrainResult":
        """This result with the quality gate's figures for thresholds (a Thresholds); quality stays
        None without a validation pass that recorded its confusion counts."""
        from dataclasses import replace

        if self.val_confusion is None:
            return self
        return replace(self, quality=task_for(self.task).quality(self.val_confusion, self.class_names, thresholds))

    @property
    def out_dir(self) -> Path:
        return self.run_dir

    def figures(self) -> dict:
        return {"run_dir": str(self.run_dir), "model_dir": str(self.model_dir), "steps": self.steps,
                "val_acc": self.val_acc}

    @classmethod
    def load(cls, out_dir: Path) -> "TrainResult":
        """The result of a finished run in out_dir (its run directory): the StageResult contract."""
        return cls.from_run_dir(out_dir)

    @classmethod
    def from_run_dir(cls, run_dir: Path) -> "TrainResult":
        run_dir = Path(run_dir)
        metrics_path = run_dir / METRICS_NAME
        evals = []
        if metrics_path.is_file():
            for line in metrics_path.read_text().splitlines():
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:
                    continue  # a line cut by a kill mid-write
                if isinstance(record, dict) and "val_loss" in record:
                    evals.append(record)
        last = evals[-1] if evals else {}
        confusion = last.get("val_confusion")
        try:
            card = json.loads((run_dir / MODEL_DIR_NAME / "model.json").read_text())
            names, task = card.get("class_names", []), card.get("extra", {}).get("task")
        except (OSError, ValueError, AttributeError):
            names, task = [], None
        return cls(run_dir=run_dir, model_dir=run_dir / MODEL_DIR_NAME, checkpoints_dir=run_dir / "checkpoints",
                   metrics_path=metrics_path, manifest_path=run_dir / MANIFEST_NAME,
                   steps=int(read_manifest(run_dir)["params"].get("steps", 0)),
                   val_acc=last.get("val_acc"), val_loss=last.get("val_loss"),
                   val_confusion=tuple(map(tuple, confusion)) if isinstance(confusion, list) else None,
                   class_names=tuple(map(str, names or ())), task=task if isinstance(task, dict) else None)


METRICS_NAME = "metrics.jsonl"
MODEL_DIR_NAME = "model"


def check_before_start(cfg) -> None:
    """Everything that can be checked before a process starts: the data-check gate, every data
    file opened and frame-checked (its index built, which the workers reuse), and [model] init's
    weights matched against the model."""
    check_data_report(cfg)
    for key, files in (("train", cfg.data.train), ("val", cfg.data.val)):
        for path in files:
            damage = []
            records = len(read_index_file(build_index(path, on_damage=damage.append)))
            if records == 0:
                why = f"{damage[0].reason} at byte {damage[0].start}" if damage else "no record"
                raise DataError(f"{path}: not a TFRecord file ({why}); listed in {cfg.source} [data] {key}")
    if cfg.task.kind == "classification" and cfg.data.train:  # a key no record has: refused before, not by every worker
        first = next(iter(read_records(cfg.data.train[0])), None)
        try:
            features = decode_example(first) if first is not None else {}
        except DataError:  # a damaged record: the worker that reads it names it
            features = {}
        for key in ("image_key", "label_key"):
            if features and getattr(cfg.data, key) not in features:
                raise ConfigError(f"{cfg.source}: [data] {key} {shown(getattr(cfg.data, key))} is no feature of the first "
                                  f"record of {cfg.data.train[0]} (it has {', '.join(map(repr, sorted(features)))})")
    if cfg.model.init:  # weights of another architecture, an unconvertible ONNX operator: one line, no process

        prepare_model(cfg, log=lambda line: None)


def check_nodes(spec: LaunchSpec) -> None:
    """--nnodes, --node-rank and --rdzv-endpoint agree, before a rendezvous waits for nodes that cannot come."""
    if not 0 <= spec.node_rank < spec.nnodes:
        raise ConfigError(f"--node-rank {spec.node_rank} is not a node of --nnodes {spec.nnodes} "
                          f"(ranks 0..{spec.nnodes - 1})")
    if spec.rdzv_endpoint:
        split_endpoint(spec.rdzv_endpoint)


def launch_training(spec: LaunchSpec, *, dry_run: bool = False) -> TrainResult | str:
    """Validate, preflight, then run torchrun to its end on this node. Returns the run's result
    (or, with dry_run, the command line that would run). Raises ApplianceError with one line on
    any failure, a worker's own error line included."""
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
    if dry_run:
        return printable
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
