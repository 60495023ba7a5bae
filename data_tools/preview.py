"""`appliance data preview FILE --out grid.png`: originals beside their augmented versions.

Row i is record i: the original (resized to fit), then what TrainTransform makes of it in
epochs E, E+1, ... (the same seeded parameters training uses), so a person sees what the model
will see before spending GPU hours on it.
"""

from __future__ import annotations

import os
from pathlib import Path

from appliance.core import values
from appliance.core.errors import ConfigError, DataError
from appliance.core.manifest import refuse_to_replace
from data_tools.image_decode import ImageProblem, decode_image


# A grid a person looks at: --size 1000000 asked for terabytes (MemoryError), --variants 10^8 overflowed Pillow.
MAX_ROWS, MAX_VARIANTS, MAX_TILE = 256, 32, 1024
MAX_GRID_PIXELS = 64 << 20


def _int(low: int, high: int):
    return values.int_in(values.Range(ge=low, le=high), "an integer")


def _float(allowed):
    return values.float_in(allowed)


def register_data_verb(data_subparsers) -> None:
    p = data_subparsers.add_parser("preview", help="grid of original images beside augmented versions",
                                   description=__doc__.splitlines()[0])
    p.add_argument("file", metavar="FILE", help="TFRecord file")
    p.add_argument("--out", required=True, type=values.output_file, help="PNG to write")
    p.add_argument("--count", type=_int(1, MAX_ROWS), default=8, help=f"records (rows, at most {MAX_ROWS})")
    p.add_argument("--variants", type=_int(1, MAX_VARIANTS), default=4,
                   help=f"augmented versions per record (epochs, at most {MAX_VARIANTS})")
    p.add_argument("--size", type=_int(1, MAX_TILE), default=128, help=f"output image size in pixels (at most {MAX_TILE})")
    p.add_argument("--seed", type=values.int_in(values.SEED, "an integer"), default=0)
    p.add_argument("--epoch", type=values.int_in(values.EPOCHS, "an integer"), default=0, help="first epoch shown")
    # The ranges of the config's [augment] keys (appliance/train/config.py AugmentSection).
    p.add_argument("--degrees", type=_float(values.Range(ge=0, le=180)), default=15.0, help="rotation range, +/- degrees")
    p.add_argument("--hue", type=_float(values.Range(ge=0, le=0.5)), default=0.1,
                   help="hue shift, +/- fraction of the colour circle (0.1 = 36 deg)")
    p.add_argument("--saturation", type=_float(values.Range(ge=0, lt=1)), default=0.1, help="saturation factor 1 +/- this")
    p.add_argument("--value", type=_float(values.Range(ge=0, lt=1)), default=0.1, help="value (brightness) factor 1 +/- this")
    p.add_argument("--image-key", default="image/encoded")
    p.set_defaults(func=preview_command)


def preview_command(args) -> int:
    rows = write_preview(args.file, args.out, count=args.count, variants=args.variants, size=args.size,
                         seed=args.seed, epoch=args.epoch, image_key=args.image_key,
                         degrees=args.degrees, hue=args.hue, saturation=args.saturation, value=args.value)
    print(f"wrote {args.out}: {rows} records x (original + {args.variants} augmented)")
    return 0


def write_preview(file, out, *, count=8, variants=4, size=128, seed=0, epoch=0, image_key="image/encoded",
                  **augment) -> int:
    """Write the grid PNG; returns the number of rows (records shown)."""
    pad = 4
    width, height = pad + (variants + 1) * (size + pad), pad + count * (size + pad)
    if width * height > MAX_GRID_PIXELS:
        raise ConfigError(f"data preview: --count {count}, --variants {variants} and --size {size} make a grid of "
                          f"{width}x{height} pixels; at most {MAX_GRID_PIXELS >> 20} M pixels")
    import numpy as np
    from PIL import Image, ImageOps, PngImagePlugin

    from data_tools import example, tfrecord  # late: numpy; this module registers a verb

    originals = []
    for number, data in enumerate(tfrecord.read_records(file)):
        try:
            encoded = example.decode_example(bytes(data), keys=[image_key]).get(image_key)
            if encoded:
                originals.append((number, decode_image(encoded[0], "RGB")))  # bounded: a bomb is skipped
        except (DataError, ImageProblem):
            continue  # `appliance data check` reports these; a preview shows what decodes
        if len(originals) >= count:
            break
    if not originals:
        raise DataError(f"{file}: no record with a decodable {image_key!r} image to preview")
    import torch  # only now: a bad file is reported without waiting for torch to load

    torch.set_num_threads(1)  # a few small images: intra-op threads only add contention

    from data_tools.augment import TrainTransform  # late: torch; this module registers a verb

    try:
        transform = TrainTransform(size, seed=seed, mean=None, std=None, **augment)
    except ValueError as err:
        raise ConfigError(f"data preview: {err}") from None

    grid = Image.new("RGB", (pad + (variants + 1) * (size + pad), pad + len(originals) * (size + pad)), "white")
    for row, (number, image) in enumerate(originals):
        y = pad + row * (size + pad)
        shown = ImageOps.contain(image, (size, size))
        grid.paste(shown, (pad + (size - shown.width) // 2, y + (size - shown.height) // 2))
        for v in range(variants):
            tensor = transform(image, index=number, epoch=epoch + v)
            pixels = (tensor.clamp(0, 1) * 255).round().to(dtype=torch.uint8)
            tile = Image.fromarray(np.ascontiguousarray(pixels.permute(1, 2, 0).numpy()))
            grid.paste(tile, (pad + (v + 1) * (size + pad), y))
    info = PngImagePlugin.PngInfo()
    info.add_text("Software", f"appliance data preview {file} (seed {seed}, epochs {epoch}..{epoch + variants - 1})")
    out = Path(out)
    refuse_to_replace(out)  # --out /dev/null: os.replace put the PNG in place of the device (as root)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    grid.save(tmp, format="PNG", pnginfo=info)
    os.replace(tmp, out)
    return len(originals)
