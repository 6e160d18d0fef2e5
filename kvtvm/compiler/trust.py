"""What the kernel cache trusts: directories and files that only this user (or root) can
write, binaries whose sha256 matches their manifest, written with explicit modes.

Like ssh with its keys, kvtvm refuses (:class:`~kvtvm.errors.UntrustedKernelError`, naming the
path and the reason) to load code from a directory or file owned by another user, or that group
or others can write. The user cache is created ``0700``; built files and tuning logs are made
``0644`` and the other directories kvtvm creates ``0755``, whatever the umask. Each module's
manifest records its sha256, checked before ``dlopen``: a truncated or corrupt module is rebuilt when the
compiler is present and is a :class:`~kvtvm.errors.CorruptKernelError` naming the file when it
is not (never a SIGBUS).

Tuning logs (their knobs shape the code that is built) get the same owner and permission
checks. As ssh does, every directory above a kernel directory or a tuning log is checked too,
up to the user's home directory (or the filesystem root when the path is not under home): one
that another user owns or that group/others can write could swap the whole subtree. A
root-owned directory with the sticky bit (``/tmp``) passes: others may add entries there but
cannot rename or remove ours. A path is resolved once (:func:`resolve_trusted`): every symlink
met on the way is checked too (the directories above it; its owner when others may write its
directory), and the resolved path is what is hashed, read and loaded -- never the path again.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import stat
import tempfile
from pathlib import Path

from ..errors import CorruptKernelError, InvalidArgumentError, UntrustedKernelError, describe

__all__ = ["FILE_MODE", "CACHE_DIR_MODE", "check_trusted", "check_trusted_parents",
           "resolve_trusted", "expand_user", "check_before_making",
           "check_trusted_tree", "secure_cache_dir", "sha256_of", "set_file_mode",
           "check_digest", "DIR_MODE", "make_dirs", "write_file", "open_regular"]

log = logging.getLogger(__name__)

#: Mode of every file kvtvm writes into a kernel directory.
FILE_MODE = 0o644
#: Mode of the user cache directories kvtvm creates.
CACHE_DIR_MODE = 0o700
#: Mode of the other directories kvtvm creates for what it writes (kernel directories, their
#: ``<target>/`` folders, tuning logs): never group/other-writable, which the checks refuse.
DIR_MODE = 0o755


def _trusted_owner(uid: int) -> bool:
    return uid == os.geteuid() or uid == 0


def _stat(path: Path) -> os.stat_result:
    """``os.lstat`` of ``path`` (called on resolved paths, and on the links met resolving
    them); one place for the tests to fake owners."""
    return os.lstat(path)


#: Links followed resolving one path before it is refused as a loop (as the kernel's ELOOP).
MAX_LINKS = 40


def _absolute(path: Path) -> Path:
    """``path`` made absolute without resolving anything (``..`` kept: it follows links)."""
    return path if path.is_absolute() else Path(os.getcwd(), path)


def _resolve(path: Path, what: str) -> tuple[Path, list[Path]]:
    """``path`` made absolute with every symlink resolved (as :func:`os.path.realpath`; a
    missing tail is kept as is), and the links met on the way, in order."""
    absolute = _absolute(path)
    todo = list(reversed(absolute.parts[1:]))
    cur, links = Path(absolute.anchor), []
    while todo:
        part = todo.pop()
        if part in ("", "."):
            continue
        if part == "..":
            cur = cur.parent
            continue
        nxt = cur / part
        try:
            st = os.lstat(nxt)
        except OSError:  # missing (or not a directory): the checks that follow say so
            return Path(nxt, *reversed(todo)), links
        if not stat.S_ISLNK(st.st_mode):
            cur = nxt
            continue
        links.append(nxt)
        if len(links) > MAX_LINKS:
            raise UntrustedKernelError(f"{what} {path}: too many levels of symbolic links")
        try:
            target = Path(os.readlink(nxt))
        except OSError as err:  # removed or replaced while we walk
            raise UntrustedKernelError(f"{what} {path}: cannot be checked ({err})") from None
        if target.is_absolute():
            cur = Path(target.anchor)
        todo.extend(reversed(target.parts[1:] if target.is_absolute() else target.parts))
    return cur, links


def _check_link(link: Path, path: Path, what: str) -> None:
    """Refuse the symlink ``link`` met resolving ``path`` when another user could re-point it:
    its directory (and every one above it) is checked as a parent, and a link of another
    user than this one or root in a directory others may write (a root-owned sticky one such
    as ``/tmp``, where its owner may replace it) is refused."""
    _check_parent_chain(link, path, what)
    st, dir_st = _stat(link), _stat(link.parent)
    if not _trusted_owner(st.st_uid) and dir_st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise UntrustedKernelError(
            f"{what} {path}: the symbolic link {link} is owned by uid {st.st_uid}, not by this "
            f"user (uid {os.geteuid()}) or root, in {link.parent} that others may write: its "
            "owner could re-point it at code of theirs")


def resolve_trusted(path: str | os.PathLike, what: str = "kernel file") -> Path:
    """``path`` with every symlink resolved, once: the path to check, hash and load, so a link
    re-pointed after the checks changes nothing. Each link met on the way is checked
    (:func:`_check_link`); :class:`UntrustedKernelError` names ``path`` and the link."""
    path = Path(path)
    real, links = _resolve(path, what)
    for link in links:
        _check_link(link, path, what)
    return real


def _refusal(st: os.stat_result, parent: bool) -> str | None:
    """Why a file or directory with stat ``st`` cannot be trusted (None when it can)."""
    if not _trusted_owner(st.st_uid):
        return (f"owned by uid {st.st_uid}, not by this user (uid {os.geteuid()}) or root; "
                "kvtvm loads no code another user could have written")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        if parent and st.st_uid == 0 and st.st_mode & stat.S_ISVTX:
            return None  # /tmp: others may add entries, not rename or remove ours
        return (f"writable by group or others (mode {stat.S_IMODE(st.st_mode):o})")
    return None


def check_trusted(path: str | os.PathLike, what: str = "kernel file") -> Path:
    """Raise :class:`UntrustedKernelError` when ``path`` (a file or directory) is owned by
    another user than this one or root, or group/others can write it; for a path through
    symlinks, also when a link could be re-pointed (:func:`resolve_trusted`) or a directory
    above its target could be written (:func:`check_trusted_parents`). Returns the resolved
    path: what to read or load, never ``path`` again."""
    path = Path(path)
    real = resolve_trusted(path, what)
    try:
        st = _stat(real)
    except OSError as err:
        raise UntrustedKernelError(f"{what} {path}: cannot be checked ({err})") from None
    why = _refusal(st, parent=False)
    if why is not None:
        fix = f"; run `chmod go-w {real}`" if "writable" in why else ""
        raise UntrustedKernelError(f"{what} {path}: {why}{fix}")
    if real != _absolute(path):  # the directories a link leads into, as any path's
        _check_parent_chain(real, path, what)
    return real


def check_trusted_parents(path: str | os.PathLike, what: str = "kernel directory") -> Path:
    """Raise :class:`UntrustedKernelError` naming the directory when one above ``path``
    (resolved: :func:`resolve_trusted`), up to the user's home directory or the filesystem
    root, is owned by another user than this one or root, or group/others can write it (a
    root-owned sticky directory such as ``/tmp`` passes). Without a home directory (no
    ``HOME`` and no passwd entry, as a container run under an arbitrary uid) the walk goes up
    to the root. Returns the resolved path."""
    path = Path(path)
    real = resolve_trusted(path, what)
    _check_parent_chain(real, path, what)
    return real


def _check_parent_chain(real: Path, path: Path, what: str) -> None:
    """The walk of :func:`check_trusted_parents` above the resolved path ``real``."""
    try:
        home = Path.home().resolve()
    except (OSError, RuntimeError, KeyError):  # every kernel was refused: "cannot be checked"
        home = None
    p = real.parent
    while True:
        try:
            st = _stat(p)
        except OSError as err:
            raise UntrustedKernelError(
                f"{what} {path}: its parent directory {p} cannot be checked ({err})") from None
        why = _refusal(st, parent=True)
        if why is not None:
            raise UntrustedKernelError(
                f"{what} {path}: its parent directory {p} is {why}; another user could "
                "replace what lies below it")
        if p == home or p.parent == p:
            return
        p = p.parent


def expand_user(text: str, name: str) -> Path:
    """``Path(text)`` with a leading ``~`` or ``~user`` expanded (a ``~/x`` from Docker's
    ``ENV`` too); :class:`InvalidArgumentError` naming ``name`` (the variable or argument it
    came from) for ``~user`` of an unknown user, or ``~`` without ``HOME`` or a passwd entry
    (a bare ``RuntimeError`` from ``expanduser``)."""
    try:
        return Path(text).expanduser()
    except RuntimeError as err:
        raise InvalidArgumentError(describe(
            name, "a path whose leading '~' can be expanded (a known user, or HOME set)",
            f"{text!r} ({err})")) from None


def check_trusted_tree(path: str | os.PathLike, what: str = "kernel directory") -> Path:
    """:func:`check_trusted` of ``path``, then :func:`check_trusted_parents`; returns the
    resolved path."""
    real = check_trusted(path, what)
    _check_parent_chain(real, Path(path), what)
    return real


def secure_cache_dir(path: Path, own_base: bool = True) -> Path:
    """Create the user cache directory ``path`` (``<base>/tvm-<version>``, missing parents
    included) with mode 0700 whatever the umask. ``path`` that this user owns is tightened to
    0700 (a cache made by an older kvtvm), and so is its base when it is kvtvm's own folder
    (``own_base``: the default ``~/.cache/kvtvm``, not a ``KVTVM_CACHE_DIR`` such as ``/tmp``
    or a home directory, whose mode is the user's: it was made 0700, sticky bit dropped).
    A ``path`` owned by another user or that group/others can write is refused, and so is a
    base that is, unless root owns it with the sticky bit (``/tmp``). Returns ``path``
    resolved (:func:`resolve_trusted`): where to build, so a link re-pointed later changes
    nothing."""
    check_before_making(path, "kernel cache directory")
    make_dirs(path, CACHE_DIR_MODE)
    path = resolve_trusted(path, "kernel cache directory")  # no chmod through another's link
    for d in ((path.parent, path) if own_base else (path,)):
        st = d.stat()
        if st.st_uid == os.geteuid() and stat.S_IMODE(st.st_mode) & 0o077:
            log.warning("kvtvm cache directory %s had mode %o: tightened to 0700", d,
                        stat.S_IMODE(st.st_mode))
            os.chmod(d, CACHE_DIR_MODE)
    real = check_trusted(path, "kernel cache directory")
    _check_parent_chain(real, path, "kernel cache directory")  # the base first, as a parent
    return real


def check_before_making(path: str | os.PathLike, what: str = "kernel directory") -> None:
    """Refuse (:class:`UntrustedKernelError`) a directory ``path`` to be made, before anything
    is made inside another user's tree: the directories above its first missing one are
    checked (:func:`check_trusted_parents`); nothing when it exists (check it then)."""
    missing = _missing_dirs(Path(path))
    if missing:
        check_trusted_parents(missing[-1], what)


def _missing_dirs(path: Path) -> list[Path]:
    """``path`` and its parents that do not exist, deepest first (a dangling link exists)."""
    missing, p = [], path
    while not os.path.lexists(p) and p.parent != p:
        missing.append(p)
        p = p.parent
    return missing


def make_dirs(path: str | os.PathLike, mode: int = DIR_MODE) -> Path:
    """Create the directory ``path`` and its missing parents, each with ``mode`` whatever the
    umask (a umask of 002 would make them group-writable, and then refused); directories that
    exist are left as they are."""
    path = Path(path)
    for d in reversed(_missing_dirs(path)):
        try:
            d.mkdir(mode=mode)
        except FileExistsError:  # another process made it meanwhile
            continue
        os.chmod(d, mode)
    path.mkdir(exist_ok=True)  # raises when it is a file (or a dangling link)
    return path


def write_file(path: str | os.PathLike, text: str) -> Path:
    """Write ``text`` to ``path`` atomically (a temporary file in its directory, renamed) with
    mode :data:`FILE_MODE` whatever the umask; missing directories are made by
    :func:`make_dirs`."""
    path = Path(path)
    make_dirs(path.parent)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        set_file_mode(Path(tmp))
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def set_file_mode(path: Path) -> None:
    """Give a file kvtvm wrote its explicit mode (0644), whatever the umask."""
    os.chmod(path, FILE_MODE)


def open_regular(path: str | os.PathLike):
    """``path`` opened for reading in binary, if it is a regular file (symlinks followed);
    OSError otherwise -- a FIFO is opened without blocking and refused, never read (reading
    one waits for a writer forever)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(f"{path} is not a regular file")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


#: The largest JSON file kvtvm reads back (kernel manifests, tuning logs, candidate lists,
#: the disk tier's model marks); they are kilobytes.
MAX_JSON_BYTES = 16 << 20


def read_json(path: str | os.PathLike):
    """The JSON value held by ``path``: a regular file (:func:`open_regular`: OSError for a
    FIFO, a device, a directory) of at most :data:`MAX_JSON_BYTES`, UTF-8, JSON, nested
    shallowly enough to parse -- ValueError for each of the others."""
    with open_regular(path) as f:
        text = f.read(MAX_JSON_BYTES + 1)
    if len(text) > MAX_JSON_BYTES:
        raise ValueError(f"{path} holds more than {MAX_JSON_BYTES} bytes")
    try:
        return json.loads(text.decode())
    except RecursionError:
        raise ValueError(f"{path} is JSON nested too deeply") from None


def sha256_of(path: str | os.PathLike) -> str:
    """Hex sha256 of a regular file's bytes (:func:`open_regular`)."""
    h = hashlib.sha256()
    with open_regular(path) as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def check_digest(path: Path, manifest: dict | None) -> str | None:
    """Why the module at ``path`` does not match its manifest's sha256 (None when it does)."""
    want = (manifest or {}).get("sha256")
    if not want:
        return "its manifest records no sha256 (built by an older kvtvm)"
    if not isinstance(want, str):
        return f"its manifest's sha256 is not a hex string ({type(want).__name__})"
    try:
        got = sha256_of(path)
    except OSError as err:
        return f"it cannot be read ({err})"
    if got != want:
        return (f"its sha256 {got[:16]}... differs from the manifest's {want[:16]}... "
                f"(truncated or modified; {path.stat().st_size} bytes)")
    return None


def corrupt(path: Path, why: str) -> CorruptKernelError:
    return CorruptKernelError(f"cannot load {path}: {why}; the TVM compiler is not available "
                              "to rebuild it -- rebuild the kernels (`python -m kvtvm build`)")
