"""Check a bundle before anything is installed: private copy, signature, SHA256SUMS, safe extraction.

The bundle is read once, into a private copy; the signature, SHA256SUMS and extraction all
read that copy, so replacing BUNDLE after the check changes nothing that gets installed.
Standard library only (python3 >= 3.10): this runs on the air-gapped host before any
package exists there. Each failure raises Refusal, whose text is the single line
install.sh prints after "refused: ", naming the file and the reason.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import posixpath
import stat
import sys
import tarfile
from pathlib import Path

_HERE = Path(__file__).resolve().parent
# In a bundle minisign.py sits beside this file; in a source checkout it is appliance/core/minisign.py.
for _candidate in (_HERE, _HERE.parent / "appliance" / "core"):
    if (_candidate / "minisign.py").exists():
        sys.path.insert(0, str(_candidate))
        break
import minisign  # noqa: E402


class Refusal(Exception):
    """The bundle is refused; str() is 'FILE: reason'."""


COPY_NAME = "bundle.tar"
MAX_LIST_BYTES = 16 << 20  # SHA256SUMS and bundle.json: a line per file of a few thousand files


class PrivateCopy:
    """The bundle's bytes, copied once into a directory only this user can write.

    Why: a check on one read of BUNDLE and an extraction from another read would let
    whoever can replace BUNDLE in between install unsigned code. Everything after the copy
    (signature, SHA256SUMS, extraction) reads `file`, an fd on a file in that directory.
    """

    def __init__(self, origin: Path, path: Path, file, sha256: str, blake2b: bytes, size: int):
        self.origin, self.path, self.file = origin, path, file
        self.sha256, self.blake2b, self.size = sha256, blake2b, size

    def tar(self) -> tarfile.TarFile:
        self.file.seek(0)
        try:
            return tarfile.open(fileobj=self.file, mode="r:")
        except (tarfile.TarError, OSError) as err:
            raise Refusal(f"{self.origin}: not a readable tar ({err})") from None

    def close(self) -> None:
        self.file.close()

    def discard(self) -> None:
        """Close and delete the copy once it is extracted: the venv needs the room (a CPU site's
        bundle is 3.5 GB), and nothing reads the copy after extraction."""
        self.close()
        self.path.unlink(missing_ok=True)


def read_small(path: Path, what: str, limit: int = MAX_LIST_BYTES) -> bytes:
    """A small file read whole, refused (one line) when it is not a regular file or past limit bytes."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as err:
        raise Refusal(f"{path}: cannot read the {what}: {err.strerror or err}") from None
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise Refusal(f"{path}: not a regular file, so not a {what}")
        data = f.read(limit + 1)
    if len(data) > limit:
        raise Refusal(f"{path}: more than {limit >> 20} MiB, too large for a {what}")
    return data


def check_private(directory: Path) -> None:
    """directory must be a real directory owned by this user that nobody else can write or enter."""
    st = os.lstat(directory)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
        raise Refusal(f"{directory}: not a private directory (needs owner uid {os.geteuid()}, mode 0700; "
                      f"has uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):04o})")


def private_copy(bundle: Path, directory: Path) -> PrivateCopy:
    """Copy bundle into directory (private, checked) in one read, hashing the bytes as they are written."""
    check_private(directory)
    try:
        src = os.open(bundle, os.O_RDONLY | os.O_NOFOLLOW | os.O_NOCTTY | os.O_NONBLOCK)
    except OSError as err:
        why = "a symlink" if err.errno == errno.ELOOP else err.strerror
        raise Refusal(f"{bundle}: cannot open ({why})") from None
    path = directory / COPY_NAME
    try:
        if not stat.S_ISREG(os.fstat(src).st_mode):
            raise Refusal(f"{bundle}: not a regular file")
        dst = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        copy = os.fdopen(dst, "w+b")
        sha, blake, size = hashlib.sha256(), hashlib.blake2b(digest_size=64), 0
        try:
            while block := os.read(src, 1 << 20):
                copy.write(block)
                sha.update(block)
                blake.update(block)
                size += len(block)
            copy.flush()
        except OSError as err:
            copy.close()
            raise Refusal(f"{bundle}: copying into {directory} failed ({err.strerror})") from None
    finally:
        os.close(src)
    return PrivateCopy(bundle, path, copy, sha.hexdigest(), blake.digest(), size)


def check_signature(copy: PrivateCopy, pubkey: str | None, allow_unsigned: bool) -> str | None:
    """Verify BUNDLE.minisig over the private copy's bytes with pubkey; return the trusted comment or None."""
    bundle = copy.origin
    signature = Path(f"{bundle}.minisig")
    if pubkey is None:
        if not allow_unsigned:
            raise Refusal(f"{bundle}: no --pubkey given, so its signature cannot be checked "
                          "(pass --pubkey KEY, or --allow-unsigned to install it unverified)")
        return None
    if not signature.exists():
        raise Refusal(f"{signature}: missing: the bundle is unsigned (refusing; --allow-unsigned without "
                      "--pubkey installs it unverified)")
    try:
        return minisign.verify_digest(copy.blake2b, bundle.name, str(signature), pubkey)
    except minisign.SignatureError as err:
        raise Refusal(str(err)) from None


def _members(tar: tarfile.TarFile, bundle: Path, dest: Path) -> tuple[str, list[tarfile.TarInfo]]:
    """The top directory and the members, each checked for a safe name and type first."""
    members = tar.getmembers()
    if not members:
        raise Refusal(f"{bundle}: empty tar")
    top = member_name(members[0].name).split("/", 1)[0]
    seen: dict[str, str] = {}
    for member in members:
        _refuse_unsafe(member, top, dest)
        # By the file it lands on: `T/./x`, `T//x` and `T/x/` are all T/x. A later copy would
        # silently replace the checked one at extraction.
        name = member_name(member.name)
        if name in seen:
            also = "" if seen[name] == member.name else f" (as {seen[name]} and {member.name})"
            raise Refusal(f"{member.name}: appears twice in the bundle{also}")
        seen[name] = member.name
    return top, members


def member_name(name: str) -> str:
    """The path a member's name extracts to, in one spelling: no `.`, empty or trailing parts."""
    return posixpath.normpath(name) if name not in ("", ".") else name


def check_sums(copy: PrivateCopy, dest: Path) -> tuple[str, dict]:
    """Every regular file in the tar must be listed in SHA256SUMS with its hash, and every listed file present.

    Member names and types are checked first (see _refuse_unsafe): a name that leaves the
    bundle is refused before any byte of it is read, and again at extraction.
    """
    with copy.tar() as tar:
        top, members = _members(tar, copy.origin, dest)
        files = {member_name(m.name)[len(top) + 1:]: m for m in members if m.isfile()}
        if "SHA256SUMS" not in files:
            raise Refusal(f"{copy.origin}: SHA256SUMS missing")
        for small in ("SHA256SUMS", "bundle.json"):  # read whole below: text, never gigabytes
            if small in files and files[small].size > MAX_LIST_BYTES:
                raise Refusal(f"{small}: {files[small].size} bytes, more than the {MAX_LIST_BYTES >> 20} MiB "
                              "such a list can be")
        listed = {}
        for number, line in enumerate(tar.extractfile(files["SHA256SUMS"]).read().decode("utf-8", "replace")
                                      .splitlines(), 1):
            digest, sep, name = line.partition("  ")
            if not sep or len(digest) != 64:
                raise Refusal(f"SHA256SUMS: line {number}: not `<sha256>  <file>`")
            if member_name(name) in listed:
                raise Refusal(f"SHA256SUMS: line {number}: {name} is listed twice")
            listed[member_name(name)] = digest
        for name, member in files.items():
            if name == "SHA256SUMS":
                continue
            if name not in listed:
                raise Refusal(f"{name}: not listed in SHA256SUMS")
            h = hashlib.sha256()
            stream = tar.extractfile(member)
            while block := stream.read(1 << 20):
                h.update(block)
            if h.hexdigest() != listed[name]:
                raise Refusal(f"{name}: sha256 mismatch (SHA256SUMS has {listed[name][:12]}..., "
                              f"the file is {h.hexdigest()[:12]}...)")
        absent = sorted(set(listed) - set(files))
        if absent:
            raise Refusal(f"{absent[0]}: listed in SHA256SUMS but not in the bundle")
        try:
            manifest = json.loads(tar.extractfile(files["bundle.json"]).read())
        except (KeyError, ValueError) as err:
            raise Refusal(f"bundle.json: missing or not JSON ({err})") from None
    return top, manifest


def _refuse_unsafe(member: tarfile.TarInfo, top: str, dest: Path) -> None:
    """Our own check of each member, same intent as PEP 706's `data` filter, with a clear line."""
    name = member.name
    if name.startswith("/") or (len(name) > 1 and name[1] == ":"):
        raise Refusal(f"{name}: absolute path in the bundle")
    parts = name.split("/")
    if ".." in parts:
        raise Refusal(f"{name}: path with '..' leaves the bundle")
    if parts[0] != top:
        raise Refusal(f"{name}: outside the bundle's top directory {top}/")
    if member.issym() or member.islnk():
        target = member.linkname
        resolved = posixpath.normpath(posixpath.join(posixpath.dirname(name), target)) if member.issym() \
            else posixpath.normpath(target)
        where = "leaves the bundle" if target.startswith("/") or resolved.split("/")[0] in ("..", "") \
            or not resolved.startswith(top + "/") else "is a link (bundles hold only files)"
        raise Refusal(f"{name}: {'symlink' if member.issym() else 'hard link'} to {target} {where}")
    if not (member.isfile() or member.isdir()):
        raise Refusal(f"{name}: not a regular file or directory (device, fifo or other special file)")
    final = (dest / name).resolve()
    if not final.is_relative_to(dest.resolve()):
        raise Refusal(f"{name}: resolves outside the extraction directory")


def extract(copy: PrivateCopy, dest: Path) -> Path:
    """Extract the private copy into dest after checking every member again; return dest/top."""
    with copy.tar() as tar:
        top, members = _members(tar, copy.origin, dest)
        if hasattr(tarfile, "data_filter"):  # Python 3.10.12+ / 3.11.4+: PEP 706 as a second guard
            try:
                tar.extractall(dest, members=members, filter="data")
            except tarfile.FilterError as err:
                raise Refusal(f"{getattr(err, 'tarinfo', None) and err.tarinfo.name}: {err}") from None
        else:
            tar.extractall(dest, members=members)
            for root, dirs, names in os.walk(dest):  # what the data filter would do to modes
                for n in dirs + names:
                    p = os.path.join(root, n)
                    os.chmod(p, os.stat(p).st_mode & 0o755)
    return dest / top
