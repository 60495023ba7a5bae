"""Kubernetes resource quantities for `appliance train k8s`: checked, and multiplied per GPU.

Kept apart from the manifests (appliance/train/k8s.py) since it is arithmetic on Kubernetes' own
quantity syntax: CPU in cores or millicores ("4", "1.5", "500m"), memory in bytes with a binary
or decimal suffix ("16Gi", "512Mi", "1G").
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from decimal import Decimal

from appliance.core.errors import ConfigError
from appliance.core.values import shown

# Defaults per GPU (per process without a GPU): the requests and limits of the site's reference setup.
CPU_REQUEST, CPU_LIMIT = "4", "8"
MEMORY_REQUEST, MEMORY_LIMIT = "16Gi", "32Gi"

_MEMORY = re.compile(r"([0-9]{1,15})(Ki|Mi|Gi|Ti|Pi|k|M|G|T|P)?")
_MEMORY_UNIT = {None: 1, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15,
                "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50}
_CPU = re.compile(r"([0-9]{1,6}(\.[0-9]{1,3})?|[0-9]{1,9}m)")


def cpu_millis(text: str, flag: str) -> int:
    """A CPU quantity in millicores; 0 or a malformed value is a ConfigError naming flag."""
    if not isinstance(text, str) or not _CPU.fullmatch(text):
        raise ConfigError(f"{flag}: must be cores (4, 1.5) or millicores (500m), got {shown(text)}")
    millis = int(text[:-1]) if text.endswith("m") else int(Decimal(text) * 1000)
    if millis <= 0:
        raise ConfigError(f"{flag}: must be more than 0, got {shown(text)}")
    return millis


def memory_bytes(text: str, flag: str) -> tuple[int, str]:
    """A memory quantity as (count, unit) with its bytes checked to be above 0."""
    match = _MEMORY.fullmatch(text) if isinstance(text, str) else None
    if not match:
        raise ConfigError(f"{flag}: must be whole bytes with an optional unit (16Gi, 512Mi, 8G), got {shown(text)}")
    count = int(match.group(1))
    if count <= 0:
        raise ConfigError(f"{flag}: must be more than 0, got {shown(text)}")
    return count, match.group(2) or ""


def cpu_text(millis: int) -> str:
    return str(millis // 1000) if millis % 1000 == 0 else f"{millis}m"


@dataclass(frozen=True)
class PodResources:
    """What one pod asks for: per-GPU (or per-process) quantities times the processes of a node."""

    gpus: int
    processes: int
    cpu_request: str = CPU_REQUEST
    cpu_limit: str = CPU_LIMIT
    memory_request: str = MEMORY_REQUEST
    memory_limit: str = MEMORY_LIMIT
    shm_size: str = "8Gi"

    def check(self) -> None:
        """One line for the first quantity that is malformed or a request above its limit."""
        if cpu_millis(self.cpu_request, "--cpu-request") > cpu_millis(self.cpu_limit, "--cpu-limit"):
            raise ConfigError(f"--cpu-request {self.cpu_request} is more than --cpu-limit {self.cpu_limit}")
        request, limit = (_bytes(*memory_bytes(q, f)) for q, f in ((self.memory_request, "--memory-request"),
                                                                   (self.memory_limit, "--memory-limit")))
        if request > limit:
            raise ConfigError(f"--memory-request {self.memory_request} is more than --memory-limit {self.memory_limit}")
        memory_bytes(self.shm_size, "--shm-size")

    def container(self) -> dict:
        """The container's `resources`: nvidia.com/gpu in limits and requests alike (Kubernetes
        allows no overcommit of extended resources), CPU and memory times the processes."""
        n = self.processes
        requests = {"cpu": cpu_text(cpu_millis(self.cpu_request, "--cpu-request") * n),
                    "memory": _times(self.memory_request, n, "--memory-request")}
        limits = {"cpu": cpu_text(cpu_millis(self.cpu_limit, "--cpu-limit") * n),
                  "memory": _times(self.memory_limit, n, "--memory-limit")}
        if self.gpus:
            requests["nvidia.com/gpu"] = limits["nvidia.com/gpu"] = str(self.gpus)
        return {"requests": requests, "limits": limits}

    def threads_per_process(self) -> int:
        """OMP_NUM_THREADS for each process: its share of the CPU request, at least one."""
        return max(1, cpu_millis(self.cpu_request, "--cpu-request") // 1000)


def _bytes(count: int, unit: str) -> int:
    return count * _MEMORY_UNIT[unit or None]


def _times(text: str, n: int, flag: str) -> str:
    count, unit = memory_bytes(text, flag)
    return f"{count * n}{unit}"

