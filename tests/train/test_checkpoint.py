"""The checkpoint manager on real files: round trip, retention, damage, pickles, full disk."""

import json
import pickle

import pytest
import torch

from appliance.core.errors import EnvironmentProblem
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


def test_directory_without_commit_marker_is_reported_and_never_overwritten(tmp_path):
    model, opt = _trained()
    manager = CheckpointManager(tmp_path / "ck")
    _save(manager, 1, model, opt)
    newest = _save(manager, 2, model, opt)
    (newest / COMMIT_MARKER).unlink()
    weights = (newest / "model.safetensors").read_bytes()
    messages = []
    restarted = CheckpointManager(tmp_path / "ck", log=messages.append)  # the next run starting up
    assert len(messages) == 1
    assert f"warning: checkpoint {newest} has no COMMITTED marker" in messages[0]
    assert "moved to uncommitted-step-00000002" in messages[0]
    assert restarted.load_latest().step == 1
    _save(restarted, 2, *_trained(seed=3))  # redoing step 2 does not touch the reported one
    assert (tmp_path / "ck" / "uncommitted-step-00000002" / "model.safetensors").read_bytes() == weights
    assert [s for s, _ in restarted.committed()] == [1, 2]


def _rewrite_sums(path):
    """What an attacker or a bad copy tool could do: checksums that match the changed files."""
    import hashlib
    lines = [f"{hashlib.sha256(p.read_bytes()).hexdigest()}  {p.name}\n"
             for p in sorted(path.iterdir()) if p.name not in ("SHA256SUMS", COMMIT_MARKER)]
    (path / "SHA256SUMS").write_text("".join(lines))


def _sums_non_utf8(path):
    (path / "SHA256SUMS").write_bytes(b"\xff\xfe" + (path / "SHA256SUMS").read_bytes())


def _sums_truncated(path):
    text = (path / "SHA256SUMS").read_bytes()
    (path / "SHA256SUMS").write_bytes(text[: len(text) // 2])


def _sums_truncated_at_line_end(path):
    lines = (path / "SHA256SUMS").read_text().splitlines(keepends=True)
    (path / "SHA256SUMS").write_text("".join(lines[:-2]))  # two files no longer listed


def _trainer_is_a_list(path):
    (path / "trainer.json").write_text("[1, 2, 3]")
    _rewrite_sums(path)


def _trainer_step_is_a_string(path):
    trainer = json.loads((path / "trainer.json").read_text())
    (path / "trainer.json").write_text(json.dumps({**trainer, "step": "2"}))
    _rewrite_sums(path)


def _rng_not_utf8(path):
    (path / "rng-rank0.json").write_bytes(b"\x80\x81")
    _rewrite_sums(path)


def _marker_empty(path):
    (path / COMMIT_MARKER).write_bytes(b"")


def _marker_other_step(path):
    (path / COMMIT_MARKER).write_text('{"step": 7, "files": 8}')


@pytest.mark.parametrize("damage, named", [
    (_sums_non_utf8, "SHA256SUMS is not text (byte 0 is not UTF-8)"),
    (_sums_truncated, "SHA256SUMS is truncated"),
    (_sums_truncated_at_line_end, "unexpected files ['rng-rank0.json', 'trainer.json']"),
    (_trainer_is_a_list, "trainer.json holds a JSON list, expected a dict"),
    (_trainer_step_is_a_string, "trainer.json: 'step' is missing or not int"),
    (_rng_not_utf8, "rng-rank0.json is unreadable (byte 0 is not UTF-8)"),
    (_marker_empty, "COMMITTED is unreadable (not JSON"),
    (_marker_other_step, "COMMITTED names step 7, not this directory's"),
])
def test_malformed_checkpoint_file_is_moved_aside_naming_the_file(tmp_path, damage, named):
    model, opt = _trained()
    messages = []
    manager = CheckpointManager(tmp_path / "ck", log=messages.append)
    _save(manager, 1, model, opt)
    newest = _save(manager, 2, model, opt)
    damage(newest)
    ckpt = manager.load_latest()
    assert ckpt.step == 1
    assert len(messages) == 1 and messages[0].startswith(f"warning: checkpoint {newest} skipped: {named}"), messages
    assert "moved to damaged-step-00000002, trying the previous one" in messages[0]
    assert (tmp_path / "ck" / "damaged-step-00000002").is_dir() and not newest.exists()


def test_resume_dir_that_is_not_a_checkpoint_is_named(tmp_path):
    from appliance.train.checkpoint import CheckpointDamaged

    manager = CheckpointManager(tmp_path / "ck")
    with pytest.raises(CheckpointDamaged, match="does not exist or is a file"):
        manager.load(tmp_path / "nowhere")
    with pytest.raises(CheckpointDamaged, match=r"is not a checkpoint directory \(step-NNNNNNNN\)"):
        manager.load(tmp_path)


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
    assert "trainer.json is unreadable" in messages[0]
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


@pytest.fixture
def small_disk(tmp_path):
    """A real 6 MiB filesystem: room for one small checkpoint, not for a big one."""
    import subprocess
    mount = tmp_path / "disk"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=6m", "tmpfs", str(mount)], check=True)
    try:
        yield mount
    finally:
        subprocess.run(["umount", "--lazy", str(mount)], check=True)  # lazy: mmapped tensors may still be open


def test_free_space_pre_check_prints_sizes_in_sensible_units(small_disk):
    model, opt = _trained()
    manager = CheckpointManager(small_disk / "ck", min_free_bytes=8 * 2**20)
    with pytest.raises(EnvironmentProblem) as err:
        _save(manager, 1, model, opt)
    # 6 MiB free; need 8 MiB + 1.1 x the 1.7 MB of tensors (not "0.01 GiB free, need 0.01 GiB")
    import re
    assert re.search(r": not enough free disk for a checkpoint: 6 MiB free, need 9\.\d\d MiB \(checkpoint "
                     r"\+ \[checkpoint\] min_free_gb\); nothing was written\.", str(err.value)), str(err.value)


def test_disk_full_mid_save_is_one_line_and_the_previous_checkpoint_resumes(small_disk):
    from appliance.models import build_model

    model, opt = _trained()
    manager = CheckpointManager(small_disk / "ck")
    _save(manager, 1, model, opt)  # about 1.7 MB
    # A model with a 5000-class head: about 9 MB, more than the disk has left. The free-space
    # pre-check sizes from the newest checkpoint, so this write starts and runs out mid-file.
    torch.manual_seed(0)
    big = build_model("small_cnn", 5000, 1)
    big_opt = torch.optim.AdamW(big.parameters(), lr=1e-2)
    big(torch.randn(2, 1, 8, 8)).sum().backward()
    big_opt.step()
    with pytest.raises(EnvironmentProblem) as err:
        _save(manager, 2, big, big_opt)
    assert str(err.value) == (f"{small_disk / 'ck'}: no space left on device while writing step-00000002: "
                              "the previous checkpoint step-00000001 is intact; free space, then resume "
                              "with the same command")
    assert sorted(p.name for p in (small_disk / "ck").iterdir()) == ["step-00000001"]  # no half-written leftovers
    resumed = CheckpointManager(small_disk / "ck").load_latest()  # verifies every checksum
    assert resumed.step == 1
    assert all(torch.equal(resumed.model_state[k], v) for k, v in model.state_dict().items())
    import subprocess
    subprocess.run(["mount", "-o", "remount,size=32m", str(small_disk)], check=True)  # space freed
    _save(manager, 2, big, big_opt)
    assert CheckpointManager(small_disk / "ck").load_latest().step == 2


def test_state_files_are_json_and_safetensors_only(tmp_path):
    model, opt = _trained()
    path = _save(CheckpointManager(tmp_path / "ck"), 3, model, opt)
    names = sorted(p.name for p in path.iterdir())
    assert names == ["COMMITTED", "SHA256SUMS", "model.json", "model.safetensors", "optimizer.json",
                     "optimizer.safetensors", "rng-rank0.json", "trainer.json"]
    for name in names:
        if name.endswith(".json") or name == COMMIT_MARKER:
            json.loads((path / name).read_text())


def _card_key_added(path):
    card = json.loads((path / "model.json").read_text())
    (path / "model.json").write_text(json.dumps({**card, "payload": "x"}))
    _rewrite_sums(path)


def _card_extra_key_added(path):
    card = json.loads((path / "model.json").read_text())
    (path / "model.json").write_text(json.dumps({**card, "extra": {**card["extra"], "run_me": "rm -rf"}}))
    _rewrite_sums(path)


def _card_mean_changed(path):
    card = json.loads((path / "model.json").read_text())
    (path / "model.json").write_text(json.dumps({**card, "mean": [0.0]}))
    _rewrite_sums(path)


@pytest.mark.parametrize("damage, named", [
    (_card_key_added, "model.json: keys payload added, none missing against the card this run writes"),
    (_card_extra_key_added, "model.json: keys extra.run_me added, none missing"),
    (_card_mean_changed, "model.json: mean differ from the card this run writes"),
])
def test_a_changed_model_card_is_refused_on_resume(tmp_path, damage, named):
    """Extra keys in a checkpoint's model.json, sums rewritten, resumed silently: the card must be the
    one this run writes (export reads it from the checkpoint)."""
    model, opt = _trained()
    messages = []
    manager = CheckpointManager(tmp_path / "ck", log=messages.append, card=CARD)
    _save(manager, 1, model, opt)
    damage(_save(manager, 2, model, opt))
    assert manager.load_latest().step == 1
    assert len(messages) == 1 and f"skipped: {named}" in messages[0], messages
