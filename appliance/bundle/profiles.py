"""Bundle profiles (manifests/profiles.toml) and the hash-pinned locks they name."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from appliance.core.errors import ConfigError
from appliance.core.tomlconfig import read_toml

PROFILES_FILE = "profiles.toml"
_KEYS = {"description", "platform", "glibc_floor", "pythons", "cuda_major", "project", "install", "self_test"}
_REQUIRED = {"description", "platform", "glibc_floor", "pythons", "project", "install"}
_SELF_TEST_KEYS = {"commands", "doctor", "imports"}
_PLATFORM = re.compile(r"^(x86_64|aarch64)-manylinux_2_(\d+)$")
_PYTHON = re.compile(r"^3\.\d+$")


@dataclass(frozen=True)
class Pin:
    """One locked distribution: name==version with every hash the lock allows."""

    name: str
    version: str
    hashes: frozenset[str]


@dataclass(frozen=True)
class Profile:
    name: str
    description: str
    platform: str  # uv's --python-platform, e.g. x86_64-manylinux_2_28
    glibc_floor: str
    pythons: tuple[str, ...]  # CPython versions served, e.g. ("3.11", "3.12"); one lock each
    cuda_major: int | None
    project: bool
    install: bool
    self_test: dict = field(default_factory=dict)
    manifests: Path = Path()

    def lock_file(self, python: str) -> Path:
        """NAME.lock for the first Python listed (as before several were served), NAME-pyX.Y.lock for others."""
        if python == self.pythons[0]:
            return self.manifests / f"{self.name}.lock"
        return self.manifests / f"{self.name}-py{python}.lock"

    @property
    def arch(self) -> str:
        return self.platform.split("-", 1)[0]

    def wheel_platforms(self) -> list[str]:
        """Platform tags a wheel for this profile may carry, most specific first."""
        major, minor = (int(x) for x in self.glibc_floor.split("."))
        legacy = {17: "manylinux2014", 12: "manylinux2010", 5: "manylinux1"}
        tags = []
        for m in range(minor, 4, -1):
            tags.append(f"manylinux_{major}_{m}_{self.arch}")
            if m in legacy:
                tags.append(f"{legacy[m]}_{self.arch}")
        return tags


def load_profiles(manifests: Path) -> dict[str, Profile]:
    path = manifests / PROFILES_FILE
    data = read_toml(path, "bundle profiles file (profiles are declared there)")
    profiles = {}
    for name, table in data.get("profiles", {}).items():
        where = f"{path}: profiles.{name}"
        unknown = set(table) - _KEYS
        if unknown:
            raise ConfigError(f"{where}: unknown key {sorted(unknown)[0]!r} (known: {', '.join(sorted(_KEYS))})")
        missing = _REQUIRED - set(table)
        if missing:
            raise ConfigError(f"{where}: missing key {sorted(missing)[0]!r}")
        m = _PLATFORM.match(table["platform"])
        if not m:
            raise ConfigError(f"{where}: platform {table['platform']!r} is not ARCH-manylinux_2_N "
                              "(ARCH x86_64 or aarch64)")
        if table["glibc_floor"] != f"2.{m.group(2)}":
            raise ConfigError(f"{where}: glibc_floor {table['glibc_floor']!r} disagrees with platform "
                              f"{table['platform']!r}")
        self_test = table.get("self_test", {})
        if set(self_test) - _SELF_TEST_KEYS or self_test.get("doctor", "json") not in ("json", "ready"):
            raise ConfigError(f"{where}: self_test takes commands, doctor (\"json\" or \"ready\"), imports")
        if table["install"] and not table["project"]:
            raise ConfigError(f"{where}: an installed profile needs project = true (its self-test runs appliance)")
        pythons = table["pythons"]
        if (not isinstance(pythons, list) or not pythons or len(set(pythons)) != len(pythons)
                or not all(isinstance(v, str) and _PYTHON.match(v) for v in pythons)):
            raise ConfigError(f"{where}: pythons must be a list of distinct CPython versions like "
                              f"[\"3.11\", \"3.12\"], got {pythons!r}")
        profiles[name] = Profile(name=name, description=table["description"], platform=table["platform"],
                                 glibc_floor=table["glibc_floor"], pythons=tuple(pythons),
                                 cuda_major=table.get("cuda_major"), project=bool(table["project"]),
                                 install=bool(table["install"]), self_test=self_test, manifests=manifests)
    return profiles


def read_lock(profile: Profile, python: str) -> list[Pin]:
    """Every pin of the profile's lock for python; the lock must have been resolved for both."""
    path = profile.lock_file(python)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ConfigError(f"{path}: missing: profile {profile.name} serves CPython {python}; compile the lock "
                          "with the command in manifests/README.md") from None
    header = "\n".join(text.splitlines()[:3])
    if f"--python-platform {profile.platform}" not in header:
        raise ConfigError(f"{path}: header does not say --python-platform {profile.platform}: "
                          f"the lock was not resolved for profile {profile.name}'s platform")
    if f"--python-version {python} " not in header + " ":
        raise ConfigError(f"{path}: header does not say --python-version {python}: "
                          f"the lock was not resolved for CPython {python}")
    pins = []
    logical = re.sub(r"\\\n", " ", text)
    for number, line in enumerate(logical.splitlines(), 1):
        line = line.split(" #", 1)[0].strip()
        if not line or line.startswith("#"):
            continue
        m = re.match(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)((?:\s+--hash=sha256:[0-9a-f]{64})+)\s*$", line)
        if not m:
            raise ConfigError(f"{path}: line {line[:60]!r} is not `name==version --hash=sha256:...`")
        hashes = frozenset(re.findall(r"sha256:([0-9a-f]{64})", m.group(3)))
        pins.append(Pin(re.sub(r"[-_.]+", "-", m.group(1)).lower(), m.group(2), hashes))
    return pins
