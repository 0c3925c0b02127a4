"""DockerProvider's transfers through the archive API: one regular file each way, bounded, following no symlink.

Sandbox paths name a file in one of the writable directories (the work directory, ``/tmp``);
relative ones are taken from the work directory, and ``..`` is refused. An upload is a tar stream
of the file and its parent directories, extracted by the daemon at the top of that directory (which
replaces a planted symlink on the way by a real directory and never writes outside it); a download
checks what the path is (``HEAD``: a symlink, directory or special file is refused before anything
is read) and then reads the tar stream's one entry, which must be a regular file, at most
``max_transfer_bytes`` long, whatever the ``HEAD`` said.
"""

from __future__ import annotations

import base64
import json
import os
import stat
import tarfile
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path, PurePosixPath
from typing import Any

import anyio

from ..._errors import SandboxError, SandboxPathError, SandboxTransferLimitError
from .._common._arguments import check_text, sandbox_parts

__all__ = [
    "END",
    "TarEntries",
    "TarReader",
    "check_directory",
    "check_named",
    "check_stat",
    "located",
    "owned_stream",
    "padding",
    "tar_records",
    "tar_stream",
]

_BLOCK = 512
_CHUNK = 1 << 20
# Go's os.FileMode bits, as the daemon reports them in X-Docker-Container-Path-Stat.
_GO_DIR, _GO_SYMLINK, _GO_DEVICE, _GO_PIPE, _GO_SOCKET, _GO_CHAR, _GO_IRREGULAR = (
    1 << 31, 1 << 27, 1 << 26, 1 << 25, 1 << 24, 1 << 21, 1 << 19,
)  # fmt: skip


def located(
    path: str, cwd: PurePosixPath, mounts: Sequence[PurePosixPath], what: str
) -> tuple[PurePosixPath, tuple[str, ...]]:
    """The writable directory ``path`` lies in and its components below it."""
    pure = PurePosixPath(check_text(path, what))
    full = pure if pure.is_absolute() else cwd / pure
    for mount in sorted(mounts, key=lambda m: len(m.parts), reverse=True):
        if full == mount or mount in full.parents:
            return mount, sandbox_parts(str(full), (mount,), what)
    raise SandboxPathError(
        f"{what} {path!r} is outside the sandbox's writable directories ({', '.join(map(str, mounts))}); "
        "transfers and snapshots reach only those: use a relative path or one under them"
    )


def _stat(header: str | None, what: str) -> tuple[int, int]:
    """The Go file mode and the size the daemon's stat header says ``what`` has."""
    try:
        info: dict[str, Any] = json.loads(base64.b64decode(header or ""))
        return int(info["mode"]), int(info["size"])
    except (ValueError, KeyError, TypeError) as exc:
        raise SandboxError(f"the daemon did not say what {what} is ({exc!r:.100})") from exc


def check_stat(header: str | None, path: str, limit: int) -> None:
    """Refuse anything but a regular file of at most ``limit`` bytes, from the daemon's stat header."""
    mode, size = _stat(header, repr(path))
    check_named(header, path)
    if mode & (_GO_DIR | _GO_DEVICE | _GO_PIPE | _GO_SOCKET | _GO_CHAR | _GO_IRREGULAR):
        raise SandboxError(f"{path!r} is not a file in the sandbox (a directory, FIFO, socket or device)")
    if size > limit:
        raise SandboxTransferLimitError(
            f"{path!r} is {size} bytes, over max_transfer_bytes={limit}; nothing was copied "
            "(compress or split it in the sandbox, or raise the provider's limit)"
        )


def check_named(header: str | None, path: str) -> None:
    """Refuse a ``path`` that is a symlink, from the daemon's stat header."""
    if _stat(header, repr(path))[0] & _GO_SYMLINK:
        raise SandboxPathError(
            f"path {path!r} is a symlink; a symlink could lead outside the sandbox, so transfers and snapshots "
            "never follow one: name the real file or directory"
        )


def check_directory(header: str | None, path: str, component: str) -> None:
    """Refuse a parent ``component`` of ``path`` that is a symlink or not a directory (the stat header)."""
    mode = _stat(header, f"{component!r} of {path!r}")[0]
    if mode & _GO_SYMLINK or not mode & _GO_DIR:
        raise SandboxPathError(
            f"a component of {path!r}, {component!r}, is not a directory (a symlink?); transfers and snapshots "
            "never follow one: name a path through real directories"
        )


def tar_records(parts: Sequence[str], owner: tuple[int, int], size: int | None) -> list[bytes]:
    """Tar headers of the directories of ``parts[:-1]`` and of file ``parts`` of ``size`` bytes (its data
    follows, then ``padding(size)``); ``size=None``: of directories ``parts`` only. Without a known
    owner (root's), what is made is writable by all, so the sandbox's user can change it."""
    dir_mode, file_mode = (0o755, 0o644) if owner != (0, 0) else (0o777, 0o666)
    now = int(time.time())
    records = []
    for depth in range(1, len(parts) + (size is None)):
        records.append(_record("/".join(parts[:depth]) + "/", tarfile.DIRTYPE, 0, dir_mode, owner, now))
    if size is not None:
        records.append(_record("/".join(parts), tarfile.REGTYPE, size, file_mode, owner, now))
    return records


def _record(name: str, kind: bytes, size: int, mode: int, owner: tuple[int, int], mtime: int) -> bytes:
    info = tarfile.TarInfo(name)
    info.type, info.size, info.mode, info.mtime = kind, size, mode, mtime
    info.uid, info.gid = owner
    return info.tobuf(format=tarfile.PAX_FORMAT)


def padding(size: int) -> bytes:
    return b"\0" * ((-size) % _BLOCK)


END = b"\0" * (2 * _BLOCK)


async def tar_stream(source_fd: int, size: int, parts: Sequence[str], owner: tuple[int, int]) -> AsyncIterator[bytes]:
    """A tar of ``parts[:-1]`` as directories and ``parts[-1]`` as the ``size`` bytes read from ``source_fd``."""
    for record in tar_records(parts, owner, size):
        yield record
    sent = 0
    while sent < size:
        data = await anyio.to_thread.run_sync(os.read, source_fd, min(_CHUNK, size - sent))
        if not data:
            raise SandboxError(
                f"the source file shrank while it was uploaded ({sent} of {size} bytes); the copy in the sandbox may "
                "be partial: upload it again once nothing writes it"
            )
        sent += len(data)
        yield data
    yield padding(size) + END


class TarEntries:
    """The entries of a tar stream, read as its chunks arrive: each entry's header (``next``, with PAX
    and GNU long names and sizes applied), then its data (``data``). ``what`` names the stream in errors."""

    def __init__(self, chunks: AsyncIterator[bytes], what: str) -> None:
        self._chunks = chunks.__aiter__()
        self._what = what
        self._buffer = bytearray()
        self._data_left = 0  # of the current entry's data, unread
        self._padding_left = 0

    async def _more(self) -> bool:
        try:
            self._buffer += await self._chunks.__anext__()
        except StopAsyncIteration:
            return False
        return True

    async def _take(self, count: int) -> bytes:
        while len(self._buffer) < count:
            if not await self._more():
                raise SandboxError(
                    f"{self._what} ended early (the container went away?); nothing was copied: try again"
                )
        taken = bytes(self._buffer[:count])
        del self._buffer[:count]
        return taken

    async def next(self) -> tarfile.TarInfo | None:
        """The next entry's header, its data left to ``data`` (skipped if unread); None at the end."""
        async for _ in self.data():
            pass
        await self._take(self._padding_left)
        self._padding_left = 0
        extended: dict[str, str] = {}
        while True:
            if not self._buffer and not await self._more():
                return None  # no end-of-archive blocks: the stream's end is the archive's
            block = await self._take(_BLOCK)
            if block.count(0) == _BLOCK:
                return None
            try:
                info = tarfile.TarInfo.frombuf(block, "utf-8", "surrogateescape")
            except tarfile.HeaderError as exc:
                raise SandboxError(f"{self._what} is not a tar: {exc}") from exc
            if info.type not in (tarfile.XHDTYPE, tarfile.XGLTYPE, tarfile.GNUTYPE_LONGNAME, tarfile.GNUTYPE_LONGLINK):
                break
            if info.size > 1 << 20:
                raise SandboxError(f"{self._what} has an oversized extended header")
            data = (await self._take(info.size + (-info.size) % _BLOCK))[: info.size]
            if info.type == tarfile.XHDTYPE:
                extended.update(_pax_records(data, self._what))
            elif info.type != tarfile.XGLTYPE:
                key = "path" if info.type == tarfile.GNUTYPE_LONGNAME else "linkpath"
                extended[key] = data.rstrip(b"\0").decode("utf-8", "surrogateescape")
        try:
            info.name = extended.get("path", info.name).rstrip("/") or info.name
            info.linkname = extended.get("linkpath", info.linkname)
            info.size = int(extended.get("size", info.size))
        except ValueError as exc:
            raise SandboxError(f"{self._what} has a PAX size that is not a number") from exc
        # As tarfile reads it: only regular files (and types it does not know) are followed by data.
        carries = info.isreg() or info.type not in tarfile.SUPPORTED_TYPES
        self._data_left = info.size if carries else 0
        self._padding_left = (-self._data_left) % _BLOCK
        return info

    async def data(self) -> AsyncIterator[bytes]:
        """The current entry's data, in the pieces it arrives in."""
        while self._data_left:
            if not self._buffer and not await self._more():
                raise SandboxError(
                    f"{self._what} ended early (the container went away?); nothing was copied: try again"
                )
            piece = bytes(self._buffer[: self._data_left])
            del self._buffer[: len(piece)]
            self._data_left -= len(piece)
            yield piece


_EXTENDED = frozenset(b"xgLK")  # PAX and GNU long-name headers: they apply to the entry that follows
_DROPPED = frozenset(b"34")  # devices: a snapshot keeps none
_PASSED = frozenset(b"\x00012567")  # regular (old and new spellings), links, directories, FIFOs, contiguous
_CARRYING = frozenset(b"\x0007")  # the kinds followed by data: regular files (links, directories, FIFOs: none)
_OWNERS = frozenset({"uid", "gid", "uname", "gname"})


def _number(field: bytes | bytearray) -> int:
    """A tar header's numeric field: octal digits, or GNU's base-256 (its first byte's top bit set)."""
    if field[0] & 0x80:
        return int.from_bytes(field[1:], "big")
    digits = bytes(field).split(b"\0", 1)[0].strip()
    return int(digits or b"0", 8)


def _id_field(value: int) -> bytes:
    """``value`` as a tar header's 8-byte uid or gid: octal where it fits, else base-256 (uids of the host pool)."""
    return b"%07o\0" % value if value < 0o7777777 else b"\x80" + value.to_bytes(7, "big")


async def owned_stream(
    chunks: AsyncIterator[bytes], owner: tuple[int, int], what: str, batch: int = _CHUNK
) -> AsyncIterator[bytes]:
    """The tar stream ``chunks`` (the daemon's archive of a directory asked as ``<dir>/.``) passed on as it
    is, each entry's owner made ``owner`` (its numeric ids; its names cleared) and its checksum redone: a
    pass over the headers only, the data not parsed (``TarEntries`` costs that per byte). The root entry
    (``./``, Docker's; Podman sends none) and devices are left out, with the extended headers before
    them; an entry of another kind, or an extended header naming an owner, is ``SandboxError``. Sent in
    pieces of about ``batch`` bytes, then the end-of-archive blocks."""
    uid, gid = _id_field(owner[0]), _id_field(owner[1])
    out = bytearray()
    header = bytearray()  # the next header's bytes, as they arrive
    held = bytearray()  # extended headers and their data, waiting for the entry they apply to
    pax = bytearray()  # the data of the PAX header being read
    left = 0  # bytes of the current entry's data and padding still to come
    target: bytearray | None = out  # where they go: out, held (an extended header's), None (left out)
    reading_pax = False
    size: int | None = None  # a PAX size, for the entry that follows
    ended = False
    async for chunk in chunks:
        position, length = 0, len(chunk)
        view = memoryview(chunk)
        while position < length and not ended:
            if left:
                taken = min(left, length - position)
                piece = view[position : position + taken]
                if target is not None:
                    target += piece
                if reading_pax:
                    pax += piece
                position += taken
                left -= taken
                if not left and reading_pax:
                    size = _pax_size(bytes(pax), what, size)
                    pax.clear()
                    reading_pax = False
                continue
            taken = min(_BLOCK - len(header), length - position)
            header += view[position : position + taken]
            position += taken
            if len(header) < _BLOCK:
                break
            block, header = header, bytearray()
            if block.count(0) == _BLOCK:
                ended = True
                break
            kind = block[156]
            carried = _number(block[124:136])
            if kind in _EXTENDED:
                if carried > 1 << 20:
                    raise SandboxError(f"{what} has an oversized extended header")
                held += block
                left, target, reading_pax = carried + (-carried) % _BLOCK, held, kind == ord("x")
                continue
            name = bytes(block[:100]).split(b"\0", 1)[0]
            if kind in _DROPPED or (name in (b"./", b".") and not block[345]):  # a device, the root
                target = None
            elif kind in _PASSED:
                block[108:116], block[116:124] = uid, gid
                block[265:297] = block[297:329] = bytes(32)
                block[148:156] = b" " * 8
                block[148:156] = b"%06o\0 " % sum(block)
                out += held
                out += block
                target = out
            else:
                raise SandboxError(f"{what} has an entry of a kind a snapshot cannot keep ({chr(kind)!r})")
            carried = carried if size is None else size
            left = carried + (-carried) % _BLOCK if kind in _CARRYING else 0
            held.clear()
            size = None
        if len(out) >= batch:
            yield bytes(out)
            out.clear()
    if left or header or held:
        raise SandboxError(f"{what} ended early (the container went away?); nothing was copied: try again")
    yield bytes(out + END)


def _pax_size(data: bytes, what: str, size: int | None) -> int | None:
    """The size a PAX header's records give the entry that follows (else ``size``); records naming an
    owner are refused (the entry's owner is the one given, and a record would override it)."""
    records = _pax_records(data.rstrip(b"\0"), what)
    if _OWNERS & records.keys():
        raise SandboxError(f"{what} has an extended header naming an owner; nothing was copied")
    try:
        return int(records["size"]) if "size" in records else size
    except ValueError as exc:
        raise SandboxError(f"{what} has a PAX size that is not a number") from exc


def _pax_records(data: bytes, what: str) -> dict[str, str]:
    """The ``key=value`` records of a PAX extended header (``LENGTH key=value`` and a newline each)."""
    records: dict[str, str] = {}
    position = 0
    try:
        while position < len(data):
            space = data.index(b" ", position)
            length = int(data[position:space])
            if length <= space - position:
                raise ValueError(length)
            key, _, value = data[space + 1 : position + length - 1].partition(b"=")
            records[key.decode("utf-8", "surrogateescape")] = value.decode("utf-8", "surrogateescape")
            position += length
    except ValueError as exc:
        raise SandboxError(f"{what} has a malformed PAX header") from exc
    return records


class TarReader:
    """Reads the one regular file of a download's tar stream into ``target``, at most ``limit`` bytes."""

    def __init__(self, path: str, target: Path, limit: int) -> None:
        self._path, self._target, self._limit = path, target, limit

    async def read(self, chunks: AsyncIterator[bytes]) -> None:
        entries = TarEntries(chunks, f"the daemon's archive of {self._path!r}")
        info = await entries.next()
        if info is None:
            raise SandboxError(
                f"the daemon's archive of {self._path!r} ended early (the container went away?); nothing was "
                "copied: try again"
            )
        if info.type == tarfile.SYMTYPE or info.type == tarfile.LNKTYPE:
            raise SandboxPathError(f"path {self._path!r} is a symlink (it was swapped for one); nothing was copied")
        if info.type not in (tarfile.REGTYPE, tarfile.AREGTYPE):
            raise SandboxError(f"{self._path!r} is not a file in the sandbox (it was swapped for a directory?)")
        if info.size > self._limit:
            raise SandboxTransferLimitError(
                f"{self._path!r} grew past max_transfer_bytes={self._limit} before it was copied; nothing was copied"
            )
        fd = await anyio.to_thread.run_sync(self._open_target)
        try:
            async for part in entries.data():
                await anyio.to_thread.run_sync(_write_all, fd, part)
        except BaseException as exc:
            os.close(fd)
            self._target.unlink(missing_ok=True)  # a regular file of ours (_open_target): no half-written copy
            if isinstance(exc, OSError):
                raise SandboxError(f"cannot write the download of {self._path!r} to {self._target}: {exc}") from exc
            raise
        os.close(fd)

    def _open_target(self) -> int:
        """The download's target, created or truncated; a target that is not a regular file (a
        directory, a device, a FIFO) is refused before it is written or removed."""
        try:
            self._target.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self._target, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC | os.O_NONBLOCK, 0o644)
        except OSError as exc:
            raise SandboxError(
                f"cannot write the download of {self._path!r} to {self._target}: {exc}; name a writable file path"
            ) from exc
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise SandboxError(
                f"download target {self._target} is not a regular file (a directory, device or FIFO); nothing was "
                "written: name a file path"
            )
        try:
            os.set_blocking(fd, True)
            os.ftruncate(fd, 0)
        except OSError as exc:
            os.close(fd)
            raise SandboxError(f"cannot write the download of {self._path!r} to {self._target}: {exc}") from exc
        return fd


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]
