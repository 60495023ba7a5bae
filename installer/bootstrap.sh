#!/usr/bin/env bash
# Create the development environment from the hash-pinned locks in manifests/.
#
#   installer/bootstrap.sh             .venv from manifests/dev.lock, project installed editable
#   installer/bootstrap.sh --interop   also .venv-interop from manifests/interop.lock (TensorFlow,
#                                      used only by interop tests and benchmarks, in a subprocess)
#   installer/bootstrap.sh --edge-wheels  also download the hash-checked aarch64 wheels of
#                                      manifests/edge-aarch64.lock into wheelhouse/edge-aarch64
#                                      (what edge packages carry; needs a connected host)
#   installer/bootstrap.sh --site-wheels  also download the hash-checked wheels of
#                                      manifests/trainer-cpu.lock into wheelhouse/trainer-cpu
#                                      (3.3 GB: the CPU site's bundle, which
#                                      tests/installer/test_site_flow.py builds offline from there)
#   installer/bootstrap.sh --edge-sysroot  also fetch the arm64 Debian .debs of python3.11 into
#                                      wheelhouse/edge-sysroot-arm64 (`edge verify --python`)
#   installer/bootstrap.sh --system    also apt-get install the Debian tools the tests need
#                                      (aarch64 cross compiler, qemu-user, chromium, minisign, llvm-16,
#                                      libglib2.0-dev, slurm-wlm, munge, skopeo, umoci), when missing, and qemu-plugin.h
#                                      (wheelhouse/qemu-plugin)
#
# Idempotent: a venv whose lock and pyproject.toml are unchanged since its last
# successful bootstrap is left alone (a stamp file records their sha256).
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3.11}
want_interop=0
want_system=0
want_edge=0
want_sysroot=0
want_site=0
for arg in "$@"; do
  case "$arg" in
    --interop) want_interop=1 ;;
    --system) want_system=1 ;;
    --edge-wheels) want_edge=1 ;;
    --edge-sysroot) want_sysroot=1 ;;
    --site-wheels) want_site=1 ;;
    -h|--help) sed -n '2,22p' "$0"; exit 0 ;;
    *) echo "bootstrap: unknown option $arg (see --help)" >&2; exit 2 ;;
  esac
done

# minisign: the bundle tests check that stock minisign verifies our bundle signatures.
# llvm-16 (llvm-mca, llvm-mc), libglib2.0-dev and pkg-config: benchmarks/arm_cycles.py's qemu plugin
# and its block costing (tests/deploy/test_arm_cycles.py).
# slurm-wlm and munge: tests/train/test_slurm.py submits `appliance train slurm`'s script to a real
# one-host Slurm (slurmctld + slurmd + munged started by the test in a temporary directory).
# skopeo and umoci: tests/bundle/test_oci.py reads the appliance's OCI image archive with them.
DEBIAN_PACKAGES=(g++-aarch64-linux-gnu qemu-user chromium minisign llvm-16 libglib2.0-dev pkg-config slurm-wlm munge
                 skopeo umoci)
DEBIAN_BINARIES=(aarch64-linux-gnu-g++ qemu-aarch64 chromium minisign llvm-mca-16 gdbus-codegen pkg-config slurmd munged
                 skopeo umoci)

install_system() {
  local missing=() i
  for i in "${!DEBIAN_BINARIES[@]}"; do
    command -v "${DEBIAN_BINARIES[$i]}" >/dev/null || missing+=("${DEBIAN_PACKAGES[$i]}")
  done
  if [ ${#missing[@]} -eq 0 ]; then
    echo "bootstrap: Debian tools present"
    return
  fi
  echo "bootstrap: installing Debian packages: ${missing[*]}"
  local sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
}

# make_venv DIR LOCK: build DIR from LOCK (complete, hash-pinned) plus the project.
make_venv() {
  local dir=$1 lock=$2 stamp
  stamp=$(cat "$lock" pyproject.toml "$0" | sha256sum | cut -d' ' -f1)
  if [ -x "$dir/bin/python" ] && [ "$(cat "$dir/.bootstrap-stamp" 2>/dev/null)" = "$stamp" ]; then
    echo "bootstrap: $dir is up to date with $lock"
    return
  fi
  echo "bootstrap: building $dir from $lock"
  [ -x "$dir/bin/python" ] || "$PYTHON" -m venv "$dir"
  rm -f "$dir/.bootstrap-stamp"
  # --no-deps: the lock is the complete set; --require-hashes: every file is checked.
  "$dir/bin/python" -m pip install --quiet --disable-pip-version-check \
    --require-hashes --no-deps -r "$lock"
  # Remove what an older lock installed and this one no longer pins.
  "$dir/bin/python" - "$lock" <<'PY'
import re, subprocess, sys
from importlib import metadata
pinned = {re.sub(r"[-_.]+", "-", m.group(1)).lower()
          for m in re.finditer(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==", open(sys.argv[1]).read(), re.M)}
keep = pinned | {"pip", "appliance"}
extra = sorted({re.sub(r"[-_.]+", "-", d.metadata["Name"]).lower() for d in metadata.distributions()} - keep)
if extra:
    print("bootstrap: removing packages no longer locked:", " ".join(extra))
    subprocess.check_call([sys.executable, "-m", "pip", "uninstall", "-y", "-q", *extra])
PY
  # The project itself, editable, without touching the locked dependencies.
  "$dir/bin/python" -m pip install --quiet --disable-pip-version-check \
    --no-deps --no-build-isolation -e .
  echo "$stamp" > "$dir/.bootstrap-stamp"
}

# manylinux_platforms ARCH: every platform tag a wheel for glibc 2.28 may carry, as --platform
# options. pip takes a --platform literally: manylinux_2_28 alone refuses a manylinux2014 wheel
# (the bundle builder's Profile.wheel_platforms() lists the same tags).
manylinux_platforms() {
  local arch=$1 m
  for m in $(seq 28 -1 5); do
    echo "--platform manylinux_2_${m}_${arch}"
    case $m in
      17) echo "--platform manylinux2014_${arch}" ;;
      12) echo "--platform manylinux2010_${arch}" ;;
      5) echo "--platform manylinux1_${arch}" ;;
    esac
  done
}

# fetch_wheels PROFILE ARCH: the exact locked files of PROFILE into wheelhouse/PROFILE.
fetch_wheels() {
  local profile=$1 arch=$2 lock=manifests/$1.lock dest=wheelhouse/$1 stamp
  stamp=$(sha256sum "$lock" | cut -d' ' -f1)
  if [ "$(cat "$dest/.lock-sha256" 2>/dev/null)" = "$stamp" ]; then
    echo "bootstrap: $dest is up to date with $lock"
    return
  fi
  echo "bootstrap: downloading $lock into $dest"
  mkdir -p "$dest"
  rm -f "$dest/.lock-sha256"
  "$PYTHON" -m pip download --quiet --disable-pip-version-check --require-hashes --no-deps \
    --only-binary :all: $(manylinux_platforms "$arch") --python-version 3.11 --implementation cp \
    -d "$dest" -r "$lock"
  echo "$stamp" > "$dest/.lock-sha256"
}

if [ "$want_system" -eq 1 ]; then
  install_system
  # qemu-plugin.h of the installed qemu-user (Debian's source package): the cycle estimate (appliance/deploy/edge/cycles.py) builds its plugin on it
  appliance/deploy/edge/fetch_qemu_header.sh wheelhouse/qemu-plugin
fi
[ "$want_edge" -eq 1 ] && fetch_wheels edge-aarch64 aarch64
[ "$want_site" -eq 1 ] && fetch_wheels trainer-cpu x86_64
make_venv .venv manifests/dev.lock
[ "$want_interop" -eq 1 ] && make_venv .venv-interop manifests/interop.lock
if [ "$want_sysroot" -eq 1 ]; then
  if [ -f wheelhouse/edge-sysroot-arm64/manifest.json ]; then
    echo "bootstrap: wheelhouse/edge-sysroot-arm64 is present"
  else
    .venv/bin/appliance edge sysroot --out wheelhouse/edge-sysroot-arm64
  fi
fi
echo "bootstrap: done (.venv/bin/appliance is ready)"
