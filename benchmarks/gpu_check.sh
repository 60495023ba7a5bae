#!/bin/sh
# Run benchmarks/gpu_check.py on a GPU box; see docs/gpu.md.
#
#   benchmarks/gpu_check.sh --fetch-wheels [PYTHON_VERSION]   # on a connected host, once: fills .whl/
#   benchmarks/gpu_check.sh [gpu_check.py options]             # on the GPU box, offline
#
# Python: the repository's .venv when it has one (a bootstrapped box, or a trainer-cuda install),
# else python3 (a bare GPU image that already holds torch). On a bare image, the few pure or small
# runtime wheels the image lacks travel in .whl/ (google-crc32c, tensorboardX, onnxconverter-common,
# pinned as in manifests/trainer-cuda.lock) and are installed into a temporary directory here,
# offline, with no dependencies resolved: nothing else is installed. Output: $OUT/gpu-check when
# OUT is set (the GPU lease's return folder), else ./gpu-check.
set -eu
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
if [ -x .venv/bin/python ]; then python=.venv/bin/python; else python=python3; fi

if [ "${1:-}" = "--fetch-wheels" ]; then
    pyver=${2:-3.12}
    pins=$(grep -E '^(google-crc32c|tensorboardx|onnxconverter-common)==' manifests/trainer-cuda.lock | cut -d' ' -f1)
    # shellcheck disable=SC2086
    python3 -m pip download --no-deps --only-binary=:all: --python-version "$pyver" --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d .whl $pins
    exclude=$(git rev-parse --git-path info/exclude)
    mkdir -p "$(dirname "$exclude")"
    grep -qsx '/.whl/' "$exclude" || echo /.whl/ >> "$exclude"  # the wheels travel as a carried path
    ls -l .whl
    exit 0
fi

if ! "$python" -c "import google_crc32c, tensorboardX, onnxconverter_common" 2>/dev/null && ls .whl/*.whl >/dev/null 2>&1; then
    site=/tmp/gpu-check-site
    "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" .whl/*.whl
    PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
    export PYTHONPATH
fi
export PYTHONUNBUFFERED=1
out=${OUT:+$OUT/}gpu-check
exec "$python" benchmarks/gpu_check.py --out "$out" "$@"
