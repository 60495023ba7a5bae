"""Training with [augment]: seeded per (seed, epoch, sample index), only on the training split."""

import pytest
import torch

from appliance.core.errors import ConfigError
from appliance.train.config import load_config
from appliance.train.data import train_loader, val_loader
from train_data import make_config


def loaders(tmp_path, **augment):
    cfg = load_config(make_config(tmp_path, augment={"enabled": True, **augment}))
    gen = torch.Generator()
    epoched = train_loader(cfg, 0, 1, gen, False)[0].dataset  # (epoch, index) keys: persistent workers
    return cfg, epoched.dataset, val_loader(cfg, 0, 1, gen, False).dataset


def test_the_loader_passes_the_epoch_with_each_index(tmp_path):
    cfg, train, _ = loaders(tmp_path, crop_scale=[0.5, 1.0])
    epoched = train_loader(cfg, 0, 1, torch.Generator(), False)[0].dataset
    for epoch in (0, 1):
        train.set_epoch(epoch)
        assert torch.equal(epoched[(epoch, 3)][0], train[3][0])


def test_same_epoch_and_index_give_the_same_sample_and_epochs_differ(tmp_path):
    cfg, train, val = loaders(tmp_path, crop_scale=[0.5, 1.0])
    first, label = train[3]
    assert first.shape == (1, cfg.data.image_size, cfg.data.image_size) and first.dtype == torch.float32
    assert torch.equal(first, train[3][0])
    assert not torch.equal(first, train[4][0])
    train.set_epoch(1)
    assert not torch.equal(first, train[3][0])
    train.set_epoch(0)
    assert torch.equal(first, train[3][0])
    # Evaluation is never augmented: the plain preprocessing, identical every time.
    assert not hasattr(val, "set_epoch") and torch.equal(val[3][0], val[3][0])


def test_applied_parameters_stay_in_their_bounds(tmp_path):
    cfg, train, _ = loaders(tmp_path, degrees=10.0, hue=0.05, saturation=0.2, value=0.3)
    transform = train.transform
    for index in range(200):
        p = transform.sample_params(8, 8, index)
        assert abs(p.angle) <= 10.0 and abs(p.hue_shift) <= 0.05
        assert 0.8 <= p.saturation_factor <= 1.2 and 0.7 <= p.value_factor <= 1.3


@pytest.mark.parametrize("augment, message", [
    ({"hue": 0.7}, "[augment] hue"),
    ({"saturation": 1.5}, "[augment] saturation"),
    ({"crop_scale": [0.9, 0.5]}, "[augment] crop_scale"),
    ({"rotate": 5}, "[augment] unknown key 'rotate'"),
])
def test_bad_augment_values_name_the_key(tmp_path, augment, message):
    with pytest.raises(ConfigError) as err:
        load_config(make_config(tmp_path, augment=augment))
    assert message in str(err.value)
