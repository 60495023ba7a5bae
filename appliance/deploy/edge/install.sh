#!/bin/sh
# Edge package installer, made by `appliance package`. Runs on the aarch64 device, offline.
#
#   ./install.sh --prefix DIR [--python]      (DIR defaults to /opt/appliance-edge)
#
# 1. Copies the package once into a private directory (mode 700) under DIR; every later step reads
#    only that copy, so a file swapped after the check is never what gets installed.
# 2. Checks every file of the copy against SHA256SUMS and refuses unlisted files and links.
# 3. With --python, makes DIR/venv from the copy's wheels (pip --no-index --require-hashes).
# 4. Moves the copy's files into DIR and runs DIR/bin/run --selftest (golden samples vs the host).
# Running it again for the same package changes nothing. Exit status: 0 installed (or already
# installed), 1 refused or self-test failed. EDGE_EMULATOR (e.g. "qemu-aarch64 -L SYSROOT") runs
# the aarch64 programs off the device, for testing this script on a build host.
set -eu

die() {
    echo "install.sh: error: $*" >&2
    exit 1
}

prefix=/opt/appliance-edge
python=no
while [ $# -gt 0 ]; do
    case "$1" in
        --prefix) [ $# -ge 2 ] || die "--prefix needs a directory"; prefix=$2; shift 2 ;;
        --prefix=*) prefix=${1#--prefix=}; shift ;;
        --python) python=yes; shift ;;
        -h|--help) sed -n '2,14p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) die "unknown argument $1 (usage: install.sh --prefix DIR [--python])" ;;
    esac
done

here=$(cd "$(dirname "$0")" && pwd)
[ -f "$here/SHA256SUMS" ] || die "$here: no SHA256SUMS (not an edge package made by \`appliance package\`)"
mkdir -p "$prefix" || die "$prefix: cannot create the install directory"
prefix=$(cd "$prefix" && pwd)
[ "$prefix" != "$here" ] || die "$prefix: is the package itself; install it somewhere else"

umask 077
stage=$(mktemp -d "$prefix/.install.XXXXXX") || die "$prefix: cannot make a private staging directory"
trap 'rm -rf "$stage"' EXIT INT TERM
cp -R "$here" "$stage/package" || die "$here: cannot copy the package to $stage"
cd "$stage/package"

# Only the copy from here on.
odd=$(find . ! -type f ! -type d | sed 's|^\./||' | head -n 1)
[ -z "$odd" ] || die "$here/$odd: not a regular file (links and devices are refused)"
if grep -v '^[0-9a-f]\{64\}  [A-Za-z0-9_]' SHA256SUMS | grep -q . || grep -q '\.\./' SHA256SUMS; then
    die "$here/SHA256SUMS: malformed (every line must be '<sha256>  <relative path>')"
fi
if ! out=$(sha256sum -c --quiet SHA256SUMS 2>/dev/null); then
    name=$(printf '%s\n' "$out" | sed -n 's/^\(.*\): FAILED.*$/\1/p' | head -n 1)
    die "$here/${name:-SHA256SUMS}: sha256 does not match SHA256SUMS (damaged or modified after packaging); nothing installed"
fi
cut -c67- SHA256SUMS | sort > "$stage/listed"
find . -type f | sed 's|^\./||' | grep -v '^SHA256SUMS$' | sort > "$stage/present"
extra=$(comm -13 "$stage/listed" "$stage/present" | head -n 1)
[ -z "$extra" ] || die "$here/$extra: not listed in SHA256SUMS (added after packaging); nothing installed"
id=$(sha256sum SHA256SUMS | cut -c1-64)

if [ -f "$prefix/.installed" ] && [ "$(cat "$prefix/.installed")" = "$id" ] \
        && (cd "$prefix" && sha256sum -c --quiet SHA256SUMS >/dev/null 2>&1) \
        && { [ "$python" = no ] || [ -x "$prefix/venv/bin/python" ]; }; then
    echo "install.sh: $prefix already holds this package (SHA256SUMS $id); nothing changed"
    exit 0
fi

if [ "$python" = yes ]; then
    [ -f wheels/requirements.txt ] || die "$here: no wheels/ (packaged without --with-python); install without --python"
    py=$(command -v python3.11 || command -v python3 || true)
    [ -n "$py" ] || die "python3.11: not found (the bundled wheels are for CPython 3.11)"
    rm -rf "$prefix/venv"
    "$py" -m venv "$prefix/venv" || die "$py -m venv $prefix/venv failed"
    "$prefix/venv/bin/pip" install --quiet --no-index --no-deps --require-hashes --find-links "$stage/package/wheels" \
        -r wheels/requirements.txt || die "pip could not install the bundled wheels (hashes checked) into $prefix/venv"
fi

# Readable by the services that run the model; the staging directory itself stays private.
chmod -R u=rwX,go=rX "$stage/package"
rm -f "$prefix/.installed"
if [ -f "$prefix/SHA256SUMS" ]; then  # what an earlier package put here
    cut -c67- "$prefix/SHA256SUMS" | cut -d/ -f1 | sort -u | while read -r top; do
        case "$top" in ""|.|..|.*) continue ;; esac  # never above or beside what a package put here
        rm -rf "${prefix:?}/$top"
    done
fi
for entry in * ; do
    rm -rf "${prefix:?}/$entry"
    mv "$entry" "$prefix/$entry"
done

# shellcheck disable=SC2086  # EDGE_EMULATOR is a command prefix, split on purpose
if ! ${EDGE_EMULATOR:-} "$prefix/bin/run" --selftest; then
    die "$prefix/bin/run --selftest failed: the installed model does not reproduce the host's outputs on this device"
fi
echo "$id" > "$prefix/.installed"
chmod 644 "$prefix/.installed"
echo "installed in $prefix (SHA256SUMS $id): run $prefix/bin/run --input tensor.npy --top-k 5"
