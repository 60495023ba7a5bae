#!/usr/bin/env bash
# Install an appliance bundle on an air-gapped host. Needs only bash and python3 (>= 3.10).
#
#   installer/install.sh BUNDLE.tar --prefix /opt/appliance --pubkey bundle.pub
#   installer/install.sh BUNDLE.tar --prefix D --allow-unsigned     (no signature check)
#   installer/install.sh --rollback --prefix D                      (back to the previous install)
#   options: --profile P (default: the bundle's installable profile for this machine),
#            --python PATH (default: python3), --use auto|uv|pip (default auto: uv when bundled),
#            --no-compile (skip compiling bytecode at install),
#            --allow-downgrade (install a version lower than the installed one)
#
# Copies BUNDLE once into a private directory (PREFIX/.staging-*, mode 0700); on that copy only:
# verifies the signature (BUNDLE.minisig) and SHA256SUMS, extracts safely; builds a venv under
# PREFIX/releases/, installs with no network, runs the self-test, then switches PREFIX/current.
# Re-running the same bundle does nothing; a failure leaves the previous install as it was.
# Every refusal is one line: `refused: FILE: reason`. The work is in install_bundle.py.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

python=python3
args=("$@")
for ((i = 0; i < ${#args[@]}; i++)); do
  case "${args[$i]}" in
    -h|--help) sed -n '2,16p' "$0"; exit 0 ;;
    --python) python=${args[$((i + 1))]:-python3} ;;
    --python=*) python=${args[$i]#--python=} ;;
  esac
done
if ! command -v "$python" >/dev/null 2>&1; then
  echo "refused: $python: not found (install.sh needs python3 >= 3.10; pass --python PATH)" >&2
  exit 1
fi
if ! "$python" -c 'import sys; sys.exit(sys.version_info < (3, 10))'; then
  echo "refused: $python: Python $("$python" -c 'import platform; print(platform.python_version())') is older than 3.10" >&2
  exit 1
fi
# -I: the caller's PYTHONPATH, user site-packages and current directory play no part.
exec "$python" -I "$here/install_bundle.py" "$@"
