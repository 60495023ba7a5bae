"""Joint augmentation of an image and its boxes: the same seeded geometry moves both, so a kept box
still covers the object it covered, measured on the augmented pixels."""

import numpy as np
import torch

from data_tools.augment_boxes import MIN_VISIBLE, BoxTrainTransform, collate, targets, transform_boxes

H, W, SIZE = 60, 80, 64


def picture(x0, y0, x1, y1):
    image = np.zeros((H, W, 3), np.uint8)
    image[y0:y1, x0:x1] = 255
    return image


def bright_box(x: torch.Tensor):
    """The pixel box (x0, y0, x1, y1) of the bright object in an augmented [C, S, S] image in [0, 1], and its pixels."""
    on = (x.mean(0) > 0.5).numpy()
    ys, xs = np.nonzero(on)
    if not len(xs):
        return None, 0
    return np.array([xs.min(), ys.min(), xs.max() + 1, ys.max() + 1], float), int(on.sum())


def test_a_kept_box_covers_its_object_on_the_augmented_pixels():
    obj = (20, 12, 44, 40)  # 24 x 28 pixels
    image = picture(*obj)
    t = BoxTrainTransform(SIZE, seed=3, degrees=15.0, scale=(0.25, 1.0), mean=None, std=None)
    kept = rotated = flipped = dropped = 0
    for index in range(60):
        params = t.sample_params(H, W, index)
        x, boxes, labels = t(image, np.array([obj], np.float32), np.array([2]), index)
        assert x.shape == (3, SIZE, SIZE) and boxes.shape[1] == 4 and (boxes >= 0).all() and (boxes <= 1).all()
        seen, pixels = bright_box(x)
        scale = (SIZE / params.width) * (SIZE / params.height)
        if len(boxes) == 0:  # dropped: most of the object was cut away by the crop (or rotated out)
            dropped += 1
            assert pixels < 0.75 * 24 * 28 * scale, (index, pixels)
            continue
        kept += 1
        assert list(labels) == [2]
        box = boxes[0] * SIZE
        # Every bright pixel lies inside the box (1 pixel of interpolation), and the box is not much larger.
        assert seen is not None
        assert (seen[:2] >= box[:2] - 1.0).all() and (seen[2:] <= box[2:] + 1.0).all(), (index, seen, box, params)
        grow = 1.0 if abs(params.angle) < 1e-9 else 1 + np.sin(np.radians(abs(params.angle))) * 2
        assert (box[2] - box[0]) <= grow * (seen[2] - seen[0]) + 3 and (box[3] - box[1]) <= grow * (seen[3] - seen[1]) + 3
        rotated += abs(params.angle) > 5
        flipped += params.flip
    assert kept > 30 and rotated > 10 and flipped > 10 and dropped >= 1


def test_same_seed_same_sample_and_colour_leaves_boxes_alone():
    image = picture(10, 10, 30, 30)
    box = np.array([[10, 10, 30, 30]], np.float32)
    a = BoxTrainTransform(SIZE, seed=1, hue=0.1, saturation=0.1, value=0.1)
    b = BoxTrainTransform(SIZE, seed=1, hue=0.0, saturation=0.0, value=0.0)
    for index in range(5):
        xa, ba, _ = a(image, box, np.array([1]), index, epoch=2)
        xa2, ba2, _ = a(image, box, np.array([1]), index, epoch=2)
        _, bb, _ = b(image, box, np.array([1]), index, epoch=2)
        assert torch.equal(xa, xa2) and np.array_equal(ba, ba2) and np.array_equal(ba, bb)


def test_visible_fraction_rule_and_collate():
    from data_tools.augment import AugmentParams
    # A crop keeping the left half of the image: a box half inside stays (50 % >= 40 %), one 20 % inside goes.
    params = AugmentParams(top=0, left=0, height=60, width=40, flip=False, angle=0.0, hue_shift=0.0,
                           saturation_factor=1.0, value_factor=1.0)
    boxes, labels = transform_boxes(np.array([[30, 0, 50, 10], [36, 20, 56, 30]]), np.array([1, 2]), params, 40)
    assert MIN_VISIBLE == 0.4 and list(labels) == [1] and np.allclose(boxes[0], [30 / 40, 0, 1, 10 / 60])
    batch = collate([(torch.zeros(1, 4, 4), targets(boxes, labels)), (torch.zeros(1, 4, 4), targets(np.zeros((0, 4)), []))])
    assert batch[0].shape == (2, 1, 4, 4) and batch[1].shape == (2, 1, 5) and batch[1][1].abs().sum() == 0
