"""Block-style YAML for generated manifests, written without a YAML library.

A string of whole lines (a script, a config file) is a literal block (`|`), as people write them;
other strings are double-quoted (YAML's escapes for what is not printable), numbers, booleans and
null as JSON writes them (floats always with a point); YAML 1.2 and 1.1 readers read them back as
the same value: no string can turn into a number, a boolean or null
("yes", "1.10", "0x1F"), and the same data always gives the same bytes. Keys keep the order the
caller built them in, as people read Kubernetes manifests (apiVersion, kind, metadata, spec).
"""

from __future__ import annotations

import json
import re

_BARE_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_./-]*")
_ESCAPES = {'"': '\\"', "\\": "\\\\", "\n": "\\n", "\t": "\\t", "\r": "\\r"}
_WORDS = {"y", "n", "yes", "no", "true", "false", "on", "off", "null", "nan", "inf"}


def dump(data, indent: int = 2) -> str:
    """data (dicts, lists, str, int, float, bool, None) as one YAML document."""
    return "\n".join(_lines(data, 0, indent)) + "\n"


def dump_all(documents, header: str = "") -> str:
    """Several documents in one stream, separated by `---`; header lines become `#` comments."""
    comment = "".join(f"# {line}".rstrip() + "\n" for line in header.splitlines())
    return comment + "".join(f"---\n{dump(doc)}" for doc in documents)


def _scalar(value) -> str:
    if isinstance(value, float) and value != value:
        raise ValueError("NaN has no YAML form shared by every reader")
    if isinstance(value, float):  # YAML 1.1 reads 1e-05 as a string: its floats need a point
        mantissa, e, exponent = repr(value).partition("e")
        return mantissa + ("" if "." in mantissa else ".0") + e + exponent
    return _string(value) if isinstance(value, str) else json.dumps(value)


def _string(text: str) -> str:
    """A double-quoted scalar: YAML's printable characters as they are, every other one escaped
    (YAML refuses raw control characters, and reads JSON's surrogate pairs as two characters)."""
    out = []
    for ch in text:
        code = ord(ch)
        if ch in _ESCAPES:
            out.append(_ESCAPES[ch])
        elif 0x20 <= code <= 0x7E or 0xA0 <= code <= 0xD7FF or 0xE000 <= code <= 0xFFFD and code != 0xFEFF \
                or code >= 0x10000:
            out.append(ch)
        else:
            out.append(f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}")
    return '"' + "".join(out) + '"'


def _key(key) -> str:
    """Bare when no reader can take it for anything but that string (YAML 1.1 reads `yes`, `on`, `n`
    as booleans, `1e3` as a number); quoted otherwise."""
    if not isinstance(key, str):
        raise TypeError(f"YAML keys here are strings, got {type(key).__name__}")
    bare = _BARE_KEY.fullmatch(key) and key.lower() not in _WORDS
    return key if bare else _scalar(key)


def _literal(value) -> bool:
    """A string a `|` block gives back exactly: whole lines, one final newline, no leading blank,
    nothing a reader folds or strips (trailing spaces, carriage returns, other control characters)."""
    if not isinstance(value, str) or not value.endswith("\n") or value.endswith("\n\n") or value[0] in " \n":
        return False
    lines = value[:-1].split("\n")
    return all(line == line.rstrip() and line.isprintable() for line in lines)


def _lines(data, level: int, indent: int) -> list[str]:
    pad = " " * (level * indent)
    if _literal(data):
        return [pad + "|", *(pad + " " * indent + line if line else "" for line in data[:-1].split("\n"))]
    if isinstance(data, dict):
        if not data:
            return [pad + "{}"]
        out = []
        for key, value in data.items():
            if _literal(value):
                out += [f"{pad}{_key(key)}: |", *_lines(value, level, indent)[1:]]
            elif _is_block(value):
                out.append(f"{pad}{_key(key)}:")
                out += _lines(value, level + (0 if isinstance(value, list) else 1), indent)
            else:
                out.append(f"{pad}{_key(key)}: {_inline(value)}")
        return out
    if isinstance(data, list):
        if not data:
            return [pad + "[]"]
        out = []
        for item in data:
            if _literal(item):
                out += [f"{pad}- |", *(pad + "  " + line[len(pad):] if line else "" for line in _lines(item, level, indent)[1:])]
            elif _is_block(item):
                inner = _lines(item, level + 1, indent)
                first = inner[0][len(pad) + indent:]
                out.append(f"{pad}- {first}")
                out += [pad + "  " + line[len(pad) + indent:] for line in inner[1:]]
            else:
                out.append(f"{pad}- {_inline(item)}")
        return out
    return [pad + _inline(data)]


def _is_block(value) -> bool:
    return isinstance(value, (dict, list)) and bool(value)


def _inline(value) -> str:
    if isinstance(value, dict):
        return "{}"
    if isinstance(value, list):
        return "[]"
    return _scalar(value)
