"""Shared, expensive things built once per session: a small trained CNN and its exports.

The model is a real small_cnn trained for a few seconds on a synthetic 4-class image set
(a bright square in one quadrant per class, plus noise) so that accuracy is meaningful for
the quantization gate, and every tensor goes through the one shared preprocessing function.
"""

from __future__ import annotations

import numpy as np
import pytest

from data_tools.preprocessing import preprocess_image, preprocessing_of

IMAGE_SIZE, CLASSES = 16, 4


def synthetic_images(n: int, seed: int):
    """uint8 (n, 20, 20, 3) images and labels; 20 px so preprocessing really resizes to 16."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, CLASSES, n)
    images = rng.integers(0, 90, (n, 20, 20, 3)).astype(np.uint8)
    for img, label in zip(images, labels):
        r, c = divmod(int(label), 2)
        img[r * 10 + 2:r * 10 + 8, c * 10 + 2:c * 10 + 8, label % 3] = rng.integers(170, 255)
    return images, labels


@pytest.fixture(scope="session")
def card():
    from appliance.models import ModelCard

    return ModelCard("small_cnn", CLASSES, 3, IMAGE_SIZE, mean=(0.2, 0.2, 0.2), std=(0.3, 0.3, 0.3),
                     class_names=("north-west", "north-east", "south-west", "south-east"))


@pytest.fixture(scope="session")
def val_images():
    return synthetic_images(96, seed=1)


@pytest.fixture(scope="session")
def val_npz(tmp_path_factory, val_images, card):
    """Preprocessed validation tensors with labels, as a .npz file."""
    images, labels = val_images
    x = np.stack([preprocess_image(img, preprocessing_of(card)) for img in images])
    path = tmp_path_factory.mktemp("data") / "val.npz"
    np.savez(path, x=x, y=labels)
    return path


def write_image_tfrecord(path, images, labels, class_names):
    """Real TFRecord bytes of tf.train.Example images with the TF-slim keys, PNG-encoded."""
    import io

    from PIL import Image

    from data_tools.example import encode_example
    from data_tools.tfrecord import write_records

    def example(img, label):
        buf = io.BytesIO()
        Image.fromarray(img).save(buf, format="PNG")
        return encode_example({"image/encoded": buf.getvalue(), "image/format": b"png",
                               "image/class/label": int(label), "image/class/text": class_names[label]})

    write_records(path, (example(img, label) for img, label in zip(images, labels)))
    return path


@pytest.fixture(scope="session")
def val_tfrecord(tmp_path_factory, val_images, card):
    images, labels = val_images
    return write_image_tfrecord(tmp_path_factory.mktemp("data") / "val.tfrecord", images, labels, card.class_names)


@pytest.fixture(scope="session")
def calib_tfrecord(tmp_path_factory, card):
    images, labels = synthetic_images(64, seed=2)
    return write_image_tfrecord(tmp_path_factory.mktemp("data") / "calib.tfrecord", images, labels, card.class_names)


@pytest.fixture(scope="session")
def run_dir(tmp_path_factory, card):
    """RUN_DIR/model/ as training writes it: a small_cnn trained to high accuracy."""
    import torch

    from appliance.models import build_model, save_trained_model

    torch.manual_seed(0)
    images, labels = synthetic_images(512, seed=0)
    x = torch.from_numpy(np.stack([preprocess_image(img, preprocessing_of(card)) for img in images]))
    y = torch.from_numpy(labels)
    model = build_model("small_cnn", CLASSES)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(6):
        for i in range(0, len(x), 64):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x[i:i + 64]), y[i:i + 64]).backward()
            opt.step()
    run = tmp_path_factory.mktemp("run")
    save_trained_model(run / "model", model.eval(), card)
    return run


@pytest.fixture(scope="session")
def exported(tmp_path_factory, run_dir, val_tfrecord):
    from appliance.deploy.export import export_model

    out = tmp_path_factory.mktemp("export")
    export_model(run_dir, out, sample_files=[val_tfrecord])
    return out


@pytest.fixture(scope="session")
def compiled_arm(tmp_path_factory, exported):
    from appliance.deploy.compiler.driver import compile_model

    out = tmp_path_factory.mktemp("compile-arm")
    compile_model(exported / "model.onnx", "aarch64", out)
    return out


@pytest.fixture(scope="session")
def edge_package(tmp_path_factory, compiled_arm):
    from appliance.deploy.package import build_package

    out = tmp_path_factory.mktemp("package") / "edge-package.tar"
    build_package(compiled_arm, out)
    return out
