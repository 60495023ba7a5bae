"""`appliance train slurm`'s script under a real Slurm: Debian's slurm-wlm and munge (installed by
`installer/bootstrap.sh --system`), a one-host cluster (munged, slurmctld, slurmd as root) configured
in a temporary directory, inside its own network, UTS and mount namespaces (offline, its own host
name, nothing it listens on seen outside). The script is submitted with `sbatch --wait`; the run
finishes with its checkpoints and the same weights as the same config started by hand.

One host is one Slurm node (Debian's slurmd is not built for several daemons on one host), so the
job runs one node; several nodes are what tests/train/test_multinode.py covers. This proves the
script, the environment Slurm gives it (SLURM_JOB_NODELIST, the head node's name) and torchrun
under srun."""

import os
import shutil
import signal
import subprocess
import tempfile
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import appliance_cmd, offline_cmd
from train_data import make_config

DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "sinfo")
HOST = "applslurm"  # the namespace's host name: the Slurm node and the rendezvous host
# Slurm's daemons bind through getaddrinfo(AI_ADDRCONFIG), which finds nothing with loopback alone:
# the node gets an address on a veth pair inside its namespace.
ADDRESS = "10.246.0.1"


def cluster_script(workdir, job_script) -> str:
    """A shell script: start munge and Slurm in workdir, submit job_script, wait, stop the daemons."""
    conf = workdir / "slurm.conf"
    conf.write_text(textwrap.dedent(f"""\
        ClusterName=appliance
        SlurmctldHost={HOST}
        AuthType=auth/munge
        AuthInfo=socket={workdir}/munge.sock
        CredType=cred/munge
        SlurmUser=root
        SlurmdUser=root
        StateSaveLocation={workdir}/state
        SlurmdSpoolDir={workdir}/spool
        SlurmctldPidFile={workdir}/slurmctld.pid
        SlurmdPidFile={workdir}/slurmd.pid
        SlurmctldLogFile={workdir}/slurmctld.log
        SlurmdLogFile={workdir}/slurmd.log
        ProctrackType=proctrack/linuxproc
        TaskPlugin=task/none
        JobAcctGatherType=jobacct_gather/none
        SelectType=select/cons_tres
        SelectTypeParameters=CR_Core
        ReturnToService=2
        MpiDefault=none
        NodeName={HOST} CPUs={os.cpu_count()} RealMemory=1000 State=UNKNOWN
        PartitionName=main Nodes={HOST} Default=YES MaxTime=INFINITE State=UP
        """))
    (workdir / "hosts").write_text(f"127.0.0.1 localhost\n{ADDRESS} {HOST}\n")
    for d in ("state", "spool"):
        (workdir / d).mkdir()
    key = workdir / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    w = str(workdir)
    return textwrap.dedent(f"""\
        set -u
        ip link set lo up && ip link add eth0 type veth peer name eth1 && ip addr add {ADDRESS}/24 dev eth0 \
          && ip link set eth0 up && ip link set eth1 up || exit 89
        hostname {HOST} && mount --bind {w}/hosts /etc/hosts || exit 90
        export SLURM_CONF={conf}
        stop() {{ for f in slurmd slurmctld munged; do [ -f {w}/$f.pid ] && kill $(cat {w}/$f.pid) 2>/dev/null; done; }}
        trap stop EXIT
        munged --key-file={key} --socket={w}/munge.sock --pid-file={w}/munged.pid --log-file={w}/munged.log \\
          --seed-file={w}/munge.seed -f || exit 91
        slurmctld -f {conf} && slurmd -f {conf} || exit 92
        for i in $(seq 100); do timeout 5 sinfo -h -o %T 2>/dev/null | grep -qx idle && break; sleep 0.2; done
        timeout 5 sinfo -h -o %T | grep -qx idle || {{ echo "the node never became idle"; exit 93; }}
        timeout 240 sbatch --wait {job_script}
        """)


@pytest.fixture(scope="module")
def slurm():
    missing = [d for d in DAEMONS if shutil.which(d) is None]
    if missing:
        pytest.fail(f"{', '.join(missing)} missing: run installer/bootstrap.sh --system (slurm-wlm, munge)")
    if os.geteuid() != 0:
        pytest.skip("slurmd runs jobs as their users and needs root; this test runs as an unprivileged user")


@pytest.mark.slow  # a one-host Slurm starts in seconds; two short trainings
def test_sbatch_runs_the_generated_script_to_the_same_weights_as_by_hand(tmp_path, slurm, request):
    options = dict(train={"epochs": 1}, checkpoint={"every_steps": 5, "keep_last": 2, "keep_best": 1})
    config = make_config(tmp_path, name="slurm", train_records=128, **options)
    hand = tmp_path / "hand.toml"
    hand.write_text(config.read_text().replace('out_dir = "runs"', 'out_dir = "hand"'))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # both runs: the same arithmetic
    proc = subprocess.run(offline_cmd(appliance_cmd("train", str(hand), "--nproc-per-node", "1"), loopback=True),
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]

    script = tmp_path / "train.sbatch"
    proc = subprocess.run(appliance_cmd("train", "slurm", str(config), "--nodes", "1", "--out", str(script)),
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    # Slurm's and munge's Unix sockets live under this folder: pytest's tmp_path (popen-gw0/test_.../) made
    # slurmstepd's socket path 116 bytes, past the 108 a sockaddr_un holds, and the job never started.
    slurm_dir = Path(tempfile.mkdtemp(prefix="slurm-", dir="/tmp"))
    request.addfinalizer(lambda: shutil.rmtree(slurm_dir, ignore_errors=True))
    body = cluster_script(slurm_dir, script)
    cmd = ["unshare", "-n", "-u", "-m", "--propagation", "private", "sh", "-c", body]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    finally:  # the daemons outlive a killed shell: stop them by their pid files
        for pid_file in slurm_dir.glob("*.pid"):
            try:
                os.kill(int(pid_file.read_text()), signal.SIGTERM)
            except (ValueError, ProcessLookupError):
                pass
    run_dir = tmp_path / "runs" / "slurm"
    job_logs = "".join(p.read_text(errors="replace")[-3000:] for p in run_dir.glob("slurm-*.out"))
    daemon_logs = "".join((slurm_dir / f).read_text()[-1500:] for f in ("slurmctld.log", "slurmd.log")
                          if (slurm_dir / f).is_file())
    assert proc.returncode == 0, f"{proc.stdout}{proc.stderr}\n{job_logs}\n{daemon_logs}"
    assert "Submitted batch job" in proc.stdout
    steps = sorted(p.name for p in (run_dir / "checkpoints").glob("step-*"))
    assert steps[-1] == "step-00000008" and (run_dir / "checkpoints" / steps[-1] / "COMMITTED").is_file(), steps
    mine, theirs = (load_file(d / "model" / "model.safetensors") for d in (run_dir, tmp_path / "hand" / "slurm"))
    assert mine.keys() == theirs.keys()
    for key in mine:
        assert torch.equal(mine[key], theirs[key]), f"{key} differs"
