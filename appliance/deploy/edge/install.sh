#!/bin/sh
# Edge package installer, made by `appliance package`. Runs on the aarch64 device, offline.
#   ./install.sh [PREFIX]            checks SHA256SUMS, copies the package to PREFIX (default /opt/appliance-edge)
#   ./install.sh [PREFIX] --python   also makes PREFIX/venv from the bundled wheels (needs python3.11)
set -eu
here=$(cd "$(dirname "$0")" && pwd)
prefix=${1:-/opt/appliance-edge}
cd "$here"
sha256sum -c --quiet SHA256SUMS || { echo "install.sh: checksum mismatch: package damaged or modified" >&2; exit 1; }
mkdir -p "$prefix"
cp -R "$here"/. "$prefix"/
"$prefix/bin/run" --help >/dev/null
if [ "${2:-}" = "--python" ]; then
    python3 -m venv "$prefix/venv"
    "$prefix/venv/bin/pip" install --no-index --find-links "$prefix/wheels" apache-tvm numpy pillow
fi
echo "installed in $prefix: run $prefix/bin/run --input tensor.npy --top-k 5"
