"""bin/run on big.LITTLE devices: its threads go to the big cores read from sysfs, --cores and
--threads override, and it says what it chose. The real runner under qemu-aarch64, on made-up
device trees (--sysfs-root)."""

import json
import subprocess
import tarfile

import pytest

QEMU = ["qemu-aarch64", "-L", "/usr/aarch64-linux-gnu"]


@pytest.fixture(scope="module")
def runner(tmp_path_factory, edge_package):
    root = tmp_path_factory.mktemp("edge-cores")
    with tarfile.open(edge_package) as tar:
        tar.extractall(root, filter="data")
    return root / "edge-package" / "bin" / "run"


def device(root, online: str, **per_core):
    """A sysfs tree: devices/system/cpu/online, and per core the files given (name -> list of values)."""
    cpu = root / "devices" / "system" / "cpu"
    cpu.mkdir(parents=True)
    (cpu / "online").write_text(online + "\n")
    for name, values in per_core.items():
        for core, value in enumerate(values):
            path = cpu / f"cpu{core}" / name.replace("__", "/")
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(f"{value}\n")
    return root


def show(runner, *args):
    proc = subprocess.run([*QEMU, str(runner), "--show-cores", *args], capture_output=True, text=True, timeout=120)
    return proc


def test_big_cores_by_capacity_then_by_max_frequency(runner, tmp_path):
    rk3588 = device(tmp_path / "rk3588", "0-7", cpu_capacity=[414] * 4 + [1024] * 4)
    proc = show(runner, "--sysfs-root", str(rk3588))
    placed = json.loads(proc.stdout)
    assert proc.returncode == 0 and placed["cores"] == [4, 5, 6, 7] and placed["threads"] == 4, proc
    assert "big cores" in placed["chosen"] and "cpu_capacity 1024" in placed["chosen"]
    # no cpu_capacity (older kernels): the highest cpuinfo_max_freq; a core offline is not used
    freq = device(tmp_path / "freq", "0-3,5", cpufreq__cpuinfo_max_freq=[1800000, 1800000, 2400000, 2400000, 0,
                                                                         2400000])
    placed = json.loads(show(runner, "--sysfs-root", str(freq)).stdout)
    assert placed["cores"] == [2, 3, 5] and "cpuinfo_max_freq 2400000" in placed["chosen"]


def test_alike_cores_and_no_data_use_every_online_core(runner, tmp_path):
    pi5 = device(tmp_path / "pi5", "0-3", cpu_capacity=[1024] * 4)
    placed = json.loads(show(runner, "--sysfs-root", str(pi5)).stdout)
    assert placed["cores"] == [0, 1, 2, 3] and "alike" in placed["chosen"]
    bare = device(tmp_path / "bare", "0-1")
    placed = json.loads(show(runner, "--sysfs-root", str(bare)).stdout)
    assert placed["cores"] == [0, 1] and "no cpu_capacity" in placed["chosen"]


def test_cores_and_threads_override_and_bad_lists_are_one_line(runner, tmp_path):
    rk3588 = device(tmp_path / "rk3588", "0-7", cpu_capacity=[414] * 4 + [1024] * 4)
    placed = json.loads(show(runner, "--sysfs-root", str(rk3588), "--cores", "0-1", "--threads", "3").stdout)
    assert placed == {**placed, "cores": [0, 1], "threads": 3, "chosen": "given by --cores"}
    for cores, said in (("9", "--cores: core 9 is not online (online: 0-7)"),
                        ("4-x", "--cores: expected a core list such as 4-7 or 0,2, got '4-x'")):
        proc = show(runner, "--sysfs-root", str(rk3588), "--cores", cores)
        assert proc.returncode == 2 and proc.stderr == f"run: error: {said}\n" and proc.stdout == "", proc


def test_bench_says_where_it_ran(runner):
    """On this host's real sysfs: the bench's JSON carries the placement, and the threads it used."""
    proc = subprocess.run([*QEMU, str(runner), "--bench", "--warmup", "0", "--runs", "2", "--cores", "0",
                           "--json"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    bench = json.loads(proc.stdout.strip().splitlines()[-1])
    assert bench["placement"]["cores"] == [0] and bench["placement"]["pinned"] is True
    assert bench["threads"] == 1
