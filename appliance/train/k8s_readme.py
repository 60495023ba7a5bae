"""The README written beside `appliance train k8s`'s manifests: apply, watch, collect the run."""

from __future__ import annotations


def readme(spec, docs: dict, made: str) -> str:
    """Markdown for the site's operator; spec is a K8sSpec, docs the manifests by file name."""
    workload = next(d for d in docs.values() if d["kind"] in ("StatefulSet", "Job", "TrainJob"))
    name = workload["metadata"]["name"]
    selector = f"appliance.example/run={name}"
    if spec.kind == "statefulset":
        pods = [f"{name}-{i}" for i in range(spec.nodes)]
        where = "each pod's own volume claim (`run-" + name + "-N`, kept when the StatefulSet is deleted)"
        finish = ("A StatefulSet restarts any container that exits, so each pod stays up after training and says "
                  "`training exited with status S` in its log; collect the run, then delete the StatefulSet.")
    else:
        pods = [f"$(kubectl get pods -l {selector} -o name | sed -n {i + 1}p)" for i in range(spec.nodes)]
        where = f"the claim `{name}-run` (ReadWriteMany), one directory per node (`node-0`, `node-1`, ...)"
        finish = ("The Job's pods exit when training ends; the Job is complete when every index succeeded. "
                  f"A failed pod is retried in place up to backoffLimit = {spec.max_restarts} times, each resuming "
                  "from its newest checkpoint." if spec.kind == "indexed-job" else
                  "The TrainJob's runtime (its JobSet) owns pod restarts; each start resumes from the newest checkpoint.")
    run_dir = workload_run_dir(docs)
    return f"""# Training run `{name}` on Kubernetes ({spec.nodes} node{'s' if spec.nodes > 1 else ''}, {spec.kind})

Made by `{made}`. Every pod runs `appliance train` with its node rank from the pod
({'the ordinal at the end of its host name' if spec.kind == 'statefulset' else 'JOB_COMPLETION_INDEX' if spec.kind == 'indexed-job' else 'PET_NODE_RANK'}),
and the c10d rendezvous on node 0 ({'`' + name + '-0.' + name + ':29500`' if spec.kind != 'trainjob' else 'PET_MASTER_ADDR'}).
Inside a pod torchrun restarts the workers up to {spec.max_restarts} times, each from the newest good checkpoint.

## Before applying
- The image `{spec.image}` must be in the site's registry (`skopeo copy oci-archive:IMAGE.tar docker://REGISTRY/appliance:TAG`).
- The data volume ({'claim `' + spec.data_pvc + '`' if spec.data_pvc else 'host path `' + spec.data_host_path + '`'}) holds the
  config's data files with their `.index` files (`appliance data index FILE`): it is mounted read-only.
{'- The TrainJob needs Kubeflow Trainer and its ClusterTrainingRuntime `' + spec.runtime + '`.' if spec.kind == 'trainjob' else ''}

## Apply and watch
```
kubectl apply -f {spec.out}/
kubectl get pods -l {selector} -w
kubectl logs -f {pods[0]}
```

## Collect the run
The run directory `{run_dir}` lives on {where}. Node 0 holds the model:
```
kubectl cp {pods[0]}:{run_dir} ./{name}-node0
```
{finish}
Deleting a pod sends SIGTERM: the workers stop at a step boundary and save a checkpoint within
terminationGracePeriodSeconds ({spec.grace_seconds} s); the pod that comes back resumes from it.
"""


def workload_run_dir(docs: dict) -> str:
    """The run directory's mount path, read back from the manifests (the single source)."""
    for doc in docs.values():
        if doc["kind"] in ("StatefulSet", "Job"):
            mounts = doc["spec"]["template"]["spec"]["containers"][0]["volumeMounts"]
        elif doc["kind"] == "TrainJob":
            job = doc["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"][0]
            mounts = job["template"]["spec"]["template"]["spec"]["containers"][0]["volumeMounts"]
        else:
            continue
        return next(m["mountPath"] for m in mounts if m["name"] == "run")
    return ""
