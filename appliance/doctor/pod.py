"""`appliance doctor --k8s`: what a training pod sees before it trains (`appliance train k8s` runs it
first in every pod): its name and address as the other pods will reach it, the interface NCCL and
Gloo will use, /dev/shm's size, and whether its volumes are where the config needs them."""

from __future__ import annotations

import os
import socket
import tempfile
from pathlib import Path

from appliance.core.errors import ConfigError
from appliance.core.values import human_bytes
from appliance.train.preflight import interface_address, interfaces

MIN_SHM = 1 << 30  # below this, DataLoader workers fail with "No space left on device" on their first batches


def _address_of_this_pod() -> tuple[str, str, str]:
    """(host name, fully qualified name, its address): what torchrun advertises to the other nodes."""
    host = socket.gethostname()
    fqdn = socket.getfqdn()
    try:
        address = socket.getaddrinfo(fqdn, None, socket.AF_INET)[0][4][0]
    except OSError:
        address = ""
    return host, fqdn, address


def _interface_holding(address: str) -> str:
    for name in interfaces():
        try:
            if interface_address(name) == address:
                return name
        except ConfigError:  # an interface with no IPv4 address
            continue
    return ""


def _writable(path: Path) -> bool:
    try:
        with tempfile.NamedTemporaryFile(dir=path, prefix=".doctor-"):
            return True
    except OSError:
        return False


def pod_facts(run_dir: str = "", data_dir: str = "") -> dict:
    host, fqdn, address = _address_of_this_pod()
    chosen = os.environ.get("NCCL_SOCKET_IFNAME", "")
    shm = os.statvfs("/dev/shm") if os.path.isdir("/dev/shm") else None
    facts = {"hostname": host, "fqdn": fqdn, "address": address, "interfaces": interfaces(),
             "nccl_socket_ifname": chosen, "interface": chosen or _interface_holding(address),
             "shm_bytes": shm.f_frsize * shm.f_blocks if shm else 0, "volumes": {}}
    if run_dir:
        facts["volumes"]["run"] = {"path": run_dir, "exists": os.path.isdir(run_dir),
                                   "writable": os.path.isdir(run_dir) and _writable(Path(run_dir))}
    if data_dir:
        facts["volumes"]["data"] = {"path": data_dir, "exists": os.path.isdir(data_dir),
                                    "writable": os.path.isdir(data_dir) and _writable(Path(data_dir))}
    return facts


def pod_problems(facts: dict, gpus: int, expect_gpus: int | None) -> list[str]:
    """Lines that stop training before it starts; gpus is what torch sees."""
    problems = []
    if not facts["address"]:
        problems.append(f"this pod's name {facts['fqdn']} does not resolve: the other pods cannot reach it "
                        "(is the headless Service applied, with publishNotReadyAddresses?)")
    elif facts["address"].startswith("127.") and not facts["nccl_socket_ifname"]:
        problems.append(f"{facts['fqdn']} resolves to loopback {facts['address']}: the other pods cannot reach it")
    if facts["shm_bytes"] < MIN_SHM:
        problems.append(f"/dev/shm is {human_bytes(facts['shm_bytes'])}: DataLoader workers need at least "
                        f"{human_bytes(MIN_SHM)} (a memory-backed emptyDir; `appliance train k8s --shm-size`)")
    if expect_gpus is not None and gpus < expect_gpus:
        problems.append(f"torch sees {gpus} GPU(s), the pod asked for {expect_gpus} (nvidia.com/gpu): "
                        "is the NVIDIA device plugin running on this node?")
    run, data = facts["volumes"].get("run"), facts["volumes"].get("data")
    if run and not run["writable"]:
        problems.append(f"the run directory {run['path']} is {'not writable' if run['exists'] else 'missing'}: "
                        "its volume claim is not mounted there")
    if data and not data["exists"]:
        problems.append(f"the data directory {data['path']} is missing: the data volume is not mounted there")
    return problems


def pod_rows(facts: dict) -> list[tuple[str, str]]:
    rows = [("Pod", f"{facts['hostname']} ({facts['fqdn']} -> {facts['address'] or 'unresolved'})"),
            ("NCCL/Gloo interface", (facts["interface"] or "none found")
             + (" (NCCL_SOCKET_IFNAME)" if facts["nccl_socket_ifname"] else " (holds the pod's address)")
             + f"; interfaces: {', '.join(facts['interfaces'])}"),
            ("/dev/shm", human_bytes(facts["shm_bytes"]))]
    for name, v in facts["volumes"].items():
        state = "missing" if not v["exists"] else "writable" if v["writable"] else "read-only"
        rows.append((f"{name} volume", f"{v['path']}: {state}"))
    return rows
