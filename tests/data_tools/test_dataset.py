"""Dataset and sampler: exactly once across 2 ranks x 3 DataLoader workers, same order per seed, exact resume."""

import io

import numpy as np
import pytest
import torch
from PIL import Image
from torch.utils.data import DataLoader

from appliance.core.errors import ConfigError, DataError
from data_tools.dataset import ShardedSampler, TFRecordDataset
from data_tools.example import encode_example
from data_tools.tfrecord import write_records

FILE_SIZES = [7, 1, 12, 5, 9]  # 34 samples, not a multiple of 2 ranks x 3 workers


@pytest.fixture
def shards(tmp_path):
    files, n = [], 0
    for f, size in enumerate(FILE_SIZES):
        path = tmp_path / f"shard-{f}.tfrecord"
        write_records(path, [encode_example({"id": n + i, "name": f"s{n + i}"}) for i in range(size)])
        files.append(path)
        n += size
    return files


pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create 3 worker processes")


def ids_of(loader, workers_seen=None):
    ids = []
    for batch in loader:
        ids += batch["id"]
        if workers_seen is not None:
            workers_seen.update(batch["worker"])
    return ids


def tag_worker(sample):
    sample["worker"] = torch.utils.data.get_worker_info().id
    return sample


def loader(dataset, sampler, workers=3):
    return DataLoader(dataset, batch_size=4, sampler=sampler, num_workers=workers,
                      collate_fn=lambda items: {k: [it[k] for it in items] for k in ("id", "worker")})


def epoch_ids(files, epoch, seed=1):
    dataset = TFRecordDataset(files, features={"id": "int"}, transform=tag_worker)
    per_rank = []
    for rank in range(2):
        sampler = ShardedSampler(dataset, rank=rank, world_size=2, seed=seed)
        sampler.set_epoch(epoch)
        workers = set()
        per_rank.append(ids_of(loader(dataset, sampler), workers))
        assert workers == {0, 1, 2}  # the epoch really was split across three worker processes
    return per_rank


def test_two_ranks_three_workers_see_every_sample_once(shards):
    ranks = epoch_ids(shards, epoch=0)
    union = ranks[0] + ranks[1]
    assert sorted(union) == list(range(sum(FILE_SIZES)))
    assert abs(len(ranks[0]) - len(ranks[1])) <= 1
    again = epoch_ids(shards, epoch=0)
    assert again == ranks  # same seed, same epoch: same order on every rank
    next_epoch = epoch_ids(shards, epoch=1)
    assert next_epoch != ranks and sorted(next_epoch[0] + next_epoch[1]) == sorted(union)


def test_resume_mid_epoch_yields_exactly_the_rest(shards):
    dataset = TFRecordDataset(shards, features={"id": "int"}, transform=tag_worker)
    sampler = ShardedSampler(dataset, rank=1, world_size=2, seed=5)
    sampler.set_epoch(3)
    full = ids_of(loader(dataset, sampler))
    # consume 2 batches, checkpoint, and continue in a "new process" from the saved state
    sampler = ShardedSampler(dataset, rank=1, world_size=2, seed=5)
    sampler.set_epoch(3)
    seen = []
    for batch in loader(dataset, sampler):
        seen += batch["id"]
        sampler.advance(len(batch["id"]))
        if len(seen) == 8:
            break
    state = sampler.state_dict()
    resumed = ShardedSampler(dataset, rank=1, world_size=2, seed=5)
    resumed.load_state_dict(state)
    resumed.set_epoch(3)  # a loop re-entering the same epoch keeps the position
    rest = ids_of(loader(dataset, resumed))
    assert seen + rest == full and len(rest) == len(full) - 8
    sought = ShardedSampler(dataset, rank=1, world_size=2, seed=5)
    sought.seek(3, 8)  # what a loop that counts batches does: 2 batches x 4 samples
    assert list(sought) == rest
    with pytest.raises(ConfigError, match="world_size"):
        ShardedSampler(dataset, rank=0, world_size=3, seed=5).load_state_dict(state)


def test_drop_last_gives_equal_shares(shards):
    shares = [ShardedSampler(34, rank=r, world_size=4, seed=0, drop_last=True).share() for r in range(4)]
    assert {len(s) for s in shares} == {8} and len(set(np.concatenate(shares).tolist())) == 32


def test_classification_samples_and_errors(tmp_path):
    def png(color, mode="RGB"):
        buf = io.BytesIO()
        Image.new(mode, (6, 4), color).save(buf, format="PNG")
        return buf.getvalue()

    path = tmp_path / "images.tfrecord"
    write_records(path, [
        encode_example({"image/encoded": png((255, 0, 0)), "image/format": "png", "image/class/label": 1}),
        encode_example({"image/encoded": png(128, "L"), "image/format": "png", "image/class/label": 0}),
        encode_example({"image/encoded": b"not an image", "image/class/label": 2}),
        encode_example({"image/class/label": 2}),
    ])
    dataset = TFRecordDataset.for_classification([path], transform=lambda im: torch.from_numpy(np.array(im)))
    image, label = dataset[0]
    assert label == 1 and image.shape == (4, 6, 3) and image[0, 0].tolist() == [255, 0, 0]
    assert dataset[1][0].shape == (4, 6, 3)  # grey converted to RGB
    with pytest.raises(DataError, match=r"images.tfrecord: record 2: feature 'image/encoded'"):
        dataset[2]
    with pytest.raises(DataError, match=r"record 3: feature 'image/encoded' is missing"):
        dataset[3]
    by_keys = TFRecordDataset([path], image_key="image/encoded", label_key="image/class/label", image_mode="L")
    assert by_keys[0][0].mode == "L" and by_keys[0][1] == 1
    raw = TFRecordDataset([path], features={"image/format": "str", "image/class/label": "int64[]"})
    assert raw[0] == {"image/format": "png", "image/class/label": np.array([1])}


DDP_SCRIPT = r"""
import json, sys
import torch.distributed as dist
from torch.utils.data import DataLoader
from data_tools.dataset import ShardedSampler, TFRecordDataset

dist.init_process_group("gloo")
files, out = json.loads(sys.argv[1]), sys.argv[2]
dataset = TFRecordDataset(files, features={"id": "int"})
sampler = ShardedSampler(dataset, seed=7)  # rank and world size from torch.distributed
sampler.set_epoch(2)
loader = DataLoader(dataset, batch_size=3, sampler=sampler, num_workers=3,
                    collate_fn=lambda items: [it["id"] for it in items])
ids = [i for batch in loader for i in batch]
with open(f"{out}/rank{dist.get_rank()}.json", "w") as f:
    json.dump({"ids": ids, "world": dist.get_world_size()}, f)
dist.destroy_process_group()
"""


@pytest.mark.slow
def test_real_torchrun_ranks_share_an_epoch_exactly_once(shards, tmp_path):
    """Two real gloo ranks under torchrun (offline, loopback only), three loader workers each."""
    import json
    import subprocess
    import sys

    from conftest import offline_cmd

    script = tmp_path / "ddp_epoch.py"
    script.write_text(DDP_SCRIPT)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(script), json.dumps([str(f) for f in shards]), str(tmp_path)]
    done = subprocess.run(offline_cmd(cmd, loopback=True), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert all(r["world"] == 2 for r in ranks)
    assert sorted(ranks[0]["ids"] + ranks[1]["ids"]) == list(range(sum(FILE_SIZES)))
    expected = [ShardedSampler(sum(FILE_SIZES), rank=r, world_size=2, seed=7).share(2).tolist() for r in range(2)]
    assert [r["ids"] for r in ranks] == expected
