"""Numeric ranges shared by config files and command-line flags, and sizes in human units.

`Range` annotates a dataclass field (`lr: Annotated[float, Range(gt=0)]`); the TOML reader
checks it with the key's name. The `*_flag` functions are argparse `type=`s that check the
same things for flags. Every float must be finite: TOML and float() both accept inf and nan.
"""

from __future__ import annotations

import argparse
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Range:
    """Allowed interval of a number; None bounds are open. Checked after the finite check."""

    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None

    def problem(self, value) -> str | None:
        """Why value is not allowed (to follow the key's name), or None."""
        if isinstance(value, float) and not math.isfinite(value):
            return f"must be a finite number, got {value}"
        shown = _shown(value)
        if self.gt is not None and not value > self.gt:
            return f"must be greater than {_num(self.gt)}, got {shown}"
        if self.ge is not None and not value >= self.ge:
            return f"must be at least {_num(self.ge)}, got {shown}"
        if self.lt is not None and not value < self.lt:
            return f"must be less than {_num(self.lt)}, got {shown}"
        if self.le is not None and not value <= self.le:
            return f"must be at most {_num(self.le)}, got {shown}"
        return None


ANY = Range()
POSITIVE = Range(gt=0)
NON_NEGATIVE = Range(ge=0)
FRACTION = Range(ge=0, le=1)
COUNT = NON_NEGATIVE  # an int that may be 0
AT_LEAST_ONE = Range(ge=1)
INT64 = Range(ge=-(2**63), le=2**63 - 1)  # every integer key: what numpy, torch and JSON readers hold
SEED = Range(ge=0, le=2**32 - 1)  # numpy's legacy seeding and DataLoader workers take 32 bits

# Upper bounds of every count, size and scale a user writes (config keys and flags name them in their
# refusal): far above any real run, low enough that a typo cannot ask for years of steps or terabytes.
MAX_STEPS = 1_000_000_000  # optimizer steps (and step intervals): ~30 years at one step a second
MAX_EPOCHS = 100_000
MAX_LR = 10.0  # SGD or AdamW past it diverges on any network we train
MAX_WEIGHT_DECAY = 1.0  # AdamW multiplies each weight by 1 - lr x weight_decay
MAX_SCALE = 1000.0  # a multiplier: lr_mult, class weights
MAX_SAMPLES = 100_000  # samples held in memory at once (parity, calibration, verification): ~60 GB at 224 px
MAX_COUNT = 100_000  # a small count: float layers, tuning trials, benchmark runs, shards, profiled steps
STEPS = Range(ge=0, le=MAX_STEPS)
STEPS_AT_LEAST_ONE = Range(ge=1, le=MAX_STEPS)
EPOCHS = Range(ge=0, le=MAX_EPOCHS)
EPOCHS_AT_LEAST_ONE = Range(ge=1, le=MAX_EPOCHS)
LEARNING_RATE = Range(gt=0, le=MAX_LR)
WEIGHT_DECAY = Range(ge=0, le=MAX_WEIGHT_DECAY)
SCALE = Range(gt=0, le=MAX_SCALE)
SAMPLES = Range(ge=1, le=MAX_SAMPLES)
SAMPLES_OR_ALL = Range(ge=0, le=MAX_SAMPLES)  # 0: every sample there is
SMALL_COUNT = Range(ge=0, le=MAX_COUNT)
SMALL_COUNT_AT_LEAST_ONE = Range(ge=1, le=MAX_COUNT)
TOLERANCE = Range(ge=0, le=1e6)  # an error allowed (relative, or in logits)
SECONDS = Range(gt=0, le=7 * 86400.0)  # a timeout: at most a week
QAT_LR_SCALE = Range(gt=0, le=10)  # quantization-aware fine-tuning's lr: the training lr times this


@dataclass(frozen=True)
class PathText:
    """Annotates a string field that names a file or directory (`out_dir: Annotated[str, PATH]`):
    the TOML reader refuses what no file system takes, naming the key, before any path is built
    from it (a 5,000-character out_dir was an OSError, a newline in a name split the error line)."""


PATH = PathText()
NAME_MAX = 255  # bytes of one name in a path (Linux, every file system we write)
PATH_MAX = 4095  # bytes of a whole path, without the terminating NUL


def path_problem(text: str) -> str | None:
    """Why text cannot name a file (to follow the key's name), or None."""
    control = next((c for c in text if ord(c) < 32 or ord(c) == 127), None)
    if control is not None:
        return f"must not contain a control character ({control!r}), got {shown(text)}"
    size = len(os.fsencode(text))
    if size > PATH_MAX:
        return f"must be a path of at most {PATH_MAX} bytes, got {size} bytes"
    longest = max(text.split("/"), key=lambda part: len(os.fsencode(part)))
    if len(os.fsencode(longest)) > NAME_MAX:
        return (f"must have names of at most {NAME_MAX} bytes between its slashes, got one of "
                f"{len(os.fsencode(longest))} bytes ({shown(longest, 40)})")
    return None


def shown(value, limit: int = 100) -> str:
    """repr(value) for a message, cut to about `limit` characters with what was left out said: a
    100,000-character string or a list of 5,000 numbers made an error "line" of that size."""
    text = repr(value)
    if len(text) <= limit:
        return text
    size = (f"a list of {len(value)} items" if isinstance(value, (list, tuple)) else
            f"a table of {len(value)} keys" if isinstance(value, dict) else
            f"{len(value)} characters" if isinstance(value, str) else f"{len(text)} characters")
    return f"{text[:max(limit - 20, 10)]}... ({size})"


def one_line(message: str, limit: int = 4000) -> str:
    """An error message as the single line the CLI prints: control characters (a newline from a
    value, an escape sequence) shown escaped, and a message of more than `limit` characters cut."""
    text = "".join(c if c.isprintable() or c == " " else ascii(c)[1:-1] for c in message)
    if len(text) > limit:
        text = f"{text[:limit - 40]}... ({len(text)} characters in all)"
    return text


MAX_NPROC = 1024  # processes per node: one per GPU, or CPU processes; far above any machine's


def nproc_problem(text: str) -> str | None:
    """Why text is not a processes-per-node value ("auto" or 1..MAX_NPROC), or None (shared by
    --nproc-per-node and [pipeline] nproc_per_node)."""
    if text == "auto" or (re.fullmatch(r"[0-9]{1,6}", text) and 1 <= int(text) <= MAX_NPROC):
        return None
    return f"must be 'auto' or a number of processes from 1 to {MAX_NPROC}, got {shown(text)}"


def _shown(value) -> str:
    """A number for a message: an integer of hundreds of digits is described, not printed."""
    if isinstance(value, int) and value.bit_length() > 100:
        return f"an integer of about {int(value.bit_length() * 0.30103) + 1} digits"
    return str(value)


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


class OneLineParser(argparse.ArgumentParser):
    """An ArgumentParser whose mistakes are one `PROG: error: ...` line (no usage block first, which
    buried the line that mattered); its sub-parsers are of the same class."""

    def error(self, message: str):
        self.exit(2, one_line(f"{self.prog}: error: {message} (see {self.prog} --help)") + "\n")


INTEGER_TEXT = re.compile(r"[+-]?[0-9]+")
FLOAT_TEXT = re.compile(r"[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?|[+-]?(inf|infinity|nan)", re.IGNORECASE)


# --- argparse types: `p.add_argument("--max-drop", type=non_negative_float)` -------------------

def _flag(parse, allowed: Range, what: str):
    def convert(text: str):
        if "\0" in text:
            raise argparse.ArgumentTypeError(f"must be {what}, got a NUL character in {text!r}")
        # int() and float() also take " 2", "1_0" and other scripts' digits ("٣"): a flag is plain ASCII.
        plain = INTEGER_TEXT if parse is int else FLOAT_TEXT
        if not plain.fullmatch(text):
            raise argparse.ArgumentTypeError(f"must be {what}, got {shown(text)}")
        try:
            value = parse(text)
        except (ValueError, OverflowError):
            raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}") from None
        problem = allowed.problem(value) or (INT64.problem(value) if parse is int else None)
        if problem:
            raise argparse.ArgumentTypeError(problem)
        return value

    convert.__name__ = what  # argparse names the type in some messages
    return convert


finite_float = _flag(float, ANY, "a number")
positive_float = _flag(float, POSITIVE, "a number")
non_negative_float = _flag(float, NON_NEGATIVE, "a number")
fraction_float = _flag(float, FRACTION, "a number in [0, 1]")
non_negative_int = _flag(int, COUNT, "an integer")
positive_int = _flag(int, AT_LEAST_ONE, "an integer")


def int_in(allowed: Range, what: str):
    """An argparse type: an integer within `allowed` (the bound is in the message)."""
    return _flag(int, allowed, what)


def float_in(allowed: Range, what: str = "a number"):
    """An argparse type: a finite number within `allowed` (the bound is in the message)."""
    return _flag(float, allowed, what)


def _path_checked(check):
    """An argparse type from check(text): a path the OS cannot even look at (a name too long, a
    component past the length limit) is one line like any other refusal."""
    def parse(text: str) -> str:
        try:
            return check(text)
        except OSError as err:
            shown = text if len(text) <= 80 else text[:60] + f"... ({len(text)} characters)"
            raise argparse.ArgumentTypeError(f"{shown}: {err.strerror or err}") from None
    parse.__name__, parse.__doc__ = check.__name__, check.__doc__
    return parse


@_path_checked
def output_dir(text: str) -> str:
    """--out DIR: refused at parse time when it is an existing file or a directory we cannot write."""
    if "\0" in text:
        raise argparse.ArgumentTypeError(f"{text!r} contains a NUL character")
    path = Path(text)
    if path.exists() and not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} exists and is not a directory")
    probe = path if path.exists() else next((p for p in path.absolute().parents if p.exists()), None)
    if probe is not None and probe.is_dir() and not os.access(probe, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"{text}: {probe} is not writable")
    return text


@_path_checked
def input_dir(text: str) -> str:
    """A directory argument that must exist (--qat RUN_DIR): an empty value, a file or a device is
    refused at parse time, not found later as an internal NotADirectoryError."""
    if not text:
        raise argparse.ArgumentTypeError("must name a directory, got an empty value")
    if "\0" in text:
        raise argparse.ArgumentTypeError(f"{text!r} contains a NUL character")
    path = Path(text)
    if not path.exists():
        raise argparse.ArgumentTypeError(f"{text}: no such directory")
    if not path.is_dir():
        what = "a file" if path.is_file() else "a device, pipe or socket"
        raise argparse.ArgumentTypeError(f"{text} is {what}, not a directory")
    return text


@_path_checked
def output_file(text: str) -> str:
    """--out FILE: refused at parse time when it is an existing directory (or not a regular file)
    or its directory is not writable, before the work that would write it."""
    if "\0" in text:
        raise argparse.ArgumentTypeError(f"{text!r} contains a NUL character")
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a directory; give the file to write (e.g. {path / 'out.tar'})")
    if path.exists() and not path.is_file():
        raise argparse.ArgumentTypeError(f"{text} exists and is not a regular file")
    probe = next((p for p in path.absolute().parents if p.exists()), None)
    if probe is not None and (not probe.is_dir() or not os.access(probe, os.W_OK | os.X_OK)):
        raise argparse.ArgumentTypeError(f"{text}: {probe} is not a writable directory")
    return text


# --- sizes -----------------------------------------------------------------------------------------

def human_bytes(n: float) -> str:
    """1536 -> '1.5 KiB'; three significant figures in the largest unit that keeps it >= 1."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} B" if unit == "B" else f"{n:.3g} {unit}"
        n /= 1024
    raise AssertionError("unreachable")
