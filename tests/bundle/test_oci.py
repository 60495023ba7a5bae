"""appliance.bundle.oci: the OCI image archive is read by the standard tools (`skopeo inspect
oci-archive:`, `skopeo copy` + `umoci unpack`), runs under chroot from the unpacked root, and has
the same digest when written twice."""

import json
import os
import shutil
import subprocess

import pytest

from appliance.bundle.oci import ImageConfig, write_image


def _base_root(root):
    """A tiny root: the host's /bin/dash with the libraries it links (what a base layer carries)."""
    for path in ("/bin/dash", "/lib/x86_64-linux-gnu/libc.so.6", "/lib64/ld-linux-x86-64.so.2"):
        target = root / path.lstrip("/")
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(os.path.realpath(path), target)
    (root / "bin" / "sh").symlink_to("dash")


@pytest.mark.skipif(not os.path.exists("/lib64/ld-linux-x86-64.so.2"), reason="an x86_64 glibc host builds the root")
def test_archive_is_read_by_skopeo_and_umoci_runs_under_chroot_and_is_deterministic(tmp_path):
    for tool in ("skopeo", "umoci"):
        if shutil.which(tool) is None:
            pytest.fail(f"{tool} missing: run installer/bootstrap.sh --system")
    base, app = tmp_path / "base", tmp_path / "app"
    _base_root(base)
    (app / "opt" / "appliance").mkdir(parents=True)
    (app / "opt" / "appliance" / "hello").write_text("appliance layer\n")
    (app / "opt" / "appliance" / "run.sh").write_text("#!/bin/sh\necho from the image\n")
    (app / "opt" / "appliance" / "run.sh").chmod(0o755)
    config = ImageConfig(entrypoint=("/opt/appliance/run.sh",),
                         labels={"org.opencontainers.image.version": "0.1.0", "appliance.bundle.digest": "sha256:ab"})
    digests = [write_image(tmp_path / f"image-{i}.tar", [base, app], config, ref="0.1.0") for i in (0, 1)]
    assert digests[0] == digests[1]
    assert (tmp_path / "image-0.tar").read_bytes() == (tmp_path / "image-1.tar").read_bytes()

    inspect = subprocess.run(["skopeo", "inspect", f"oci-archive:{tmp_path / 'image-0.tar'}"], capture_output=True,
                             text=True, timeout=120)
    assert inspect.returncode == 0, inspect.stderr
    facts = json.loads(inspect.stdout)
    assert facts["Digest"] == digests[0] and len(facts["Layers"]) == 2
    assert facts["Labels"]["appliance.bundle.digest"] == "sha256:ab" and facts["Architecture"] == "amd64"

    layout = tmp_path / "layout"
    copy = subprocess.run(["skopeo", "copy", f"oci-archive:{tmp_path / 'image-0.tar'}", f"oci:{layout}:0.1.0"],
                          capture_output=True, text=True, timeout=120)
    assert copy.returncode == 0, copy.stderr
    unpack = subprocess.run(["umoci", "unpack", "--image", f"{layout}:0.1.0", str(tmp_path / "bundle")],
                            capture_output=True, text=True, timeout=120)
    assert unpack.returncode == 0, unpack.stderr
    rootfs = tmp_path / "bundle" / "rootfs"
    assert (rootfs / "opt" / "appliance" / "hello").read_text() == "appliance layer\n"
    runtime = json.loads((tmp_path / "bundle" / "config.json").read_text())
    assert runtime["process"]["args"] == ["/opt/appliance/run.sh"]
    if os.geteuid() == 0:
        ran = subprocess.run(["chroot", str(rootfs), "/opt/appliance/run.sh"], capture_output=True, text=True)
        assert ran.returncode == 0 and ran.stdout == "from the image\n", ran.stderr
