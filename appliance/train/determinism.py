"""Determinism in one place: seeding, deterministic kernels, and RNG state as plain JSON.

Exact resume needs every random stream a rank uses (Python, numpy, torch CPU, every CUDA
device) saved at a step boundary and put back before the next step. (The data loaders' own
generator is reseeded from (seed, epoch, rank) each epoch, so it needs no saving.) States are stored as JSON (base64 for torch's byte tensors): nothing here is pickled.
"""

from __future__ import annotations

import base64
import os
import random

import numpy as np
import torch


def set_determinism(seed: int, rank: int, deterministic: bool) -> None:
    """Seed every generator (each rank differently) and, if asked, force deterministic kernels."""
    # Distinct per-rank seeds keep random augmentations independent across ranks.
    seed = seed + rank
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    if deterministic:
        # cuBLAS needs this set before its first call to be reproducible.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False
    else:
        torch.backends.cudnn.benchmark = True


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.cpu().numpy().tobytes()).decode("ascii")


def _unb64(s: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8)


def rng_state() -> dict:
    """Every RNG stream of this process, JSON-serialisable."""
    version, mt, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "python": [version, list(mt), gauss],
        "numpy": [name, keys.tolist(), int(pos), int(has_gauss), float(cached)],
        "torch": _b64(torch.get_rng_state()),
        "cuda": [_b64(s) for s in torch.cuda.get_rng_state_all()] if torch.cuda.is_available() else [],
    }
    return state


def set_rng_state(state: dict) -> None:
    version, mt, gauss = state["python"]
    random.setstate((version, tuple(mt), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(_unb64(state["torch"]))
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([_unb64(s) for s in state["cuda"]])
