#!/bin/sh
# Edge package installer, made by `appliance package`. Runs on the aarch64 device, offline.
#
#   ./install.sh --prefix DIR --pubkey KEY.pub [--python]   first install (DIR: /opt/appliance-edge by default)
#   DIR/install.sh --package NEW_PACKAGE_DIR [--python]     every later install, by the installed copy
#   ANCHOR/install-package --package PKG [--prefix DIR]     any install, by the device's trust anchor
#
# The trust anchor (`appliance edge anchor`: this script as install-package, bin/verify and the site's
# trusted.pub, installed once per device) checks every package with its own key and program: no byte
# of the package runs before its signature, sums and file list are checked (docs/edge.md).
#
# Trust: KEY.pub is the site's public key, carried to the device once and checked out of band
# (its key id is what `appliance package` printed). The first install keeps it in
# DIR/.appliance-edge/trusted.pub; from then on every package is checked by what is ALREADY
# installed (DIR/install.sh and DIR/bin/run --verify-signature) before any file of the new package
# runs. `--trust-package-key` instead trusts the key the first package carries (trust on first use).
# Steps: 1. a private copy (mode 700) of the package under DIR, which every later step reads;
# 2. SHA256SUMS.minisig checked with the trusted key, every file against SHA256SUMS, no unlisted files
# or links; 3. the copy's bin/run --selftest (golden samples vs the host); 4. with --python, DIR/venv
# from the copy's wheels (pip --no-index --require-hashes); 5. the files listed in
# DIR/.appliance-edge/files (what the last install put there) are replaced by the new package's, and
# nothing else in DIR is touched. A DIR holding files this installer did not put there, and no such
# list, is refused. Running it again for the same package changes nothing. Exit status: 0 installed
# (or already installed), 1 refused or self-test failed. EDGE_EMULATOR (e.g. "qemu-aarch64 -L SYSROOT")
# runs the aarch64 programs off the device, for testing this script on a build host.
set -eu

die() {
    echo "install.sh: error: $*" >&2
    exit 1
}

here=$(cd "$(dirname "$0")" && pwd)
prefix=
package=
pubkey=
tofu=no
python=no
while [ $# -gt 0 ]; do
    case "$1" in
        --prefix) [ $# -ge 2 ] || die "--prefix needs a directory"; prefix=$2; shift 2 ;;
        --prefix=*) prefix=${1#--prefix=}; shift ;;
        --package) [ $# -ge 2 ] || die "--package needs a directory"; package=$2; shift 2 ;;
        --package=*) package=${1#--package=}; shift ;;
        --pubkey) [ $# -ge 2 ] || die "--pubkey needs a file"; pubkey=$2; shift 2 ;;
        --pubkey=*) pubkey=${1#--pubkey=}; shift ;;
        --trust-package-key) tofu=yes; shift ;;
        --python) python=yes; shift ;;
        -h|--help) sed -n '2,25p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) die "unknown argument $1 (usage: install.sh --prefix DIR --pubkey KEY.pub [--python], or DIR/install.sh --package NEW)" ;;
    esac
done
anchor=no
if [ -f "$here/trusted.pub" ] && [ -f "$here/bin/verify" ]; then  # the device's trust anchor
    anchor=yes
    [ -n "$package" ] || die "--package DIR: the package to install is needed (this is the device's trust anchor, $here)"
    [ "$tofu" = no ] || die "--trust-package-key: the trust anchor trusts only its own key ($here/trusted.pub)"
fi
if [ -z "$prefix" ]; then  # the installed copy installs into its own directory
    if [ -f "$here/.appliance-edge/trusted.pub" ]; then prefix=$here; else prefix=/opt/appliance-edge; fi
fi
[ -n "$package" ] || package=$here
nl='
'
for value in "$prefix" "$package" "$pubkey"; do  # every message is one line, every path one argument
    case "$value" in *"$nl"*) die "a path holds a line break ($(printf '%s' "$value" | head -n 1)...); refused" ;; esac
done
case "$prefix" in -*) prefix=./$prefix ;; esac  # a name, never an option of mkdir, cd or find
case "$package" in -*) package=./$package ;; esac
case "$pubkey" in -*) pubkey=./$pubkey ;; esac
package=$(cd "$package" 2>/dev/null && pwd) || die "$package: no such package directory"
[ -f "$package/SHA256SUMS" ] || die "$package: no SHA256SUMS (not an edge package made by \`appliance package\`)"
if [ -n "$pubkey" ]; then
    [ -f "$pubkey" ] || { [ ! -e "$pubkey" ] || die "$pubkey: not a regular file (a device, pipe or folder), so not a public key"
        die "$pubkey: no such public key file"; }
    pubkey=$(cd "$(dirname "$pubkey")" && pwd)/${pubkey##*/}  # read after the cd below
fi
if [ -e "$prefix" ] && [ ! -d "$prefix" ]; then die "$prefix: exists and is not a directory"; fi
mkdir -p "$prefix" 2>/dev/null || die "$prefix: cannot create the install directory"
prefix=$(cd "$prefix" && pwd)
[ "$prefix" != "$package" ] || die "$prefix: is the package itself; install it somewhere else"
state=$prefix/.appliance-edge
[ ! -L "$state" ] || die "$state: is a symbolic link; install.sh keeps its state only in a directory of its own"

# One installer per DIR: two at once would mix two packages' files under one `installed`.
# mkdir is atomic and never follows a link; a lock whose installer is gone (killed) is taken over.
lock=$prefix/.install.lock
if ! mkdir "$lock" 2>/dev/null; then
    holder=$(cat "$lock/pid" 2>/dev/null || true)
    case "$holder" in ''|*[!0-9]*) holder= ;; esac
    if [ -n "$holder" ] && kill -0 "$holder" 2>/dev/null; then
        die "$prefix: another install.sh (pid $holder) is installing into it; nothing installed: wait for it to finish (or remove $lock if none is running)"
    fi
    rm -rf "$lock" && mkdir "$lock" 2>/dev/null || die "$lock: cannot take the install lock; nothing installed"
fi
echo $$ > "$lock/pid"

umask 077
stage=$(mktemp -d "$prefix/.install.XXXXXX") || { rm -rf "$lock"; die "$prefix: cannot make a private staging directory"; }
trap 'rm -rf "$stage" "$lock"' EXIT INT TERM
cp -R "$package" "$stage/package" || die "$package: cannot copy the package to $stage"
cd "$stage/package"

# Only the copy from here on: plain files, then the signature (SHA256SUMS is what it covers).
odd=$(find . ! -type f ! -type d | sed 's|^\./||' | head -n 1)
[ -z "$odd" ] || die "$package/$odd: not a regular file (links and devices are refused)"
[ -f SHA256SUMS.minisig ] || die "$package/SHA256SUMS.minisig: missing: the package is not signed (made by an \`appliance package\` without signing?); nothing installed"
if [ "$anchor" = yes ]; then
    [ -z "$pubkey" ] || cmp -s "$pubkey" "$here/trusted.pub" \
        || die "$pubkey: not the key this trust anchor holds ($here/trusted.pub); the anchor checks packages with its own key only"
    [ ! -f "$state/trusted.pub" ] || cmp -s "$state/trusted.pub" "$here/trusted.pub" \
        || die "$prefix: trusts another key ($state/trusted.pub) than this trust anchor ($here/trusted.pub); nothing installed"
    key=$here/trusted.pub
    verifier=$here/bin/verify  # the anchor's: installed once, never a package's
elif [ -f "$state/trusted.pub" ]; then
    [ -z "$pubkey" ] || cmp -s "$pubkey" "$state/trusted.pub" \
        || die "$pubkey: $prefix already trusts another key ($state/trusted.pub); to rotate keys replace that file out of band"
    [ -x "$prefix/bin/run" ] || die "$prefix/bin/run: missing: the installed verifier is gone; reinstall into a new directory"
    key=$state/trusted.pub
    verifier=$prefix/bin/run  # installed before, trusted since: never the new package's
elif [ -n "$pubkey" ]; then
    key=$pubkey
    verifier=./bin/run  # nothing is installed yet: the new package's own (see docs/edge.md, first install)
elif [ "$tofu" = yes ]; then
    [ -f signing-key.pub ] || die "$package/signing-key.pub: missing; pass --pubkey KEY.pub"
    key=signing-key.pub
    verifier=./bin/run
    echo "install.sh: trusting on first use the key the package carries: $(sed -n 's/^untrusted comment: //p' signing-key.pub | head -n 1); compare its key id with the one \`appliance package\` printed"
else
    die "$prefix: no trusted key yet: pass --pubkey KEY.pub (the site's public key, carried to this device once), or --trust-package-key"
fi
case "$key" in /*) keyname=$key ;; *) keyname=$package/$key ;; esac
cp "$key" "$stage/key.pub" || die "$keyname: cannot be read"
key=$stage/key.pub  # the bytes checked are the bytes kept as trusted.pub
if command -v minisign >/dev/null 2>&1 && [ "$verifier" = ./bin/run ]; then
    # A first install: the system's own minisign, where there is one, rather than the package's program.
    # Not -q: minisign -Vq says nothing when it refuses, and the line must say what failed.
    if ! out=$(minisign -V -m SHA256SUMS -x SHA256SUMS.minisig -p "$key" 2>&1); then
        why=$(printf '%s\n' "$out" | grep . | tr '\n' ' ' | sed 's/ *$//')
        die "$package/SHA256SUMS.minisig: signature check failed (minisign: ${why:-refused, with no message}); nothing installed"
    fi
else
    case "$verifier" in ./*) shown=$package/${verifier#./} ;; *) shown=$verifier ;; esac
    [ -f "$verifier" ] || die "$shown: missing; nothing installed"
    # shellcheck disable=SC2086  # EDGE_EMULATOR is a command prefix, split on purpose
    if ! out=$(${EDGE_EMULATOR:-} "$verifier" --verify-signature SHA256SUMS --signature SHA256SUMS.minisig --pubkey "$key" 2>&1); then
        why=$(printf '%s\n' "$out" | grep . | tail -n 1 | sed "s/^[a-z]*: refused: SHA256SUMS.minisig: //; s/^[a-z]*: [a-z]*: //; s|$key|$keyname|")
        die "$package/SHA256SUMS.minisig: ${why:-$shown --verify-signature refused it with no message}; nothing installed"
    fi
fi

if grep -v '^[0-9a-f]\{64\}  [A-Za-z0-9_][A-Za-z0-9_.+/-]*$' SHA256SUMS | grep -q . \
        || grep -q '  \.\|/\.\./\|/\./\|/\.*$\|//' SHA256SUMS; then
    die "$package/SHA256SUMS: malformed (every line must be '<sha256>  <relative path>')"
fi
cut -c67- SHA256SUMS | sort > "$stage/names"
twice=$(cut -c67- SHA256SUMS | sort -u | comm -23 "$stage/names" - | head -n 1)
[ -z "$twice" ] || die "$package/SHA256SUMS: $twice is listed twice; nothing installed"
if ! out=$(sha256sum -c --quiet SHA256SUMS 2>/dev/null); then
    name=$(printf '%s\n' "$out" | sed -n 's/^\(.*\): FAILED.*$/\1/p' | head -n 1)
    die "$package/${name:-SHA256SUMS}: sha256 does not match SHA256SUMS (damaged or modified after packaging); nothing installed"
fi
cut -c67- SHA256SUMS | sort > "$stage/listed"
find . -type f | sed 's|^\./||' | grep -v '^SHA256SUMS$' | grep -v '^SHA256SUMS\.minisig$' | sort > "$stage/present"
extra=$(comm -13 "$stage/listed" "$stage/present" | head -n 1)
[ -z "$extra" ] || die "$package/$extra: not listed in SHA256SUMS (added after packaging); nothing installed"
id=$(sha256sum SHA256SUMS | cut -c1-64)

{ cut -c67- SHA256SUMS; echo SHA256SUMS; echo SHA256SUMS.minisig; [ "$python" = no ] || echo venv; } | sort -u > "$stage/new"

# What this installer owns in DIR: the list the last install wrote (paths relative to DIR).
owned=$stage/owned
if [ ! -f "$state/files" ] && [ -f "$prefix/.installed" ] && [ -f "$prefix/SHA256SUMS" ]; then
    # An install by the earlier install.sh, which kept only .installed: its SHA256SUMS says what it put here.
    { cut -c67- "$prefix/SHA256SUMS"; echo SHA256SUMS; echo .installed; } > "$stage/earlier"
    list=$stage/earlier
else
    list=$state/files
fi
if [ -f "$list" ]; then
    # Only names this installer writes: a package file (as SHA256SUMS spells them), venv, or the earlier
    # installer's .installed; never its own state, a hidden top-level name, '.', '..' or an absolute path.
    bad=$(grep -v '^[A-Za-z0-9_][A-Za-z0-9_.+/-]*$' "$list" | grep -vx '\.installed' | head -n 1 || true)
    [ -n "$bad" ] || bad=$(grep '/\.\./\|/\.\.$\|/\./\|/\.$\|//\|/$' "$list" | head -n 1 || true)
    [ -z "$bad" ] || die "$list: malformed: '$bad' is not a path this installer puts in $prefix; $prefix left as it was"
    sort -u "$list" > "$owned"
else
    # At most 1000 names are looked at: a DIR that is a link to / is refused without walking the disk.
    foreign=$(cd "$prefix" && find . -path './.install.*' -prune -o ! -type d -print 2>/dev/null | head -n 1000 \
        | sed 's|^\./||' | sort)
    if [ -n "$foreign" ]; then
        count=$(printf '%s\n' "$foreign" | wc -l | tr -d ' ')
        [ "$count" -lt 1000 ] || count="1000 or more"
        names=$(printf '%s\n' "$foreign" | head -n 3 | while read -r f; do printf '%s ' "$prefix/$f"; done | sed 's/ $//')
        die "$prefix: holds $count file(s) this installer did not put there ($names) and no $state/files: nothing installed; install into an empty or new directory"
    fi
    : > "$owned"
fi
# Nothing is removed or written through a link or into a directory it did not make: a folder of a listed
# path that is a link (lib -> /usr/lib) would take the removal or the new file outside DIR, and a listed
# name that is a directory (etc) would take the site's own files with it.
sort -u "$owned" "$stage/new" | while read -r f; do
    d=$(dirname "$f")
    while [ "$d" != . ]; do
        [ ! -L "$prefix/$d" ] || { echo "$prefix/$d: is a symbolic link; install.sh writes and removes only inside $prefix"; break; }
        d=$(dirname "$d")
    done
    if [ "$f" != venv ] && [ -d "$prefix/$f" ] && [ ! -L "$prefix/$f" ]; then
        echo "$prefix/$f: is a directory where $list or the package has a file; install.sh removes only files it put there"
    fi
done | head -n 1 > "$stage/unsafe"
[ ! -s "$stage/unsafe" ] || die "$(cat "$stage/unsafe"); nothing installed"
for f in files files.tmp installed trusted.pub; do
    if [ -L "$state/$f" ] || { [ -e "$state/$f" ] && [ ! -f "$state/$f" ]; }; then
        die "$state/$f: not a regular file; nothing installed"
    fi
done
clash=$(comm -23 "$stage/new" "$owned" | while read -r f; do
    if [ -e "$prefix/$f" ] || [ -L "$prefix/$f" ]; then echo "$prefix/$f"; fi; done | head -n 1)
[ -z "$clash" ] || die "$clash: exists and was not installed by this installer (not in $state/files); nothing installed"

if [ -f "$state/installed" ] && [ "$(cat "$state/installed")" = "$id" ] \
        && (cd "$prefix" && sha256sum -c --quiet SHA256SUMS >/dev/null 2>&1) \
        && { [ "$python" = no ] || [ -x "$prefix/venv/bin/python" ]; }; then
    echo "install.sh: $prefix already holds this package (SHA256SUMS $id); nothing changed"
    exit 0
fi

# Readable by the services that run the model; the staging directory itself stays private.
chmod -R u=rwX,go=rX "$stage/package"
# The new model proves itself from the private copy, before anything in DIR changes.
# shellcheck disable=SC2086  # EDGE_EMULATOR is a command prefix, split on purpose
if ! ${EDGE_EMULATOR:-} "$stage/package/bin/run" --selftest; then
    die "$package: bin/run --selftest failed: the model does not reproduce the host's outputs on this device; $prefix left as it was"
fi

umask 022
mkdir -p "$state"
# The list first, covering old and new: an install cut short leaves every file it may have placed owned.
# State files are written in the private stage and renamed in: a rename replaces a link, never follows it.
sort -u "$owned" "$stage/new" > "$stage/files" && chmod 644 "$stage/files" && mv -f "$stage/files" "$state/files"
rm -f "$state/installed"
comm -23 "$owned" "$stage/new" | while read -r f; do
    if [ "$f" = venv ]; then rm -rf "${prefix:?}/venv"; else rm -f "${prefix:?}/$f"; fi
done
if [ "$python" = yes ]; then
    [ -f wheels/requirements.txt ] || die "$package: no wheels/ (packaged without --with-python); install without --python"
    py=$(command -v python3.11 || command -v python3 || true)
    [ -n "$py" ] || die "python3.11: not found (the bundled wheels are for CPython 3.11)"
    rm -rf "${prefix:?}/venv"  # ours: listed in $state/files, or absent (checked above)
    "$py" -m venv "$prefix/venv" || die "$py -m venv $prefix/venv failed"
    "$prefix/venv/bin/pip" install --quiet --no-index --no-deps --require-hashes --find-links "$stage/package/wheels" \
        -r wheels/requirements.txt || die "pip could not install the bundled wheels (hashes checked) into $prefix/venv"
fi
# Each file by rename: a running DIR/install.sh keeps reading the file it started from.
grep -v '^venv$' "$stage/new" | while read -r f; do
    mkdir -p "$prefix/$(dirname "$f")"
    mv -f "$f" "$prefix/$f"
done
echo "$id" > "$stage/installed"
if [ "$anchor" = yes ]; then later=$here/install-package; else later=$prefix/install.sh; fi
chmod 644 "$key" "$stage/new" "$stage/installed"
[ -f "$state/trusted.pub" ] || mv -f "$key" "$state/trusted.pub"
mv -f "$stage/new" "$state/files"
mv -f "$stage/installed" "$state/installed"
echo "installed in $prefix (SHA256SUMS $id, signature checked with $state/trusted.pub): run $prefix/bin/run --input tensor.npy --top-k 5; install later packages with $later --package DIR"
