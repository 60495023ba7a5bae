"""`appliance train CONFIG.toml`: build the exact torchrun command and run it.

One node: torchrun --standalone on loopback, one process per GPU (NCCL) or CPU processes (gloo).
Many nodes: --nnodes/--node-rank/--rdzv-endpoint with torchrun's c10d rendezvous; node rank 0
hosts the rendezvous store. `appliance train slurm CONFIG --nodes N` writes an sbatch script
that runs the same command under srun. We use torchrun as is: no home-made scheduler.
"""

from __future__ import annotations

import datetime as _dt
import os
import shlex
import signal
import subprocess
import sys
from pathlib import Path

from appliance import values
from appliance import __version__
from appliance.errors import ConfigError

LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")


def gpu_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def resolve_nproc(value: str) -> int:
    """'auto' is one process per GPU, or one CPU process (it uses every core) without a GPU."""
    if value == "auto":
        return gpu_count() or 1
    try:
        n = int(value)
    except ValueError:
        n = 0
    if n < 1:
        raise ConfigError(f"--nproc-per-node must be 'auto' or a positive integer, got {value!r}")
    return n


def torchrun_command(config: str, *, nproc: int | str, nnodes: int = 1, node_rank: int | None = 0,
                     rdzv_endpoint: str = "", rdzv_id: str = "appliance", max_restarts: int = 0,
                     resume: str = "auto", python: str = sys.executable) -> list[str]:
    """The torchrun argv. node_rank None leaves the rendezvous host to c10d (Slurm)."""
    cmd = [python, "-m", "torch.distributed.run"]
    if nnodes == 1 and not rdzv_endpoint:
        # --standalone: a private c10d store on a free localhost port; nothing listens outside.
        cmd += ["--standalone", "--local-addr", "127.0.0.1"]
    else:
        if not rdzv_endpoint:
            raise ConfigError("--nnodes > 1 needs --rdzv-endpoint HOST:PORT (the node with --node-rank 0)")
        cmd += ["--nnodes", str(nnodes), "--rdzv-backend", "c10d", "--rdzv-endpoint", rdzv_endpoint,
                "--rdzv-id", rdzv_id]
        if node_rank is not None:
            cmd += ["--rdzv-conf", f"is_host={int(node_rank == 0)}"]
        if rdzv_endpoint.rsplit(":", 1)[0].strip("[]") in LOOPBACK_HOSTS:
            cmd += ["--local-addr", "127.0.0.1"]
    cmd += ["--nproc-per-node", str(nproc), "--max-restarts", str(max_restarts),
            "-m", "appliance.train.loop", str(config), "--resume", resume]
    return cmd


def launch_env(cmd: list[str], nproc: int) -> dict[str, str]:
    """Environment changes for the workers (shown by --dry-run as VAR=value prefixes)."""
    env = {}
    if "TORCH_DISABLE_SHARE_RDZV_TCP_STORE" not in os.environ:
        # Workers sharing the agent's rendezvous store read the previous attempt's addresses
        # after an elastic restart and fail to connect (pytorch/pytorch#135712).
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    if "--local-addr" in cmd and "GLOO_SOCKET_IFNAME" not in os.environ:
        env["GLOO_SOCKET_IFNAME"] = "lo"  # gloo would otherwise pick the interface of the hostname
    if "OMP_NUM_THREADS" not in os.environ and not gpu_count():
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // nproc))  # no oversubscription
    return env


def _run_torchrun(cmd: list[str], env: dict) -> tuple[int, str]:
    """Run torchrun to its end, even when we are signalled: (exit status, signal name or "")."""
    proc = subprocess.Popen(cmd, env=env)
    received = []

    def on_signal(signum, frame):
        received.append(signal.Signals(signum).name)
        # Ctrl-C already reached torchrun and the workers (one process group); a SIGTERM sent
        # to us alone is passed on. The workers stop at a step boundary and save a checkpoint.
        if signum == signal.SIGTERM:
            proc.send_signal(signal.SIGTERM)

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        returncode = proc.wait()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    return returncode, (received[0] if received else "")


def run(args) -> int:
    from appliance.train.config import check_data_report, load_config

    if args.config[0] == "slurm":
        return write_slurm(args)
    if len(args.config) != 1:
        raise ConfigError(f"expected one CONFIG.toml, got {' '.join(args.config)}")
    config = args.config[0]
    cfg = load_config(config)  # fail here, with one line, rather than in every worker
    check_data_report(cfg)
    nproc = resolve_nproc(args.nproc_per_node)
    cmd = torchrun_command(str(Path(config).resolve()), nproc=nproc, nnodes=args.nnodes,
                           node_rank=args.node_rank, rdzv_endpoint=args.rdzv_endpoint, rdzv_id=cfg.run.name,
                           max_restarts=args.max_restarts, resume=args.resume)
    env = launch_env(cmd, nproc)
    printable = " ".join([*(f"{k}={v}" for k, v in env.items()), shlex.join(cmd)])
    if args.dry_run:
        print(printable)
        return 0
    from appliance.dirlock import directory_lock
    from appliance.train import worker_error

    # One run per run directory, for the run's life: two would kill each other mid-save and mix
    # their checkpoints. The kernel drops the lock when this process dies.
    # The nodes of one run may share the directory (a shared filesystem): one lock per node rank.
    lock_name = ".lock" if args.nnodes == 1 else f".lock-node{args.node_rank}"
    with directory_lock(cfg.run_dir, "run directory", lock_name):
        worker_error.clear(cfg.run_dir)
        print(f"appliance train: {printable}", file=sys.stderr, flush=True)
        returncode, stopped_by = _run_torchrun(cmd, {**os.environ, **env})
    if stopped_by:
        print(f"appliance train: stopped by {stopped_by}; the workers saved a checkpoint in "
              f"{cfg.run_dir / 'checkpoints'}: run the same command to resume", file=sys.stderr)
        return 128 + getattr(signal, stopped_by)
    if returncode != 0:
        print(f"appliance train: error: training failed (torchrun exit status {returncode}); "
              f"the log above names the failing rank. Checkpoints: {cfg.run_dir / 'checkpoints'}",
              file=sys.stderr)
        return 1
    return 0


def write_slurm(args) -> int:
    from appliance.train.config import load_config

    if len(args.config) != 2:
        raise ConfigError("usage: appliance train slurm CONFIG.toml --nodes N")
    config = str(Path(args.config[1]).resolve())
    cfg = load_config(config)
    nproc = args.nproc_per_node
    if nproc == "auto":
        nproc = "$SLURM_GPUS_ON_NODE" if args.gpus_per_node else "1"
    cmd = torchrun_command(config, nproc=nproc, nnodes=args.nodes, node_rank=None,
                           rdzv_endpoint="$head_node:29500", rdzv_id="$SLURM_JOB_ID",
                           max_restarts=args.max_restarts, resume="auto")
    # Variables are filled in by the shell on each node, so they get double quotes.
    line = " ".join(f'"{c}"' if "$" in c else shlex.quote(c) for c in cmd)
    out = Path(args.out) if args.out else cfg.run_dir / "train.sbatch"
    out.parent.mkdir(parents=True, exist_ok=True)
    gpus = f"#SBATCH --gpus-per-node={args.gpus_per_node}\n" if args.gpus_per_node else ""
    script = (
        "#!/bin/bash\n"
        f"# Generated by appliance {__version__} `appliance train slurm {args.config[1]} --nodes {args.nodes}`\n"
        f"# on {_dt.datetime.now(_dt.timezone.utc).isoformat(timespec='seconds')}. Submit: sbatch {out}\n"
        f"#SBATCH --job-name={cfg.run.name}\n"
        f"#SBATCH --nodes={args.nodes}\n"
        "#SBATCH --ntasks-per-node=1\n"
        f"{gpus}"
        f"#SBATCH --output={cfg.run_dir}/slurm-%j.out\n"
        "set -euo pipefail\n"
        "export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1  # elastic restarts work (pytorch/pytorch#135712)\n"
        "# Node 1 of the allocation hosts the c10d rendezvous; torchrun on every node finds it there.\n"
        'head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)\n'
        f"srun {line}\n"
    )
    out.write_text(script)
    out.chmod(0o755)
    print(out)
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "train", help="train a model from a TOML config with torchrun (DDP), resumable",
        description="Train with torchrun: `appliance train CONFIG.toml` on this machine, or with "
        "--nnodes/--node-rank/--rdzv-endpoint on several. `appliance train slurm CONFIG.toml --nodes N` "
        "writes an sbatch script instead.")
    p.add_argument("config", nargs="+", metavar="[slurm] CONFIG.toml", help="the training config")
    p.add_argument("--nproc-per-node", default="auto", help="processes on this node: N or auto "
                   "(one per GPU; one CPU process without a GPU)")
    p.add_argument("--nnodes", type=values.positive_int, default=1, help="number of machines (default 1: standalone)")
    p.add_argument("--node-rank", type=values.non_negative_int, default=0, help="this machine's rank; rank 0 hosts the rendezvous")
    p.add_argument("--rdzv-endpoint", default="", help="HOST:PORT of node rank 0 (c10d rendezvous)")
    p.add_argument("--max-restarts", type=values.non_negative_int, default=0,
                   help="restart all workers this many times after a failure; each restart resumes "
                   "from the newest good checkpoint")
    p.add_argument("--resume", default="auto", help="auto (newest good checkpoint), none, or a checkpoint directory")
    p.add_argument("--dry-run", action="store_true", help="print the torchrun command and exit")
    p.add_argument("--nodes", type=values.positive_int, default=1, help="slurm: number of nodes")
    p.add_argument("--gpus-per-node", type=values.non_negative_int, default=0, help="slurm: GPUs per node (0: CPU)")
    p.add_argument("--out", default="", help="slurm: script path (default RUN_DIR/train.sbatch)")
    p.set_defaults(func=run)
