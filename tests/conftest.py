import fcntl
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

# Property tests judge results, never speed: on a loaded CI box (2 cores shared) one example can take
# seconds, which Hypothesis' default 200 ms deadline and its too_slow health check would call a failure.
settings.register_profile("appliance", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("appliance")

ROOT = Path(__file__).resolve().parents[1]
VENV_BIN = Path(sys.executable).parent
INTEROP_PYTHON = ROOT / ".venv-interop" / "bin" / "python"


def seeded_choice(options, what: str = "kill step"):
    """One of options, drawn from APPLIANCE_TEST_SEED (or a fresh seed), printed so that a failure
    names the seed that replays it (pytest shows a failing test's output)."""
    seed = int(os.environ.get("APPLIANCE_TEST_SEED") or random.SystemRandom().randrange(2**32))
    value = random.Random(seed).choice(list(options))
    print(f"{what} {value} (APPLIANCE_TEST_SEED={seed} replays it)")
    return value


def one_line(proc, code: int) -> str:
    """The single stderr line of a refused command that exited with `code` (fails on more lines)."""
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == code and len(lines) == 1, proc.stderr
    return lines[0]


def appliance_cmd(*args: str) -> list[str]:
    """The installed console script, as a user would type it."""
    return [str(VENV_BIN / "appliance"), *args]


def run_appliance(*args: str, offline: bool = False, timeout: float = 600, **kw) -> subprocess.CompletedProcess:
    """Run `appliance ARGS`; offline=True runs it in a fresh network namespace (unshare -n)."""
    cmd = appliance_cmd(*args)
    if offline:
        cmd = offline_cmd(cmd)
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)


def offline_cmd(cmd: list[str], loopback: bool = False) -> list[str]:
    """Wrap cmd so it runs with no network. loopback=True brings up lo (torch.distributed needs it)."""
    if shutil.which("unshare") is None:
        pytest.fail("unshare is required to prove offline behaviour (util-linux)")
    if loopback:
        import shlex
        return ["unshare", "-n", "sh", "-c", "ip link set lo up && exec " + shlex.join(cmd)]
    return ["unshare", "-n", *cmd]


@pytest.fixture
def interop_python() -> Path:
    """Python of .venv-interop (TensorFlow); made by `installer/bootstrap.sh --interop`."""
    if not INTEROP_PYTHON.exists():
        pytest.fail(".venv-interop missing: run installer/bootstrap.sh --interop")
    return INTEROP_PYTHON


@pytest.fixture(autouse=True, scope="session")
def _site_edge_key(tmp_path_factory):
    """The site's edge signing key (made by the first `appliance package`) lives in this session's
    temporary folder, never in the user's ~/.config; children inherit it through the environment."""
    os.environ["APPLIANCE_EDGE_KEY"] = str(tmp_path_factory.getbasetemp() / "edge-key" / "edge-signing.key")


@pytest.fixture(autouse=True)
def _disk_turns(request, tmp_path_factory):
    """A test marked disk_heavy runs with no other test running on any pytest worker.

    The site flow holds a 3.5 GB bundle, the installer's copy of it, the extracted wheels and a
    venv (15 GB at its peak, measured); next to another worker's tests it was 2.7 GB short on CI.
    Two lock files shared by the workers: every test passes the gate, then holds `run` shared;
    a heavy test holds the gate (so no new test starts) and waits for `run` exclusively.
    """
    base = tmp_path_factory.getbasetemp()
    shared = base.parent if base.name.startswith("popen-gw") else base  # pytest-xdist: one folder per worker
    heavy = request.node.get_closest_marker("disk_heavy") is not None
    with open(shared / "disk-turns.gate", "a") as gate, open(shared / "disk-turns.run", "a") as run:
        fcntl.flock(gate, fcntl.LOCK_EX)
        fcntl.flock(run, fcntl.LOCK_EX if heavy else fcntl.LOCK_SH)
        if not heavy:
            fcntl.flock(gate, fcntl.LOCK_UN)
        yield


# Tests that skip where the box lacks something (the x86 int8 kernels' exactness tests need AVX-512
# VNNI; the install under a second CPython needs one on the box): the run's summary says how many of
# them ran and why the others skipped, so a green run on such a box does not pass for a proof.
_WATCHED = {"test_x86_int8.py": "x86 int8 kernel tests (AVX-512 VNNI)",
            "test_bundle_pythons.py::test_a_real_second_interpreter": "install under a second CPython"}
_WATCH = {what: {"ran": 0, "skipped": 0, "why": set()} for what in _WATCHED.values()}


def pytest_runtest_logreport(report):
    what = next((w for key, w in _WATCHED.items() if key in report.nodeid), None)
    if what is None:
        return
    if report.skipped:
        _WATCH[what]["skipped"] += 1
        _WATCH[what]["why"].add(str(report.longrepr[-1]) if isinstance(report.longrepr, tuple) else "skipped")
    elif report.when == "call":
        _WATCH[what]["ran"] += 1


def pytest_terminal_summary(terminalreporter):
    for what, k in _WATCH.items():
        if k["ran"] or k["skipped"]:
            why = f" ({'; '.join(sorted(k['why']))})" if k["skipped"] else ""
            terminalreporter.write_line(f"{what}: {k['ran']} ran, {k['skipped']} skipped{why}")
