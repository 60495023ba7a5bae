"""`appliance train k8s`: every manifest it writes validates strictly against the Kubernetes OpenAPI
schemas of two minor versions (kubernetes-validate, offline) and the TrainJob against Kubeflow
Trainer's CRD schema (vendored in k8s_schemas/, source named inside); fields a site relies on are
read back; bad flags are one line."""

import copy
import json
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from appliance.cli import main
from train_data import make_config

VERSIONS = ("1.30.0", "1.37.0")  # the oldest and newest minor versions the linter bundles that we claim
DIGEST = "registry.site/appliance@sha256:" + "0123456789abcdef" * 4
TRAINJOB_SCHEMA = Path(__file__).parent / "k8s_schemas" / "trainjob-v1alpha1-trainer-v2.3.0.json"


@pytest.fixture(scope="module")
def config(tmp_path_factory):
    return make_config(tmp_path_factory.mktemp("k8s"), name="Demo_Run")


def write(config, out, *flags):
    assert main(["train", "k8s", str(config), "--image", DIGEST, "--out", str(out), *flags]) == 0
    return {p.name: yaml.safe_load(p.read_text()) for p in sorted(Path(out).glob("*.yaml"))}


def strict(schema):
    """The CRD schema as the API server's strict field validation reads it: unknown fields refused."""
    schema = copy.deepcopy(schema)

    def close(node):
        if isinstance(node, dict):
            if node.get("type") == "object" and "properties" in node and "additionalProperties" not in node \
                    and not node.get("x-kubernetes-preserve-unknown-fields"):
                node["additionalProperties"] = False
            for value in node.values():
                close(value)
        elif isinstance(node, list):
            for value in node:
                close(value)

    close(schema)
    return schema


def validate(doc):
    if doc["kind"] == "TrainJob":
        jsonschema.validate(doc, strict(json.loads(TRAINJOB_SCHEMA.read_text())))
        return
    for version in VERSIONS:
        kubernetes_validate.validate(doc, version, strict=True)


def pod_spec(docs):
    for doc in docs.values():
        if doc["kind"] in ("StatefulSet", "Job"):
            return doc["spec"]["template"]["spec"]
        if doc["kind"] == "TrainJob":
            job = doc["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"][0]
            return job["template"]["spec"]["template"]["spec"]


@pytest.mark.parametrize("kind", ["statefulset", "indexed-job", "trainjob"])
def test_every_kind_validates_strictly_for_1_and_4_nodes_with_and_without_gpus(tmp_path, config, kind):
    for nodes in (1, 4):
        for gpus in (0, 8):
            docs = write(config, tmp_path / f"{nodes}-{gpus}", "--kind", kind, "--nodes", str(nodes),
                         "--gpus-per-node", str(gpus), "--data-pvc", "training-data")
            assert "configmap.yaml" in docs and (kind == "trainjob") != ("service.yaml" in docs)
            for doc in docs.values():
                validate(doc)
            workload = next(d for d in docs.values() if d["kind"] in ("StatefulSet", "Job", "TrainJob"))
            if kind == "trainjob":
                trainer = workload["spec"]["trainer"]
                resources, command = trainer["resourcesPerNode"], trainer["command"]
                assert trainer["numNodes"] == nodes and trainer["numProcPerNode"] == max(gpus, 1)
            else:
                container = pod_spec(docs)["containers"][0]
                resources, command = container["resources"], container["command"]
            assert resources["limits"].get("nvidia.com/gpu") == (str(gpus) if gpus else None)
            assert resources["requests"].get("nvidia.com/gpu") == resources["limits"].get("nvidia.com/gpu")
            per = max(gpus, 1)  # the reference setup's 4/8 CPUs and 16/32 GiB per GPU
            assert resources["requests"]["cpu"] == str(4 * per) and resources["limits"]["memory"] == f"{32 * per}Gi"
            assert f"--nnodes {nodes} " in command[2] and f"--nproc-per-node {per} " in command[2]


def test_planted_unknown_field_is_refused_by_both_validators(tmp_path, config):
    docs = write(config, tmp_path / "s", "--nodes", "2", "--data-pvc", "d")
    bad = copy.deepcopy(docs["statefulset.yaml"])
    bad["spec"]["template"]["spec"]["containers"][0]["gpus"] = 1
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, VERSIONS[0], strict=True)
    docs = write(config, tmp_path / "t", "--nodes", "2", "--data-pvc", "d", "--kind", "trainjob")
    bad = copy.deepcopy(docs["trainjob.yaml"])
    pod_spec({"x": bad})["containers"][0]["volumeMount"] = []
    with pytest.raises(jsonschema.ValidationError):
        validate(bad)


def test_statefulset_pods_find_each_other_and_keep_their_runs(tmp_path, config):
    docs = write(config, tmp_path / "m", "--nodes", "4", "--gpus-per-node", "2", "--data-host-path", "/srv/data",
                 "--termination-grace", "900", "--max-restarts", "2")
    sts, service = docs["statefulset.yaml"], docs["service.yaml"]
    assert sts["spec"]["podManagementPolicy"] == "Parallel" and sts["spec"]["replicas"] == 4
    assert sts["spec"]["serviceName"] == service["metadata"]["name"] == "demo-run"
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"] is True
    pod = pod_spec(docs)
    script = pod["containers"][0]["command"][2]
    assert "rank=${HOSTNAME##*-}" in script and '--rdzv-endpoint "demo-run-0.demo-run:29500"' in script
    assert "--max-restarts 2" in script and pod["terminationGracePeriodSeconds"] == 900
    mounts = {m["name"]: m for m in pod["containers"][0]["volumeMounts"]}
    cfg_dir = Path(config).parent
    assert mounts["config"]["mountPath"] == str(config) and mounts["config"]["readOnly"]
    assert mounts["data"] == {"name": "data", "mountPath": str(cfg_dir / "data"), "readOnly": True}
    assert mounts["run"]["mountPath"] == str(cfg_dir / "runs" / "Demo_Run")
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["shm"]["emptyDir"]["medium"] == "Memory"
    assert volumes["data"]["hostPath"]["path"] == "/srv/data"
    assert [c["metadata"]["name"] for c in sts["spec"]["volumeClaimTemplates"]] == ["run"]
    assert docs["configmap.yaml"]["data"]["train.toml"] == Path(config).read_text()


def test_indexed_job_bounds_restarts_and_gives_each_index_its_directory(tmp_path, config):
    docs = write(config, tmp_path / "j", "--nodes", "3", "--kind", "indexed-job", "--data-pvc", "d", "--max-restarts", "4")
    job = docs["job.yaml"]["spec"]
    assert (job["completionMode"], job["completions"], job["parallelism"], job["backoffLimit"]) == ("Indexed", 3, 3, 4)
    pod = pod_spec(docs)
    assert pod["subdomain"] == "demo-run" and pod["restartPolicy"] == "OnFailure"
    run = next(m for m in pod["containers"][0]["volumeMounts"] if m["name"] == "run")
    assert run["subPathExpr"] == "node-$(JOB_COMPLETION_INDEX)"
    assert "ReadWriteMany" in docs["run-claim.yaml"]["spec"]["accessModes"]


def test_trainjob_takes_rank_and_rendezvous_from_kubeflow_trainer(tmp_path, config):
    docs = write(config, tmp_path / "t", "--nodes", "2", "--kind", "trainjob", "--data-pvc", "d",
                 "--runtime", "torch-cuda", "--termination-grace", "120")
    spec = docs["trainjob.yaml"]["spec"]
    assert spec["runtimeRef"]["name"] == "torch-cuda"
    script = spec["trainer"]["command"][2]
    assert "rank=$PET_NODE_RANK" in script and '--rdzv-endpoint "$PET_MASTER_ADDR:$PET_MASTER_PORT"' in script
    pod = pod_spec(docs)
    assert pod["terminationGracePeriodSeconds"] == 120 and pod["containers"][0]["name"] == "node"


def test_the_same_flags_give_the_same_bytes(tmp_path, config):
    flags = ("--nodes", "2", "--data-pvc", "d", "--kind", "trainjob")
    write(config, tmp_path / "a", *flags)
    write(config, tmp_path / "b", *flags)
    for path in sorted((tmp_path / "a").iterdir()):
        if path.suffix == ".yaml":
            assert path.read_bytes() == (tmp_path / "b" / path.name).read_bytes().replace(b"/b", b"/a")


@pytest.mark.parametrize("flags, expected", [
    (("--image", "registry.site/appliance:1.2"), "--image 'registry.site/appliance:1.2' is not pinned by digest"),
    ((), "give the data volume: --data-pvc CLAIM or --data-host-path DIR"),
    (("--data-pvc", "d", "--cpu-request", "lots"), "--cpu-request: must be cores (4, 1.5) or millicores (500m)"),
    (("--data-pvc", "d", "--memory-request", "64Gi"), "--memory-request 64Gi is more than --memory-limit 32Gi"),
    (("--data-pvc", "d", "--name", "Bad_Name"), "--name 'Bad_Name': must be a DNS label"),
    (("--data-pvc", "d", "--gpus-per-node", "2", "--nproc-per-node", "4"),
     "--nproc-per-node 4 is more than --gpus-per-node 2"),
    (("--data-pvc", "d", "--data-dir", "/elsewhere"), "--data-dir /elsewhere: "),
    (("--data-pvc", "My Data"), "--data-pvc 'My Data': must name a Kubernetes object"),
])
def test_bad_flags_are_one_line(tmp_path, capsys, config, flags, expected):
    argv = ["train", "k8s", str(config), "--nodes", "2", "--out", str(tmp_path / "o")]
    if "--image" not in flags:
        argv += ["--image", DIGEST]
    assert main([*argv, *flags]) != 0
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("appliance train k8s: error: ") and expected in lines[0], lines
    assert not (tmp_path / "o").exists()


def test_run_directory_inside_the_read_only_data_is_refused(tmp_path, capsys):
    config = make_config(tmp_path, name="nested")
    text = config.read_text().replace('out_dir = "runs"', 'out_dir = "data/runs"')
    config.write_text(text)
    assert main(["train", "k8s", str(config), "--nodes", "2", "--image", DIGEST, "--out", str(tmp_path / "o"),
                 "--data-pvc", "d"]) != 0
    line = capsys.readouterr().err.strip()
    assert "is inside the data directory" in line and "\n" not in line


def test_statefulset_script_passes_sigterm_on_and_stays_up_only_after_the_run(tmp_path, config):
    """The StatefulSet container's own shell (under test here), with a stand-in `appliance` on PATH
    that records its arguments and answers SIGTERM as the launcher does (exit 143 once the workers
    saved): deleting the pod mid-run reaches the launcher and the pod exits; after a finished run
    the pod stays up (a StatefulSet would restart it) until SIGTERM, then exits 0."""
    import os
    import signal
    import subprocess
    import time

    docs = write(config, tmp_path / "m", "--nodes", "2", "--data-pvc", "d")
    command = pod_spec(docs)["containers"][0]["command"]
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    launcher = bin_dir / "appliance"
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "HOSTNAME": "demo-run-1"}

    def pod(body):
        launcher.write_text("#!/bin/sh\n" + body)
        launcher.chmod(0o755)
        proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, text=True, start_new_session=True)
        time.sleep(1.0)
        return proc

    training = pod('[ "$1" = doctor ] && exit 0\necho "argv: $*"\n'
                   "trap 'echo launcher got SIGTERM; exit 143' TERM\nsleep 30 >/dev/null & wait\n")
    try:
        assert training.poll() is None
        training.send_signal(signal.SIGTERM)
        out = training.communicate(timeout=10)[0]
    finally:
        os.killpg(training.pid, signal.SIGKILL)
    assert training.returncode == 143 and "launcher got SIGTERM" in out
    assert "argv: train " in out and "--node-rank 1 --rdzv-endpoint demo-run-0.demo-run:29500" in out
    finished = pod("exit 0\n")
    try:
        assert finished.poll() is None  # stays up after the run
        finished.send_signal(signal.SIGTERM)
        assert finished.wait(timeout=10) == 0
    finally:
        os.killpg(finished.pid, signal.SIGKILL)
    assert "node 1: training exited with status 0; this pod stays up" in finished.stdout.read()
