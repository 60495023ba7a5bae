"""Before a long multi-node run: what each node can check, and what the nodes must agree on.

`appliance train CONFIG --preflight` on every node (same --nnodes/--node-rank/--rdzv-endpoint as
the run): the rendezvous endpoint is reachable (a TCP connect to the address given, nothing
else), every node has the same config hash, appliance, torch and CUDA versions and GPU count
(exchanged through a c10d TCPStore on the endpoint, the store torchrun's rendezvous uses), and
enough free disk for the checkpoints the config keeps. One line per problem.

Also here: the network choices for sites with several interfaces and no DNS: `iface` gives the
address torchrun binds (--local-addr) and the interface NCCL and Gloo use.
"""

from __future__ import annotations

import fcntl
import ipaddress
import json
import re
import shutil
import socket
import struct
import time
from dataclasses import asdict, dataclass

from appliance import __version__
from appliance.core.errors import ConfigError, EnvironmentProblem
from appliance.core.values import human_bytes, shown
from appliance.models import build_model

SIOCGIFADDR = 0x8915  # Linux: the IPv4 address of an interface


def check_loopback(address: str = "127.0.0.1") -> None:
    """torchrun's c10d store of a one-node run listens and connects on address (loopback): a
    network namespace made with a bare `unshare -n` has its loopback down, and torchrun would then
    fail with a long rendezvous traceback. One line instead, before it starts."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as server:
            server.bind((address, 0))
            server.listen(1)
            with socket.create_connection(server.getsockname(), timeout=5):
                pass
    except OSError as err:
        raise EnvironmentProblem(f"cannot listen and connect on {address} ({err.strerror or err}): the loopback "
                                 "interface is down (a network namespace needs `ip link set lo up`); torchrun's "
                                 "rendezvous runs over it even on one machine") from None


def interfaces() -> list[str]:
    return [name for _, name in socket.if_nameindex()]


def interface_address(name: str) -> str:
    """The IPv4 address of interface `name` (e.g. eth1), read from the kernel; no DNS."""
    if name not in interfaces():
        raise ConfigError(f"network interface {shown(name)} does not exist on this node "
                          f"(it has {', '.join(interfaces()) or 'none'})")
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = fcntl.ioctl(s.fileno(), SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
        except OSError:
            raise ConfigError(f"network interface {name!r} has no IPv4 address (is it up?)") from None
    return socket.inet_ntoa(packed[20:24])


# A DNS name or an IPv4 address: labels of letters, digits and inner hyphens, at most 63 characters
# each and 253 in all (RFC 1123); nothing a shell or a resolver would read differently.
HOST_NAME = re.compile(r"(?=.{1,253}$)[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*")


def split_endpoint(endpoint: str) -> tuple[str, int]:
    """HOST:PORT -> (host, port): a host name, an IPv4 address or a bracketed IPv6 one (with its
    %zone), and a port of 1..65535 in ASCII digits (int() also took "1_0", " 1" and "٣٣")."""
    host, _, port = endpoint.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        address, _, zone = host[1:-1].partition("%")
        try:
            host_ok = bool(ipaddress.IPv6Address(address)) and re.fullmatch(r"[A-Za-z0-9._-]*", zone) is not None
        except ValueError:
            host_ok = False
        host = host[1:-1]
    else:
        host_ok = HOST_NAME.fullmatch(host) is not None
    port_ok = re.fullmatch(r"[0-9]{1,5}", port) is not None and 0 < int(port) < 65536
    if not host_ok or not port_ok:
        why = "PORT must be 1..65535" if host_ok else "HOST must be a host name, an IPv4 address or [IPv6]"
        raise ConfigError(f"--rdzv-endpoint {shown(endpoint)}: expected HOST:PORT, e.g. 10.0.0.5:29400 ({why})")
    return host, int(port)


@dataclass(frozen=True)
class NodeFacts:
    node_rank: int
    hostname: str
    config_hash: str
    appliance: str
    torch: str
    cuda: str
    gpus: int
    free_disk_bytes: int
    need_disk_bytes: int


def checkpoint_bytes_needed(cfg) -> int:
    """Disk the config's checkpoints take at most: weights + optimizer state per kept checkpoint,
    the trained model, and the configured headroom."""
    model = build_model(cfg.model.architecture, cfg.num_classes, cfg.data.channels)
    weights = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    optimizer_copies = 2 if cfg.optimizer.name == "adamw" else 1  # Adam moments; SGD momentum
    per_checkpoint = weights * (1 + optimizer_copies)
    kept = cfg.checkpoint.keep_last + cfg.checkpoint.keep_best + 1  # +1: the one being written
    return int(per_checkpoint * kept + weights + cfg.checkpoint.min_free_gb * 2**30)


def gather_facts(cfg, node_rank: int) -> NodeFacts:
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    directory = cfg.run_dir
    while not directory.exists():
        directory = directory.parent
    return NodeFacts(node_rank=node_rank, hostname=socket.gethostname(), config_hash=cfg.training_hash(),
                     appliance=__version__, torch=torch.__version__, cuda=torch.version.cuda or "none",
                     gpus=gpus, free_disk_bytes=shutil.disk_usage(directory).free,
                     need_disk_bytes=checkpoint_bytes_needed(cfg))


def local_problems(facts: NodeFacts, cfg, expected_gpus: int | None) -> list[str]:
    problems = []
    if facts.free_disk_bytes < facts.need_disk_bytes:
        problems.append(f"node {facts.node_rank} ({facts.hostname}): {human_bytes(facts.free_disk_bytes)} free "
                        f"under {cfg.run_dir}, the checkpoints need about {human_bytes(facts.need_disk_bytes)} "
                        f"([checkpoint] keep_last, keep_best and min_free_gb in {cfg.source})")
    if expected_gpus is not None and facts.gpus != expected_gpus:
        problems.append(f"node {facts.node_rank} ({facts.hostname}): {facts.gpus} GPUs, expected {expected_gpus}")
    return problems


def compare_nodes(all_facts: list[NodeFacts]) -> list[str]:
    """One line per node whose versions or config differ from node 0's."""
    reference = all_facts[0]
    problems = []
    for facts in all_facts[1:]:
        for key, what in (("config_hash", "training config (hash)"), ("appliance", "appliance version"),
                          ("torch", "torch version"), ("cuda", "CUDA version"), ("gpus", "GPU count")):
            mine, theirs = getattr(facts, key), getattr(reference, key)
            if mine != theirs:
                shown = (mine[:12], theirs[:12]) if key == "config_hash" else (mine, theirs)
                problems.append(f"node {facts.node_rank} ({facts.hostname}): {what} {shown[0]} differs from "
                                f"node 0 ({reference.hostname}): {shown[1]}")
    return problems


def wait_for_endpoint(host: str, port: int, timeout: float) -> str | None:
    """None when a TCP connection to host:port succeeds within timeout, else why not."""
    deadline = time.monotonic() + timeout
    last = "no answer"
    while True:
        try:
            with socket.create_connection((host, port), timeout=min(5.0, max(timeout, 0.1))):
                return None
        except OSError as err:
            last = err.strerror or type(err).__name__
        if time.monotonic() >= deadline:
            return last
        time.sleep(0.5)


def run_preflight(cfg, *, nnodes: int, node_rank: int, rdzv_endpoint: str, timeout: float = 60.0,
                  expected_gpus: int | None = None) -> list[str]:
    """Every problem found, one line each (empty when this node is ready)."""
    facts = gather_facts(cfg, node_rank)
    problems = local_problems(facts, cfg, expected_gpus)
    if nnodes <= 1:
        return problems
    from datetime import timedelta

    from torch.distributed import TCPStore

    host, port = split_endpoint(rdzv_endpoint)
    if node_rank != 0:
        why = wait_for_endpoint(host, port, timeout)
        if why:
            return problems + [f"rendezvous endpoint {host}:{port} unreachable from node {node_rank} ({why}) "
                               f"after {timeout:g} s: is `appliance train --preflight --node-rank 0` running there, "
                               "and does the firewall let the port through?"]
    try:
        store = TCPStore(host, port, world_size=nnodes, is_master=node_rank == 0,
                         timeout=timedelta(seconds=timeout), wait_for_workers=False)
    except (RuntimeError, OSError) as err:
        where = "listen on" if node_rank == 0 else "reach"
        return problems + [f"rendezvous endpoint {host}:{port}: cannot {where} it from node {node_rank} "
                           f"({str(err).strip().splitlines()[0]})"]
    store.set(f"preflight/{node_rank}", json.dumps(asdict(facts)))
    keys = [f"preflight/{r}" for r in range(nnodes)]
    try:
        store.wait(keys, timedelta(seconds=timeout))
    except (RuntimeError, OSError):
        missing = [k.split("/")[1] for k in keys if not store.check([k])]
        return problems + [f"rendezvous endpoint {host}:{port}: node(s) {', '.join(missing)} did not report "
                           f"within {timeout:g} s (run --preflight on every node)"]
    all_facts = [NodeFacts(**json.loads(store.get(k))) for k in keys]
    store.set(f"preflight/done/{node_rank}", "1")
    if node_rank == 0:  # the store lives in this process: keep it until every node has read it
        try:
            store.wait([f"preflight/done/{r}" for r in range(nnodes)], timedelta(seconds=timeout))
        except (RuntimeError, OSError):
            pass
    for other in all_facts:
        if other.node_rank != node_rank:
            problems += local_problems(other, cfg, expected_gpus)
    return problems + compare_nodes(all_facts)


def network_env(iface: str, extra: dict[str, str]) -> dict[str, str]:
    """The environment a site's network choices give torchrun and the workers."""
    env = dict(extra)
    if iface:
        env.setdefault("NCCL_SOCKET_IFNAME", iface)
        env.setdefault("GLOO_SOCKET_IFNAME", iface)
    return env
