"""Progress of long work: a tqdm bar on a terminal, plain lines with rate and ETA in a log.

A log file or a CI console gets no `\\r` frames: one line every `every` seconds (and a last one),
`desc: 1234/5000 img (24.7 %), 310 img/s, ETA 12 s`. Quiet mode (`--quiet`) shows nothing.
Other output printed while a bar is shown goes through `Progress.write`, so it does not land on
the bar.
"""

from __future__ import annotations

import os
import sys
import time

QUIET_ENV = "APPLIANCE_QUIET"  # set by --quiet, so child processes (training workers) stay quiet too


def quiet() -> bool:
    return os.environ.get(QUIET_ENV, "") not in ("", "0")


def set_quiet(value: bool) -> None:
    if value:
        os.environ[QUIET_ENV] = "1"


def _si(value: float) -> str:
    for unit in ("", "k", "M", "G", "T"):
        if abs(value) < 1000:
            return f"{value:.1f}{unit}" if unit or value != int(value) else f"{int(value)}"
        value /= 1000
    return f"{value:.1f}P"


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds} s"
    if seconds < 3600:
        return f"{seconds // 60} min {seconds % 60:02d} s"
    return f"{seconds // 3600} h {seconds % 3600 // 60:02d} min"


class Progress:
    """Count work done; `total` may be None (unknown). Use as a context manager."""

    def __init__(self, total: float | None = None, desc: str = "", unit: str = "it", *, initial: float = 0,
                 unit_scale: bool = False, every: float = 10.0, stream=None, enabled: bool = True):
        self.total, self.desc, self.unit, self.unit_scale = total, desc, unit, unit_scale
        self.n = initial
        self._initial = initial
        self._stream = stream or sys.stderr
        self._every = every
        self._enabled = enabled and not quiet()
        self._start = self._last = time.monotonic()
        self._bar = None
        self._postfix = ""
        if self._enabled and getattr(self._stream, "isatty", lambda: False)():
            from tqdm import tqdm

            self._bar = tqdm(total=total, initial=initial, desc=desc, unit=unit, unit_scale=unit_scale,
                             file=self._stream, dynamic_ncols=True, mininterval=0.5)

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def update(self, n: float = 1) -> None:
        self.n += n
        if self._bar is not None:
            self._bar.update(n)
        elif self._enabled and time.monotonic() - self._last >= self._every:
            self._line()

    def set_postfix(self, text: str) -> None:
        if self._bar is not None:
            self._bar.set_postfix_str(text, refresh=False)
        self._postfix = text

    def write(self, line: str, stream=None) -> None:
        """Print a line (to stream, default the progress stream) without breaking the bar;
        shown quiet or not: it is a result."""
        stream = stream or self._stream
        if self._bar is not None:
            self._bar.write(line, file=stream)
        else:
            print(line, file=stream, flush=True)

    def _format(self, value: float) -> str:
        return _si(value) if self.unit_scale else f"{value:g}" if isinstance(value, float) else str(value)

    def _line(self) -> None:
        now = time.monotonic()
        self._last = now
        elapsed = max(now - self._start, 1e-9)
        rate = (self.n - self._initial) / elapsed
        parts = [f"{self.desc}: " if self.desc else "", self._format(self.n)]
        if self.total:
            parts.append(f"/{self._format(self.total)} {self.unit} ({100 * self.n / self.total:.1f} %)")
        else:
            parts.append(f" {self.unit}")
        parts.append(f", {self._format(rate) if self.unit_scale else f'{rate:.3g}'} {self.unit}/s")
        if self.total and rate > 0 and self.n < self.total:
            parts.append(f", ETA {_duration((self.total - self.n) / rate)}")
        elif self.total and self.n >= self.total:
            parts.append(f", done in {_duration(elapsed)}")
        if self._postfix:
            parts.append(f", {self._postfix}")
        print("".join(parts), file=self._stream, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        elif self._enabled and (self.n != self._initial or self.total):
            self._line()
        self._enabled = False
