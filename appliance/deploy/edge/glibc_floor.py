"""The glibc floor of an edge package: which symbol versions each shipped ELF file needs.

Read from the ELF files themselves (`.gnu.version_r` for the versions a file needs from each
library, `.dynsym` + `.gnu.version` for the symbols that need them), the same facts as
`objdump -T`, without binutils. No glibc 2.28 arm64 system exists to run on, so this reading is
the check: a binary that needs `__libc_start_main@GLIBC_2.34` will not start on glibc 2.31.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from pathlib import Path

from appliance.assets.edge_runner import DEFAULT_GLIBC_FLOOR  # noqa: F401 (the package default, one place)
from appliance.core.errors import DataError

SHT_DYNSYM, SHT_GNU_VERNEED, SHT_GNU_VERSYM = 11, 0x6FFFFFFE, 0x6FFFFFFF


@dataclass
class ElfNeeds:
    """Per version tag (e.g. 'GLIBC_2.34'), the undefined symbols that need it."""
    path: Path
    versions: dict[str, list[str]] = field(default_factory=dict)

    def highest(self, family: str) -> str | None:
        """The highest 'X.Y[.Z]' needed of a family ('GLIBC', 'GLIBCXX', 'CXXABI'), or None."""
        found = [tag.split("_", 1)[1] for tag in self.versions if tag.startswith(family + "_")]
        return max(found, key=version_key) if found else None


def version_key(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split(".") if part.isdigit())


def parse_floor(text: str) -> str:
    """'2.28' -> '2.28'; anything else is one line naming the flag."""
    parts = text.split(".")
    if len(parts) != 2 or not all(p.isdigit() for p in parts) or parts[0] != "2":
        raise DataError(f"--glibc-floor: expected a glibc version such as 2.28, got {text!r}")
    return text


def read_needs(path) -> ElfNeeds:
    """The symbol versions an ELF file needs from the libraries it links against."""
    path = Path(path)
    data = path.read_bytes()
    if data[:4] != b"\x7fELF":
        raise DataError(f"{path}: not an ELF file")
    if data[4] != 2 or data[5] != 1:
        raise DataError(f"{path}: not a 64-bit little-endian ELF file")
    try:
        return _read_needs(path, data)
    except (struct.error, IndexError, UnicodeDecodeError) as err:
        raise DataError(f"{path}: damaged ELF file ({err})") from None


def _read_needs(path: Path, data: bytes) -> ElfNeeds:
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
    # (name, type, flags, addr, offset, size, link, info, addralign, entsize)

    def string(section_index: int, offset: int) -> str:
        start = sections[section_index][4] + offset
        return data[start:data.index(b"\0", start)].decode()

    needs = ElfNeeds(path)
    index_to_tag: dict[int, str] = {}
    for s in sections:
        if s[1] != SHT_GNU_VERNEED:
            continue
        offset, count = s[4], s[7]
        for _ in range(count):
            _, aux_count, _, aux_offset, next_offset = struct.unpack_from("<HHIII", data, offset)
            aux = offset + aux_offset
            for _ in range(aux_count):
                _, _, other, name, aux_next = struct.unpack_from("<IHHII", data, aux)
                tag = string(s[6], name)
                index_to_tag[other] = tag
                needs.versions.setdefault(tag, [])
                aux += aux_next
            offset += next_offset
    dynsym = next((i for i, s in enumerate(sections) if s[1] == SHT_DYNSYM), None)
    versym = next((s for s in sections if s[1] == SHT_GNU_VERSYM), None)
    if dynsym is not None and versym is not None:
        sym = sections[dynsym]
        for i in range(sym[5] // 24):
            name, _, _, shndx, _, _ = struct.unpack_from("<IBBHQQ", data, sym[4] + i * 24)
            index, = struct.unpack_from("<H", data, versym[4] + i * 2)
            tag = index_to_tag.get(index & 0x7FFF)
            if tag is not None and shndx == 0:
                needs.versions[tag].append(string(sym[6], name))
    return needs


def check_floor(files: dict[str, Path], floor: str, glibcxx_ceiling: str | None = None,
                glibcxx_bound: set[str] = frozenset(), origin: dict[str, str] | None = None) -> dict[str, dict]:
    """Refuse (one line naming the file and symbol) when a file needs a glibc above `floor`, or,
    for the files named in `glibcxx_bound`, a libstdc++ above `glibcxx_ceiling` (the TVM runtime
    libraries' own need, which the device must meet anyway). `origin` names where a file came
    from, for the message (default: its path). Returns {name: highest needs}."""
    report = {}
    for name, path in files.items():
        needs = read_needs(path)
        for tag, symbols in sorted(needs.versions.items()):
            family, _, version = tag.partition("_")
            too_new = (family == "GLIBC" and version_key(version) > version_key(floor)) or (
                family == "GLIBCXX" and name in glibcxx_bound
                and (glibcxx_ceiling is None or version_key(version) > version_key(glibcxx_ceiling)))
            if too_new:
                symbol = f"{symbols[0]}@{tag}" if symbols else tag
                limit = (f"the package's glibc floor {floor} (--glibc-floor)" if family == "GLIBC" else
                         f"the TVM runtime libraries' own GLIBCXX_{glibcxx_ceiling}" if glibcxx_ceiling else
                         "no libstdc++ (the TVM runtime libraries need none)")
                where = (origin or {}).get(name, str(path))
                raise DataError(f"{where}: needs {symbol}, above {limit}; it would not load on such a device")
        report[name] = {family: needs.highest(family) for family in ("GLIBC", "GLIBCXX", "CXXABI")
                        if needs.highest(family)}
    return report
