"""Known vulnerabilities of the pinned versions, from the index's published data (connected host only).

The source is the one pip-audit reads by default: the JSON API beside the index
(`<base>/<name>/<version>/json`, PyPI: https://pypi.org/pypi), whose `vulnerabilities` field lists
the OSV advisories of that release. An index that offers no such API (many HTML-only mirrors) gives
no data; the SBOM then says so instead of looking clean.
"""

from __future__ import annotations

import concurrent.futures
import datetime as _dt
import json
import urllib.error
import urllib.request
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Advisory:
    id: str
    aliases: tuple[str, ...]
    summary: str
    details: str
    fixed_in: tuple[str, ...]
    link: str
    source: str


@dataclass
class VulnerabilityData:
    """What the source said at `taken`: advisories per (name, version), and the pins it had nothing on."""

    source: str
    taken: str
    advisories: dict[tuple[str, str], list[Advisory]] = field(default_factory=dict)
    no_data: dict[tuple[str, str], str] = field(default_factory=dict)  # pin -> why

    @property
    def offered(self) -> bool:
        return bool(self.advisories)


def default_source(index: str) -> str:
    """The JSON API beside a simple index: https://pypi.org/simple -> https://pypi.org/pypi."""
    index = index.rstrip("/")
    return (index[: -len("/simple")] if index.endswith("/simple") else index) + "/pypi"


class NoData(Exception):
    """The source has nothing on this release (the message says why)."""


def _get(url: str) -> dict:
    with urllib.request.urlopen(urllib.request.Request(url, headers={"Accept": "application/json"}),
                                timeout=60) as response:
        return json.load(response)


def _release(source: str, name: str, version: str) -> list[Advisory]:
    try:
        data = _get(f"{source}/{name}/{version}/json")
    except urllib.error.HTTPError as err:
        if err.code != 404:
            raise
        # Some mirrors serve only the project page; its `vulnerabilities` are those of its latest release.
        data = _get(f"{source}/{name}/json")
        latest = data["info"]["version"]
        if latest != version:
            raise NoData(f"HTTP 404 for the release; the project page describes {latest}") from None
    vulns = data["vulnerabilities"]  # KeyError/TypeError: not the JSON API pip-audit reads
    return [Advisory(id=v["id"], aliases=tuple(v.get("aliases") or ()), summary=(v.get("summary") or "").strip(),
                     details=(v.get("details") or "").strip(), fixed_in=tuple(v.get("fixed_in") or ()),
                     link=v.get("link") or "", source=v.get("source") or "")
            for v in vulns if not v.get("withdrawn")]


def fetch(source: str, pins: list[tuple[str, str]]) -> VulnerabilityData:
    """Ask the source about every (name, version) once; never fails the build, records what it lacks."""
    data = VulnerabilityData(source=source.rstrip("/"),
                             taken=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"))

    def one(pin):
        try:
            return pin, _release(data.source, *pin), None
        except NoData as err:
            return pin, None, str(err)
        except urllib.error.HTTPError as err:
            return pin, None, f"HTTP {err.code}"
        except (urllib.error.URLError, OSError) as err:
            return pin, None, f"unreachable ({getattr(err, 'reason', err)})"
        except (ValueError, KeyError, TypeError):
            return pin, None, "no vulnerabilities field (not a PyPI-style JSON API)"

    with concurrent.futures.ThreadPoolExecutor(max_workers=8) as pool:
        for pin, advisories, why in pool.map(one, sorted(set(pins))):
            if advisories is None:
                data.no_data[pin] = why
            else:
                data.advisories[pin] = advisories
    return data
