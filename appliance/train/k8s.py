"""`appliance train k8s CONFIG --nodes N --image REF@sha256:... --out DIR`: Kubernetes manifests
for one multi-node run.

Each pod runs `appliance train` (this launcher: the checks, the run-directory lock, SIGTERM passed
to torchrun so the workers checkpoint) with `--nnodes N --node-rank RANK --rdzv-endpoint HOST:PORT`,
the same torchrun command `appliance train` runs by hand. RANK comes from the pod: a StatefulSet's
ordinal (the end of its hostname), an indexed Job's JOB_COMPLETION_INDEX, Kubeflow Trainer's
PET_NODE_RANK; HOST is pod 0's stable DNS name behind the headless Service. The config travels in
a ConfigMap mounted at its own absolute path, the data read-only at its own directory, and each
pod's run directory on its own storage, so every path in the config means in the pod what it
means on this machine. The YAML is written by appliance.core.yamltext (deterministic bytes).
"""

from __future__ import annotations

import os
import re
import shlex
from dataclasses import dataclass, field, replace
from pathlib import Path

from appliance import __version__
from appliance.core.errors import ConfigError
from appliance.core.manifest import atomic_write_text
from appliance.core.values import shown
from appliance.core.yamltext import dump_all
from appliance.train.config import load_config
from appliance.train.k8s_readme import readme
from appliance.train.k8s_resources import PodResources, memory_bytes

KINDS = ("statefulset", "indexed-job", "trainjob")
PORT = 29500  # c10d rendezvous on pod 0
CONTAINER = "node"  # Kubeflow Trainer's torch runtimes name their trainer container "node"
_DIGEST = re.compile(r"[^@\s]+@sha256:[0-9a-f]{64}")
_OBJECT = re.compile(r"[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?")  # a DNS subdomain: claims, classes, runtimes
_NAME = re.compile(r"[a-z]([-a-z0-9]{0,38}[a-z0-9])?")
LABEL = "appliance.example/run"


@dataclass(frozen=True)
class K8sSpec:
    """What `appliance train k8s` flags say, typed."""

    config: Path
    nodes: int
    image: str
    out: Path
    gpus_per_node: int = 0
    kind: str = "statefulset"
    name: str = ""  # default: [run] name, made a DNS label
    nproc_per_node: str = "auto"
    max_restarts: int = 3
    resources: PodResources = field(default_factory=lambda: PodResources(gpus=0, processes=1))
    data_pvc: str = ""
    data_host_path: str = ""
    data_dir: str = ""  # where the data volume is mounted (default: the directory holding the config's inputs)
    run_storage: str = "50Gi"
    storage_class: str = ""
    grace_seconds: int = 600
    runtime: str = "torch-distributed"  # the TrainJob's ClusterTrainingRuntime


def check_image(ref: str) -> None:
    """The pods' image is pinned by digest: a tag can move between two pods of one run."""
    if not _DIGEST.fullmatch(ref or ""):
        raise ConfigError(f"--image {shown(ref)} is not pinned by digest: give REF@sha256:<64 hex> (the digest: "
                          f"`skopeo inspect --format '{{{{.Digest}}}}' docker://{ref.split('@')[0] or 'REF'}`)")


def run_label(name: str) -> str:
    """[run] name as a DNS label (Service, StatefulSet and pod host names): lowercase, '-' for the rest."""
    label = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")[:40].strip("-")
    if label and not label[0].isalpha():
        label = ("run-" + label)[:40].rstrip("-")
    return label


def data_directory(cfg, given: str) -> Path:
    """The directory mounted read-only: given, or the deepest one holding every input of the config."""
    inputs = [Path(p) for p in (*cfg.data.train, *cfg.data.val, cfg.data.check_report, cfg.model.init) if p]
    if given:
        base = Path(given)
        if not base.is_absolute():
            raise ConfigError(f"--data-dir {shown(given)} must be an absolute path (where the pods mount the data)")
    else:
        base = Path(os.path.commonpath([str(p.parent) for p in inputs]))
    outside = [p for p in inputs if not p.is_relative_to(base)]
    if outside:
        raise ConfigError(f"--data-dir {base}: {outside[0]} (named in {cfg.source}) is not under it")
    if base == Path(base.anchor):
        raise ConfigError(f"{cfg.source}: its inputs share no directory below {base}; give --data-dir")
    if Path(cfg.run_dir).resolve().is_relative_to(base):
        raise ConfigError(f"{cfg.source}: the run directory {cfg.run_dir} is inside the data directory {base}, "
                          "which the pods mount read-only: set [run] out_dir elsewhere or give --data-dir")
    return base


def check_spec(spec: K8sSpec, cfg) -> tuple[str, int]:
    """Every flag checked, one line for the first wrong one; returns (name, processes per node)."""
    if spec.kind not in KINDS:
        raise ConfigError(f"--kind must be one of {', '.join(KINDS)}, got {shown(spec.kind)}")
    check_image(spec.image)
    name = spec.name or run_label(cfg.run.name)
    if not _NAME.fullmatch(name):
        raise ConfigError(f"--name {shown(name)}: must be a DNS label of at most 40 characters: a-z, 0-9 and '-', "
                          "starting with a letter")
    if bool(spec.data_pvc) == bool(spec.data_host_path):
        raise ConfigError("give the data volume: --data-pvc CLAIM or --data-host-path DIR (one of them)")
    if spec.data_host_path and not spec.data_host_path.startswith("/"):
        raise ConfigError(f"--data-host-path {shown(spec.data_host_path)} must be an absolute path on the nodes")
    memory_bytes(spec.run_storage, "--run-storage")
    for flag, value in (("--data-pvc", spec.data_pvc), ("--storage-class", spec.storage_class),
                        ("--runtime", spec.runtime if spec.kind == "trainjob" else "")):
        if value and not _OBJECT.fullmatch(value):
            raise ConfigError(f"{flag} {shown(value)}: must name a Kubernetes object (a-z, 0-9, '-', '.'; "
                              "at most 253 characters)")
    if spec.kind == "trainjob" and not spec.runtime:
        raise ConfigError("--runtime: give the ClusterTrainingRuntime's name (default torch-distributed)")
    if spec.nproc_per_node == "auto":
        processes = spec.gpus_per_node or 1
    else:
        processes = int(spec.nproc_per_node)
        if spec.gpus_per_node and processes > spec.gpus_per_node:
            raise ConfigError(f"--nproc-per-node {processes} is more than --gpus-per-node {spec.gpus_per_node} "
                              "(one process per GPU)")
    spec.resources.check()
    return name, processes


def pod_command(spec: K8sSpec, cfg, name: str, processes: int, data_dir: Path) -> list[str]:
    """The container's command: `appliance doctor --k8s` (this pod's name, interface, shm, volumes,
    GPUs; one line per problem), then `appliance train` with the node rank and rendezvous of this kind."""
    rank, endpoint = {"statefulset": ("${HOSTNAME##*-}", f"{name}-0.{name}:{PORT}"),
                      "indexed-job": ("$JOB_COMPLETION_INDEX", f"{name}-0.{name}:{PORT}"),
                      "trainjob": ("$PET_NODE_RANK", "$PET_MASTER_ADDR:$PET_MASTER_PORT")}[spec.kind]
    doctor = (f"appliance doctor --k8s --run-dir {shlex.quote(str(cfg.run_dir))} --data-dir {shlex.quote(str(data_dir))}"
              + (f" --expect-gpus {spec.gpus_per_node}" if spec.gpus_per_node else ""))
    train = (f"appliance train {shlex.quote(cfg.source)} --nnodes {spec.nodes} --node-rank \"$rank\" "
             f"--rdzv-endpoint \"{endpoint}\" --nproc-per-node {processes} --max-restarts {spec.max_restarts}")
    if spec.kind != "statefulset":
        # The Job owns restarts (backoffLimit); the launcher is PID 1 and gets SIGTERM itself.
        return ["sh", "-c", f"rank={rank}\n{doctor} || exit 1\nexec {train}\n"]
    # A StatefulSet restarts every container that exits, finished or not: the pod stays up after
    # the run (bounded restarts are torchrun's --max-restarts). SIGTERM (the pod deleted) goes on to
    # the launcher, whose workers checkpoint; then the pod exits.
    return ["sh", "-c", f"rank={rank}\n{{ {doctor} && exec {train}; }} &\npid=$!\n"
            "term=\"\"\ntrap 'term=1; kill -TERM \"$pid\" 2>/dev/null' TERM\n"
            "status=0; wait \"$pid\" || status=$?\n"
            "while kill -0 \"$pid\" 2>/dev/null; do status=0; wait \"$pid\" || status=$?; done\n"
            "[ -z \"$term\" ] || exit \"$status\"  # deleted: the checkpoint is saved, the pod goes\n"
            "echo \"appliance train k8s: node $rank: training exited with status $status; this pod stays up "
            "until deleted (a StatefulSet would restart it)\"\n"
            "trap 'exit 0' TERM\nsleep infinity & wait\n"]


def _container(spec: K8sSpec, cfg, name: str, processes: int, data_dir: Path, per_index: bool) -> dict:
    run_mount = {"name": "run", "mountPath": str(cfg.run_dir)}
    if per_index:  # one claim for the Job; each index its own directory on it
        run_mount["subPathExpr"] = "node-$(JOB_COMPLETION_INDEX)"
    container = {
        "name": CONTAINER, "image": spec.image,
        "command": pod_command(spec, cfg, name, processes, data_dir),
        "env": [{"name": "PYTHONUNBUFFERED", "value": "1"},
                {"name": "OMP_NUM_THREADS", "value": str(spec.resources.threads_per_process())}],
        "ports": [{"name": "rdzv", "containerPort": PORT, "protocol": "TCP"}],
        "resources": spec.resources.container(),
        "volumeMounts": [{"name": "config", "mountPath": cfg.source, "subPath": "train.toml", "readOnly": True},
                         {"name": "data", "mountPath": str(data_dir), "readOnly": True},
                         run_mount,
                         {"name": "shm", "mountPath": "/dev/shm"}],
    }
    if spec.kind == "trainjob":  # the runtime names the ports; PET_* come from the trainer
        del container["ports"]
    return container


def _volumes(spec: K8sSpec, name: str, run_claim: bool) -> list[dict]:
    data = ({"persistentVolumeClaim": {"claimName": spec.data_pvc, "readOnly": True}} if spec.data_pvc
            else {"hostPath": {"path": spec.data_host_path, "type": "Directory"}})
    volumes = [{"name": "config", "configMap": {"name": f"{name}-config"}},
               {"name": "data", **data},
               {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": spec.resources.shm_size}}]
    if run_claim:
        volumes.append({"name": "run", "persistentVolumeClaim": {"claimName": f"{name}-run"}})
    return volumes


def _meta(name: str, run: str, **more) -> dict:
    return {"name": name, "labels": {"app.kubernetes.io/name": "appliance-train", LABEL: run}, **more}


def _claim_spec(spec: K8sSpec, access: str) -> dict:
    claim = {"accessModes": [access], "resources": {"requests": {"storage": spec.run_storage}}}
    if spec.storage_class:
        claim["storageClassName"] = spec.storage_class
    return claim


def documents(spec: K8sSpec) -> dict[str, dict]:
    """The manifests by file name, checked: the ConfigMap, the Service, the workload (and a claim)."""
    cfg = load_config(spec.config)
    name, processes = check_spec(spec, cfg)
    # Resources are per GPU, or per process without one: the pod's share follows the flags.
    spec = replace(spec, resources=replace(spec.resources, gpus=spec.gpus_per_node,
                                           processes=spec.gpus_per_node or processes))
    data_dir = data_directory(cfg, spec.data_dir)
    per_index = spec.kind != "statefulset"
    container = _container(spec, cfg, name, processes, data_dir, per_index)
    pod = {"terminationGracePeriodSeconds": spec.grace_seconds, "enableServiceLinks": False,
           "containers": [container], "volumes": _volumes(spec, name, per_index)}
    docs = {"configmap.yaml": {"apiVersion": "v1", "kind": "ConfigMap", "metadata": _meta(f"{name}-config", name),
                               "data": {"train.toml": Path(cfg.source).read_text()}}}
    if spec.kind != "trainjob":  # a TrainJob's JobSet makes its own headless Service
        docs["service.yaml"] = {
            "apiVersion": "v1", "kind": "Service", "metadata": _meta(name, name),
            "spec": {"clusterIP": "None", "publishNotReadyAddresses": True, "selector": {LABEL: name},
                     "ports": [{"name": "rdzv", "port": PORT, "targetPort": PORT, "protocol": "TCP"}]}}
    if per_index:
        docs["run-claim.yaml"] = {"apiVersion": "v1", "kind": "PersistentVolumeClaim",
                                  "metadata": _meta(f"{name}-run", name), "spec": _claim_spec(spec, "ReadWriteMany")}
    template = {"metadata": {"labels": _meta(name, name)["labels"]}, "spec": pod}
    if spec.kind == "statefulset":
        docs["statefulset.yaml"] = {
            "apiVersion": "apps/v1", "kind": "StatefulSet", "metadata": _meta(name, name),
            "spec": {"serviceName": name, "replicas": spec.nodes, "podManagementPolicy": "Parallel",
                     "selector": {"matchLabels": {LABEL: name}}, "template": template,
                     "persistentVolumeClaimRetentionPolicy": {"whenDeleted": "Retain", "whenScaled": "Retain"},
                     "volumeClaimTemplates": [{"metadata": {"name": "run"},
                                               "spec": _claim_spec(spec, "ReadWriteOnce")}]}}
    elif spec.kind == "indexed-job":
        pod.update(restartPolicy="OnFailure", subdomain=name)
        docs["job.yaml"] = {
            "apiVersion": "batch/v1", "kind": "Job", "metadata": _meta(name, name),
            "spec": {"completionMode": "Indexed", "completions": spec.nodes, "parallelism": spec.nodes,
                     "backoffLimit": spec.max_restarts, "template": template}}
    else:
        docs["trainjob.yaml"] = _trainjob(spec, name, processes, container, pod)
    return docs


def _trainjob(spec: K8sSpec, name: str, processes: int, container: dict, pod: dict) -> dict:
    """Kubeflow Trainer v2 (trainer.kubeflow.org/v1alpha1): the trainer's command, env and
    resources in spec.trainer; volumes and mounts as a runtime patch on the "node" job."""
    patch_pod = {"terminationGracePeriodSeconds": pod["terminationGracePeriodSeconds"], "volumes": pod["volumes"],
                 "containers": [{"name": CONTAINER, "volumeMounts": container["volumeMounts"]}]}
    return {
        "apiVersion": "trainer.kubeflow.org/v1alpha1", "kind": "TrainJob", "metadata": _meta(name, name),
        "spec": {"runtimeRef": {"apiGroup": "trainer.kubeflow.org", "kind": "ClusterTrainingRuntime",
                                "name": spec.runtime},
                 "trainer": {"image": spec.image, "command": container["command"], "env": container["env"],
                             "numNodes": spec.nodes, "numProcPerNode": processes,
                             "resourcesPerNode": container["resources"]},
                 "runtimePatches": [{"manager": "appliance.example/train-k8s", "trainingRuntimeSpec": {"template": {
                     "spec": {"replicatedJobs": [{"name": CONTAINER, "template": {"spec": {"template": {
                         "spec": patch_pod}}}}]}}}}]}}


def write_manifests(spec: K8sSpec, command: str = "") -> Path:
    """Write the manifests and a README into spec.out; returns spec.out."""
    docs = documents(spec)
    out = Path(spec.out)
    out.mkdir(parents=True, exist_ok=True)
    made = command or f"appliance train k8s {spec.config} --nodes {spec.nodes} --kind {spec.kind}"
    header = f"Generated by appliance {__version__}: {made}\nApply: kubectl apply -f {out}/"
    for file_name, doc in docs.items():
        atomic_write_text(out / file_name, dump_all([doc], header))
    atomic_write_text(out / "README.md", readme(spec, docs, made))
    return out
