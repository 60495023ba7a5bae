#!/usr/bin/env bash
# Fetch include/qemu/qemu-plugin.h of the SAME QEMU as the installed qemu-user (Debian's source
# package, from deb.debian.org, under a private apt configuration: the host's apt state is untouched)
# into DEST (default wheelhouse/qemu-plugin). Needs a connected host once; appliance/deploy/edge/cycles.py
# then builds its plugin offline. A plugin built against another version's header is refused by qemu.
set -euo pipefail
dest=${1:-$(dirname "$0")/../../../wheelhouse/qemu-plugin}
version=$(dpkg-query -W -f='${source:Version}' qemu-user)
mkdir -p "$dest"
if [ -f "$dest/qemu-plugin.h" ] && [ "$(cat "$dest/VERSION" 2>/dev/null)" = "$version" ]; then
  echo "qemu-plugin.h for qemu $version present in $dest"; exit 0
fi
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
mkdir -p "$tmp/lists/partial"
keyring=/usr/share/keyrings/debian-archive-keyring.gpg
cat > "$tmp/sources.list" <<LIST
deb-src [signed-by=$keyring] http://deb.debian.org/debian bookworm main
deb-src [signed-by=$keyring] http://deb.debian.org/debian-security bookworm-security main
deb-src [signed-by=$keyring] http://deb.debian.org/debian bookworm-updates main
LIST
apt_opts=(-o "Dir::Etc::SourceList=$tmp/sources.list" -o Dir::Etc::SourceParts=/dev/null
          -o "Dir::State::Lists=$tmp/lists" -o Debug::NoLocking=1)
[ "$(id -u)" -eq 0 ] && apt_opts+=(-o APT::Sandbox::User=root)
apt-get "${apt_opts[@]}" update -qq
(cd "$tmp" && apt-get "${apt_opts[@]}" source --download-only -qq "qemu=$version")
orig=$(ls "$tmp"/qemu_*.orig.tar.xz)
tar -xJf "$orig" -C "$tmp" --wildcards '*/include/qemu/qemu-plugin.h'
cp "$tmp"/*/include/qemu/qemu-plugin.h "$dest/qemu-plugin.h"
echo "$version" > "$dest/VERSION"
sha256sum "$orig" | sed "s#$tmp/##" > "$dest/SOURCE.sha256"
echo "qemu-plugin.h for qemu $version -> $dest"
