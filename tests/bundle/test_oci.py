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


def _deb(tmp_path):
    """A real .deb of the tiny root (dpkg-deb --build), as Debian's base packages come."""
    package = tmp_path / "pkg"
    _base_root(package)
    (package / "DEBIAN").mkdir()
    (package / "DEBIAN" / "control").write_text("Package: tiny-root\nVersion: 1.0\nArchitecture: amd64\n"
                                                "Maintainer: tests <t@example.org>\nDescription: dash and libc\n")
    debs = tmp_path / "debs"
    debs.mkdir()
    subprocess.run(["dpkg-deb", "--root-owner-group", "--build", str(package), str(debs / "tiny-root_1.0_amd64.deb")],
                   check=True, capture_output=True)
    return debs


@pytest.mark.skipif(not os.path.exists("/lib64/ld-linux-x86-64.so.2"), reason="an x86_64 glibc host builds the root")
def test_bundle_image_layers_base_env_and_sbom_with_labels(tmp_path, capsys):
    """`appliance bundle image`: a base from .debs, then the same image as the base of another
    (--base-oci keeps its layers as they are). The environment here is a stand-in prefix whose
    bin/appliance is a shell script: the layering, entrypoint and labels are under test."""
    from appliance.cli import main

    env = tmp_path / "opt" / "appliance"
    (env / "bin").mkdir(parents=True)
    (env / "bin" / "appliance").write_text("#!/bin/sh\necho \"appliance $*\"\n")
    (env / "bin" / "appliance").chmod(0o755)
    (tmp_path / "bundle.tar").write_bytes(b"bundle bytes")
    (tmp_path / "sbom.json").write_text('{"bomFormat": "CycloneDX"}')
    args = ["bundle", "image", "--env", str(env), "--bundle", str(tmp_path / "bundle.tar"),
            "--sbom", str(tmp_path / "sbom.json")]
    assert main([*args, "--base-debs", str(_deb(tmp_path)), "--out", str(tmp_path / "a.tar")]) == 0
    assert main([*args, "--base-debs", str(tmp_path / "debs"), "--out", str(tmp_path / "a2.tar")]) == 0
    assert main([*args, "--base-oci", str(tmp_path / "a.tar"), "--out", str(tmp_path / "b.tar")]) == 0
    printed = capsys.readouterr().out.split()
    assert printed[1] == printed[3]  # the same inputs, the same digest
    facts = [json.loads(subprocess.run(["skopeo", "inspect", f"oci-archive:{tmp_path / n}"], capture_output=True,
                                       text=True, check=True).stdout) for n in ("a.tar", "b.tar")]
    assert facts[0]["Digest"] == printed[1] and len(facts[0]["Layers"]) == 3
    assert facts[1]["Layers"][:3] == facts[0]["Layers"] and len(facts[1]["Layers"]) == 5
    labels = facts[0]["Labels"]
    assert labels["appliance.bundle.sha256"] == __import__("hashlib").sha256(b"bundle bytes").hexdigest()
    assert labels["appliance.sbom"] == "/usr/share/appliance/sbom.cdx.json"
    layout = tmp_path / "layout"
    subprocess.run(["skopeo", "copy", f"oci-archive:{tmp_path / 'a.tar'}", f"oci:{layout}:x"], check=True,
                   capture_output=True)
    subprocess.run(["umoci", "unpack", "--image", f"{layout}:x", str(tmp_path / "unpacked")], check=True,
                   capture_output=True)
    rootfs = tmp_path / "unpacked" / "rootfs"
    runtime = json.loads((tmp_path / "unpacked" / "config.json").read_text())
    assert runtime["process"]["args"] == [f"{env}/bin/appliance", "doctor"]
    assert (rootfs / "usr/share/appliance/sbom.cdx.json").read_text() == '{"bomFormat": "CycloneDX"}'
    if os.geteuid() == 0:
        ran = subprocess.run(["chroot", str(rootfs), *runtime["process"]["args"]], capture_output=True, text=True)
        assert ran.returncode == 0 and ran.stdout == "appliance doctor\n", ran.stderr


def test_bundle_image_without_a_base_is_one_line(tmp_path, capsys):
    from appliance.cli import main

    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "appliance").write_text("")
    assert main(["bundle", "image", "--env", str(tmp_path), "--out", str(tmp_path / "i.tar")]) != 0
    err = capsys.readouterr().err.strip()
    assert err == ("appliance bundle image: error: give one base: --base-oci ARCHIVE (the site's image), "
                   "--base-root DIR or --base-debs DIR")
