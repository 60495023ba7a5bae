"""Small collectives over torch.distributed that the checkpoints and the loop share: an int or bytes
broadcast from one rank, the largest or smallest int over all ranks, every rank's JSON value (JSON on
the wire: nothing is unpickled). Each one is the identity in a run of one process.
"""

from __future__ import annotations

import json

import torch
import torch.distributed as dist


def distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def barrier() -> None:
    if distributed():
        dist.barrier()


def on_backend(t: torch.Tensor) -> torch.Tensor:
    return t.cuda() if dist.get_backend() == "nccl" else t


def broadcast_int(value: int, src: int = 0) -> int:
    """Rank src's value on every rank (so all ranks take the same branch)."""
    if not distributed():
        return value
    t = on_backend(torch.tensor([value], dtype=torch.int64))
    dist.broadcast(t, src=src)
    return int(t.item())


def reduce_int(value: int, op) -> int:
    if not distributed():
        return value
    t = on_backend(torch.tensor([value], dtype=torch.int64))
    dist.all_reduce(t, op=op)
    return int(t.item())


def max_int(value: int) -> int:
    """The largest value over all ranks (a barrier that also says whether any rank failed)."""
    return reduce_int(value, dist.ReduceOp.MAX if distributed() else None)


def min_int(value: int) -> int:
    return reduce_int(value, dist.ReduceOp.MIN if distributed() else None)


def all_gather_json(obj) -> list:
    """Every rank's JSON value, in rank order (JSON over the wire: nothing is unpickled)."""
    if not distributed():
        return [obj]
    data = json.dumps(obj).encode()
    size = on_backend(torch.tensor([len(data)], dtype=torch.int64))
    sizes = [torch.zeros_like(size) for _ in range(dist.get_world_size())]
    dist.all_gather(sizes, size)
    longest = max(int(s.item()) for s in sizes)
    buf = torch.zeros(longest, dtype=torch.uint8)
    buf[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    buf = on_backend(buf)
    bufs = [torch.zeros_like(buf) for _ in sizes]
    dist.all_gather(bufs, buf)
    return [json.loads(bytes(b[:int(s.item())].cpu().numpy())) for b, s in zip(bufs, sizes)]


def broadcast_bytes(data: bytes, src: int) -> bytes:
    """Rank src's bytes on every rank."""
    size = broadcast_int(len(data), src)
    buf = torch.zeros(size, dtype=torch.uint8)
    if dist.get_rank() == src and size:
        buf[:] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    buf = on_backend(buf)
    dist.broadcast(buf, src=src)
    return bytes(buf.cpu().numpy())
