"""`appliance train k8s`'s StatefulSet as processes: two pods, each in its own network namespace
(joined by a veth pair, as pods on a cluster network), its own UTS namespace (the pod's host name,
from which the manifest's script takes the node rank) and mount namespace (/etc/hosts naming the
pods as the headless Service's DNS would, the ConfigMap over the config's path, the data read-only,
its own volume over the run directory, a tmpfs /dev/shm), running the container's command with
the container's environment. No Kubernetes API server can run here; this is everything a pod
gets from one that the run depends on. The run trains to the end, a pod killed mid-run and
started again resumes from its own checkpoints, and the weights equal a run started by hand."""

import os
import shlex
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from conftest import VENV_BIN, appliance_cmd, offline_cmd
from appliance.cli import main
from train_data import make_config

DIGEST = "registry.site/appliance@sha256:" + "ab" * 32
TOTAL_STEPS = 8  # 128 records, 2 processes, batch 16, 2 epochs
OPTIONS = dict(train={"epochs": 2}, checkpoint={"every_steps": 3, "keep_last": 2, "keep_best": 1})
pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="network, UTS and mount namespaces need root (ip netns)")


class Cluster:
    """Two pod network namespaces joined by a veth pair, torn down by close()."""

    def __init__(self, name: str):
        self.ns = [f"apl{os.getpid() % 100000}p{i}" for i in (0, 1)]
        self.addresses = ["10.245.0.10", "10.245.0.11"]
        self.hosts = [f"{name}-{i}" for i in (0, 1)]
        for ns in self.ns:
            subprocess.run(["ip", "netns", "add", ns], check=True)
        subprocess.run(["ip", "-n", self.ns[0], "link", "add", "eth0", "type", "veth", "peer", "name", "eth0",
                        "netns", self.ns[1]], check=True)
        for ns, address in zip(self.ns, self.addresses):
            for cmd in (["addr", "add", f"{address}/24", "dev", "eth0"], ["link", "set", "eth0", "up"],
                        ["link", "set", "lo", "up"]):
                subprocess.run(["ip", "-n", ns, *cmd], check=True)
        # What the Service's DNS answers: pod-N.service.namespace.svc.cluster.local and its short forms.
        self.etc_hosts = "127.0.0.1 localhost\n" + "".join(
            f"{a} {h}.{name}.default.svc.cluster.local {h}.{name} {h}\n" for a, h in zip(self.addresses, self.hosts))

    def close(self):
        for ns in self.ns:
            subprocess.run(["ip", "netns", "del", ns], check=False)


def pod_process(cluster, i, container, volumes, workdir, log):
    """Start pod i: its namespaces, its mounts as the manifest says, then the container's command."""
    hosts = workdir / f"hosts-{i}"
    hosts.write_text(cluster.etc_hosts)
    setup = [f"hostname {cluster.hosts[i]}", f"mount --bind {hosts} /etc/hosts"]
    for mount in container["volumeMounts"]:
        path, source = mount["mountPath"], str(volumes[mount["name"]][i])
        if source.startswith("tmpfs:"):  # an emptyDir with medium Memory: tmpfs of its sizeLimit
            setup.append(f"mount -t tmpfs -o size={source[6:].replace('i', '').lower()} tmpfs {path}")
            continue
        setup.append(f"mount --bind {shlex.quote(str(source))} {shlex.quote(path)}")
        if mount.get("readOnly"):
            setup.append(f"mount -o remount,bind,ro {shlex.quote(path)}")
    env = {"PATH": f"{VENV_BIN}:/usr/local/bin:/usr/bin:/bin", "HOME": "/root", "HOSTNAME": cluster.hosts[i],
           **{e["name"]: e["value"] for e in container["env"]}}
    command = " ".join(["exec env -i", *(shlex.quote(f"{k}={v}") for k, v in env.items()),
                        shlex.join(container["command"])])
    return subprocess.Popen(["ip", "netns", "exec", cluster.ns[i], "unshare", "-u", "-m", "--propagation", "private",
                             "sh", "-c", " && ".join(setup) + " && " + command],
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def wait_for(predicate, procs, what, timeout=240):
    deadline = time.time() + timeout
    while not predicate():
        assert time.time() < deadline, f"{what}: not within {timeout} s"
        time.sleep(0.1)


def final_model(run_dir):
    return load_file(Path(run_dir) / "model" / "model.safetensors")


def hand_run(workdir):
    """The same config started by hand: two `appliance train` on loopback, each with its own run directory."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    config = workdir / "k8s.toml"
    configs = []
    for node in (0, 1):
        path = workdir / f"hand{node}" / "k8s.toml"
        path.parent.mkdir()
        text = config.read_text().replace('out_dir = "runs"', f'out_dir = "{workdir}/hand{node}/runs"')
        path.write_text(text.replace('"data/', f'"{workdir}/data/'))
        configs.append(path)
    nodes = [appliance_cmd("train", str(configs[r]), "--nproc-per-node", "1", "--nnodes", "2", "--node-rank", str(r),
                           "--rdzv-endpoint", f"127.0.0.1:{port}") for r in (0, 1)]
    script = f"{shlex.join(nodes[0])} & n0=$!; {shlex.join(nodes[1])}; r1=$?; wait $n0; exit $(($? | r1))"
    proc = subprocess.run(offline_cmd(["sh", "-c", script], loopback=True), capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return final_model(workdir / "hand0" / "runs" / "k8s")


@pytest.mark.slow  # two 2-node trainings (by hand, then the pods with one restart)
def test_two_pods_train_survive_a_killed_pod_and_match_a_run_by_hand(tmp_path):
    config = make_config(tmp_path, name="k8s", train_records=128, **OPTIONS)
    reference = hand_run(tmp_path)  # also builds the data's .index files, which a read-only volume must hold
    out = tmp_path / "manifests"
    assert main(["train", "k8s", str(config), "--nodes", "2", "--image", DIGEST, "--out", str(out),
                 "--data-host-path", "/srv/data", "--max-restarts", "1", "--cpu-request", "1"]) == 0
    sts = yaml.safe_load((out / "statefulset.yaml").read_text())
    container = sts["spec"]["template"]["spec"]["containers"][0]
    configmap = yaml.safe_load((out / "configmap.yaml").read_text())
    (tmp_path / "configmap-train.toml").write_text(configmap["data"]["train.toml"])
    run_dir = next(m["mountPath"] for m in container["volumeMounts"] if m["name"] == "run")
    Path(run_dir).mkdir(parents=True)  # the mount point; each pod's volume goes over it
    claims = [tmp_path / f"pvc-run-{i}" for i in (0, 1)]
    for claim in claims:
        claim.mkdir()
    data_dir = next(m["mountPath"] for m in container["volumeMounts"] if m["name"] == "data")
    shm = next(v for v in sts["spec"]["template"]["spec"]["volumes"] if v["name"] == "shm")["emptyDir"]
    assert shm["medium"] == "Memory"
    volumes = {"config": [tmp_path / "configmap-train.toml"] * 2, "data": [data_dir] * 2, "run": claims,
               "shm": [f"tmpfs:{shm['sizeLimit']}"] * 2}
    cluster = Cluster(sts["spec"]["serviceName"])
    logs = [open(tmp_path / f"pod-{i}.log", "ab") for i in (0, 1)]
    text = [lambda i=i: (tmp_path / f"pod-{i}.log").read_text(errors="replace") for i in (0, 1)]
    pods = []
    try:
        pods = [pod_process(cluster, i, container, volumes, tmp_path, logs[i]) for i in (0, 1)]
        committed = claims[1] / "checkpoints" / "step-00000003" / "COMMITTED"
        wait_for(committed.is_file, pods, "pod 1's first checkpoint")
        os.killpg(pods[1].pid, signal.SIGKILL)  # the node is lost: the pod's whole process tree at once
        pods[1].wait()
        pods[1] = pod_process(cluster, 1, container, volumes, tmp_path, logs[1])  # the StatefulSet makes it again
        done = "training exited with status"
        wait_for(lambda: all(done in t() for t in text), pods, "both pods' training")
        for pod in pods:  # kubectl delete: SIGTERM to the container; the pod that stayed up exits
            pod.send_signal(signal.SIGTERM)
            assert pod.wait(timeout=30) == 0
    finally:
        for pod in pods:  # what a container's end does: every process left in it goes (`sleep infinity`)
            try:
                os.killpg(pod.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for log in logs:
            log.close()
        cluster.close()
    logs = [t() for t in text]
    assert all("training exited with status 0" in log for log in logs), logs[1][-3000:]
    # `appliance doctor --k8s` ran first in each pod and saw what the pod gives it.
    assert all("ready to train" in log and "data volume" in log and ": read-only" in log for log in logs), logs[0][:3000]
    assert "k8s-1 (k8s-1.k8s.default.svc.cluster.local -> 10.245.0.11)" in logs[1], logs[1][:3000]
    assert "resumed from " in logs[0] + logs[1], logs[1][-3000:]
    for claim in claims:  # each pod's own volume holds its own part of every checkpoint
        newest = sorted((claim / "checkpoints").glob("step-*"))[-1]
        assert newest.name == f"step-{TOTAL_STEPS:08d}" and (newest / "COMMITTED").is_file()
    models = [final_model(claim) for claim in claims]
    for key, value in reference.items():
        assert torch.equal(models[0][key], value) and torch.equal(models[1][key], value), f"{key} differs"
