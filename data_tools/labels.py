"""The one definition of a valid class label and image feature, used by `appliance data check`
and by training.

A record's label is valid when its feature is present, holds int64 numbers (not bytes, not
floats), exactly one of them, and that one is a class: 0 <= label < num_classes. Its image
feature is present and holds exactly one bytes value (whether those bytes decode is the image
probe's question, data_tools.check.image_probe). The data check quarantines a record that fails
(with the reason); training refuses it with the record's address. So every record the check
passes, training accepts.
"""

from __future__ import annotations


# More classes than any classification head we train (ImageNet-21k has 21,841). A label past it
# is damage, not a class: counting classes up to it would allocate per class (2^62 did).
MAX_CLASSES = 100_000


def label_problem(value, key: str, num_classes: int | None) -> tuple[str, str] | None:
    """(check, detail) when `value` (a feature as decode_example gives it, None if absent) is not a
    valid label, else None. check is "schema" (missing or malformed) or "label_range", the data
    check's names for them.
    num_classes None: the classes are not known yet (0..MAX_CLASSES-1 are possible)."""
    if value is None:
        return "schema", f"missing required feature {key!r}"
    if not hasattr(value, "dtype"):  # decode_example gives bytes or a numpy array (numpy stays out of --help)
        return "schema", f"{key} holds bytes, not an integer class"
    if value.dtype.kind != "i":
        return "schema", f"{key} holds {value.dtype} numbers, not an int64 class"
    if len(value) != 1:
        return "schema", f"{key} has {len(value)} values; a class label is exactly one"
    label = int(value[0])
    if num_classes is None and not 0 <= label < MAX_CLASSES:
        return "label_range", f"{key} = {label} outside 0..{MAX_CLASSES - 1} (no more classes are supported)"
    if num_classes is not None and not 0 <= label < num_classes:
        return "label_range", f"{key} = {label} outside 0..{num_classes - 1}"
    return None


def image_problem(value, key: str) -> tuple[str, str] | None:
    """("schema", detail) when `value` (a feature as decode_example gives it, None if absent) is not
    one encoded image, else None. (The check inferred its schema from a sample: a record with no
    image, or two, in a file whose sample had one each passed it, and training refused it.)"""
    if value is None:
        return "schema", f"missing required feature {key!r}"
    if not isinstance(value, list):  # decode_example gives bytes values as a list, numbers as an array
        return "schema", f"{key} holds {value.dtype} numbers, not encoded image bytes"
    if len(value) != 1:
        return "schema", f"{key} has {len(value)} values; an image is exactly one"
    return None
