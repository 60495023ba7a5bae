"""The model as it trains (appliance/train/ddp.py): [distributed] bucket_cap_mb and
gradient_as_bucket_view reach DistributedDataParallel and shape where its gradients live."""

import torch
import torch.distributed as dist

from appliance.train.config import load_config
from appliance.train.ddp import build_training_model
from train_data import make_config


def _gradient_storages(tmp_path, name, **distributed):
    cfg = load_config(make_config(tmp_path, name=name, distributed=distributed))
    wrapped, model, _, _ = build_training_model(cfg, torch.device("cpu"), log=lambda line: None)
    for _ in range(2):  # DDP lays out its buckets again after the first backward, in gradient order
        wrapped(torch.randn(4, 1, 8, 8)).sum().backward()
    grads = [p.grad for p in model.parameters()]
    return wrapped, len(grads), len({g.untyped_storage().data_ptr() for g in grads})


def test_bucket_size_and_bucket_views_reach_ddp(tmp_path):
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        wrapped, tensors, storages = _gradient_storages(tmp_path, "default")
        assert not wrapped.gradient_as_bucket_view and storages == tensors  # each gradient its own tensor
        assert wrapped.bucket_bytes_cap == 25 * 2**20 and wrapped.bucket_bytes_cap_default  # DDP's own layout
        # small_cnn's 0.55 MiB of gradients: one bucket at the default, one storage for all as views ...
        assert _gradient_storages(tmp_path, "views", gradient_as_bucket_view=True)[2] == 1
        # ... and one per bucket of at most 0.01 MiB (a bucket closes once past the cap).
        wrapped, tensors, storages = _gradient_storages(tmp_path, "small", bucket_cap_mb=0.01, gradient_as_bucket_view=True)
        assert wrapped.bucket_bytes_cap == int(0.01 * 2**20) and 1 < storages < tensors
    finally:
        dist.destroy_process_group()
