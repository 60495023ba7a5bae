"""The checkpoint manager on real files: round trip, retention, damage, pickles, full disk."""

import json
import pickle

import pytest
import torch

from appliance.errors import EnvironmentProblem
from appliance.train.checkpoint import COMMIT_MARKER, CheckpointManager
from appliance.train.determinism import rng_state
from appliance.models import ModelCard, build_model, load_trained_model

CARD = ModelCard(architecture="small_cnn", num_classes=3, in_channels=1, image_size=8, mean=(0.5,), std=(0.25,),
                 channel_order="L", class_names=("a", "b", "c"))


def _trained(seed=0):
    """A small CNN and an AdamW that has taken two real steps (so it has state tensors)."""
    torch.manual_seed(seed)
    model = build_model("small_cnn", 3, 1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(2):
        loss = model(torch.randn(4, 1, 8, 8)).logsumexp(1).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def _save(manager, step, model, opt, metrics=None):
    trainer = {"epoch": 0, "batches_done": step, "sampler": {}, "scheduler": {}, "scaler": {},
               "metrics": metrics or {}, "config_hash": "h"}
    return manager.save(step, model=model, card=CARD, optimizer_state=opt.state_dict(), optimizer_sharded=False,
                        trainer=trainer, rng=rng_state())


def test_round_trip_is_exact_and_is_a_trained_model_directory(tmp_path):
    model, opt = _trained()
    manager = CheckpointManager(tmp_path / "ck")
    path = _save(manager, 7, model, opt)
    assert path.name == "step-00000007" and (path / COMMIT_MARKER).is_file()
    ckpt = manager.load_latest()
    assert ckpt.step == 7
    for key, value in model.state_dict().items():
        assert torch.equal(ckpt.model_state[key], value), key
    fresh_model, _ = _trained(seed=1)
    fresh = torch.optim.AdamW(fresh_model.parameters(), lr=1e-2)
    fresh.load_state_dict(ckpt.optimizer_state)
    for (i, a), (j, b) in zip(opt.state_dict()["state"].items(), fresh.state_dict()["state"].items()):
        assert i == j and all(torch.equal(a[k], b[k]) for k in a)
    # export reads checkpoint directories as trained-model directories
    loaded, card = load_trained_model(path)
    assert card == CARD
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in model.state_dict().items())
    sums = (path / "SHA256SUMS").read_text()
    assert "model.safetensors" in sums and "rng-rank0.json" in sums and "trainer.json" in sums


def test_retention_keep_last_2_best_1_over_10_saves(tmp_path):
    model, opt = _trained()
    manager = CheckpointManager(tmp_path / "ck", keep_last=2, keep_best=1, monitor="val_loss", mode="min")
    losses = [0.9, 0.7, 0.8, 0.5, 0.6, 0.65, 0.55, 0.58, 0.52, 0.51]  # best: save 4 (step 40)
    for i, loss in enumerate(losses, start=1):
        _save(manager, i * 10, model, opt, {"val_loss": loss})
        steps = [s for s, _ in manager.committed()]
        assert steps[-1] == i * 10  # the resume point always survives
        assert len(steps) <= 3
    assert [p.name for _, p in manager.committed()] == ["step-00000040", "step-00000090", "step-00000100"]
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == ["step-00000040", "step-00000090", "step-00000100"]


def test_newest_is_kept_even_when_keep_last_is_exceeded_by_best(tmp_path):
    model, opt = _trained()
    manager = CheckpointManager(tmp_path / "ck", keep_last=1, keep_best=1, mode="max", monitor="val_acc")
    _save(manager, 1, model, opt, {"val_acc": 0.9})
    _save(manager, 2, model, opt, {"val_acc": 0.1})
    assert [s for s, _ in manager.committed()] == [1, 2]


@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_damaged_newest_falls_back_to_previous_with_a_message(tmp_path, damage):
    model, opt = _trained()
    messages = []
    manager = CheckpointManager(tmp_path / "ck", log=messages.append)
    _save(manager, 1, model, opt)
    newest = _save(manager, 2, model, opt)
    target = newest / ("model.safetensors" if damage == "truncate" else "optimizer.safetensors")
    blob = bytearray(target.read_bytes())
    if damage == "truncate":
        blob = blob[: len(blob) // 2]
    else:
        blob[len(blob) // 2] ^= 0x01
    target.write_bytes(bytes(blob))
    ckpt = manager.load_latest()
    assert ckpt.step == 1
    assert len(messages) == 1 and str(newest) in messages[0] and target.name in messages[0]
    assert "sha256" in messages[0]
    # kept for inspection under a name that is never loaded
    assert (tmp_path / "ck" / "damaged-step-00000002" / target.name).is_file()
    assert [s for s, _ in manager.committed()] == [1]


def test_directory_without_commit_marker_is_ignored(tmp_path):
    model, opt = _trained()
    manager = CheckpointManager(tmp_path / "ck")
    _save(manager, 1, model, opt)
    newest = _save(manager, 2, model, opt)
    (newest / COMMIT_MARKER).unlink()
    assert manager.load_latest().step == 1
    assert [s for s, _ in manager.committed()] == [1]


class _Payload:
    """Unpickling this creates a file: proof that something was unpickled."""

    def __init__(self, witness):
        self.witness = str(witness)

    def __reduce__(self):
        return (open, (self.witness, "w"))


def test_planted_pickle_is_never_executed(tmp_path):
    model, opt = _trained()
    messages = []
    manager = CheckpointManager(tmp_path / "ck", log=messages.append)
    _save(manager, 1, model, opt)
    newest = _save(manager, 2, model, opt)
    witness = tmp_path / "pwned"
    # An attacker who can also rewrite SHA256SUMS: checksums pass, the state file is a pickle.
    for name in ("trainer.json", "optimizer.json"):
        (newest / name).write_bytes(pickle.dumps(_Payload(witness)))
    import hashlib
    lines = [f"{hashlib.sha256(p.read_bytes()).hexdigest()}  {p.name}\n"
             for p in sorted(newest.iterdir()) if p.name not in ("SHA256SUMS", COMMIT_MARKER)]
    (newest / "SHA256SUMS").write_text("".join(lines))
    ckpt = manager.load_latest()
    assert ckpt.step == 1
    assert not witness.exists()
    assert "unreadable" in messages[0]
    # A pickle dropped next to the state files is not loaded either: the directory is refused.
    (tmp_path / "ck" / "step-00000001" / "extra.pt").write_bytes(pickle.dumps(_Payload(witness)))
    assert manager.load_latest() is None
    assert not witness.exists()
    assert "unexpected files ['extra.pt']" in messages[-1]


def test_full_disk_refuses_before_writing_anything(tmp_path):
    model, opt = _trained()
    manager = CheckpointManager(tmp_path / "ck", min_free_bytes=10**18)
    with pytest.raises(EnvironmentProblem, match="not enough free disk for a checkpoint"):
        _save(manager, 1, model, opt)
    assert list((tmp_path / "ck").iterdir()) == []


def test_state_files_are_json_and_safetensors_only(tmp_path):
    model, opt = _trained()
    path = _save(CheckpointManager(tmp_path / "ck"), 3, model, opt)
    names = sorted(p.name for p in path.iterdir())
    assert names == ["COMMITTED", "SHA256SUMS", "model.json", "model.safetensors", "optimizer.json",
                     "optimizer.safetensors", "rng-rank0.json", "trainer.json"]
    for name in names:
        if name.endswith(".json") or name == COMMIT_MARKER:
            json.loads((path / name).read_text())
