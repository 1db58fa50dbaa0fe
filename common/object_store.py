"""The snapshot store's transport (``--snapshot-store URI``, :class:`ObjectStore`): objects put whole or written in
order, byte ranges read, keys listed. ``s3://bucket/prefix`` goes through obstore (chosen over s3fs:
docs/benchmarks.md); a path or ``file://`` path on a filesystem every host mounts is written by hand, so that a reader
on another host sees an object only whole. A missing object raises ``FileNotFoundError``; every other failure, an
unreachable store included (never taken for an empty one), an ``OSError`` naming the store and the key.
"""

from __future__ import annotations

import abc
import contextlib
import dataclasses
import datetime
import os
import pathlib
import secrets
from collections.abc import Callable, Iterable, Iterator
from typing import Any
from urllib.parse import urlparse

from .errors import ConfigError

__all__ = ["STORE_TIMEOUT_S", "ObjectInfo", "ObjectStore", "ObjectWriter", "PosixObjectStore", "S3ObjectStore",
           "open_store", "read_range", "fsync_dir", "STORE_FLAG"]

STORE_TIMEOUT_S = 60.0
"""Seconds one request to a store may take, retries included, unless told otherwise."""

STORE_FLAG = "--snapshot-store"
_TMP_MARK = ".tmp-"


@dataclasses.dataclass(frozen=True)
class ObjectInfo:
    key: str
    """Its key relative to the store's root (``/``-separated)."""
    size: int
    version: str = ""
    """Changes whenever the object is put again (an ETag; a file's inode and mtime)."""


class ObjectWriter(abc.ABC):
    """One object being put, its bytes written in order (bounded memory): visible only once
    :meth:`commit` returned; after :meth:`abort` (or a failed commit) nothing is."""

    @abc.abstractmethod
    def write(self, data: bytes | memoryview) -> None:
        """The object's next bytes (``data`` may be reused once this returns)."""

    @abc.abstractmethod
    def commit(self) -> None:
        """Make the object visible, whole."""

    @abc.abstractmethod
    def abort(self) -> None:
        """Abandon the object (idempotent; nothing becomes visible)."""


class ObjectStore(abc.ABC):
    """Whole objects under a root. Thread-safe. Keys are ``/``-separated, relative."""

    uri: str  # the store as the user named it (messages name it)

    @abc.abstractmethod
    def open_writer(self, key: str) -> ObjectWriter:
        """A new object ``key``, written in order; it replaces an existing one at its commit."""

    def put(self, key: str, chunks: bytes | Iterable[bytes | memoryview]) -> None:
        """Store ``chunks`` (bytes, or pieces concatenated) under ``key``, visible only once whole;
        an exception from the iterable aborts the put."""
        self._fill(self.open_writer(key), (chunks,) if isinstance(chunks, bytes) else chunks)

    @staticmethod
    def _fill(writer: ObjectWriter, chunks: Iterable[bytes | memoryview]) -> None:
        try:
            for chunk in chunks:
                writer.write(chunk)
            writer.commit()
        except BaseException:
            writer.abort()
            raise

    @abc.abstractmethod
    def create(self, key: str, data: bytes) -> bool:
        """Store ``data`` under ``key`` only if no object is there: whether this call made it (of
        racing hosts exactly one wins). OSError where the store cannot (no conditional writes)."""

    @abc.abstractmethod
    def get_range(self, key: str, offset: int, nbytes: int) -> bytes:
        """``nbytes`` of ``key`` from ``offset`` (fewer only at the object's end)."""

    @abc.abstractmethod
    def size(self, key: str) -> int | None:
        """The object's size; None when there is none."""

    @abc.abstractmethod
    def list(self, prefix: str) -> list[ObjectInfo]:
        """Every object whose key starts with ``prefix`` (a folder ends with ``/``)."""

    @abc.abstractmethod
    def list_folders(self, prefix: str) -> list[str]:
        """The names of the folders right under ``prefix`` (``""`` or ending with ``/``), sorted."""

    @abc.abstractmethod
    def delete(self, key: str) -> None:
        """Remove ``key``; no error when it is already gone."""

    def get(self, key: str) -> bytes:
        size = self.size(key)
        if size is None:
            raise FileNotFoundError(f"{self.describe(key)} does not exist")
        return self.get_range(key, 0, size)

    def local_path(self, key: str) -> pathlib.Path | None:
        """Where the object is on this host's filesystem (a reader may map it); None: only :meth:`get_range` reads it."""
        return None

    def create_root(self) -> None:
        """Make the store's root where it has one to make (a writer, at start); from then on a
        missing root is an unreachable store. Nothing for a bucket."""

    def describe(self, key: str) -> str:
        return self.uri.rstrip("/") + "/" + key


class PosixObjectStore(ObjectStore):
    """A directory on a filesystem every host mounts; a reader on any host sees the whole object
    or none. Leftover temporaries (``.tmp-``) of a killed writer are never listed."""

    def __init__(self, root: str | os.PathLike[str], uri: str | None = None):
        self.root = pathlib.Path(os.path.abspath(root))
        self.uri = uri or str(self.root)

    def create_root(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)

    def _check_root(self) -> None:
        """OSError (not FileNotFoundError: no object is missing) when the root is no directory."""
        if not self.root.is_dir():
            what = "is not a directory" if self.root.exists() else "does not exist"
            raise OSError(f"the store {self.uri} is unreachable: its root {self.root} {what} (a filesystem "
                          f"not mounted, or removed? the server makes it at start; check {STORE_FLAG})")

    def _path(self, key: str) -> pathlib.Path:
        parts = key.split("/")
        if not key or any(p in ("", ".", "..") for p in parts):
            raise ValueError(f"store key {key!r} is not a plain relative key")
        return self.root.joinpath(*parts)

    def open_writer(self, key: str) -> ObjectWriter:
        return self._writer(key, os.replace)

    def create(self, key: str, data: bytes) -> bool:
        try:
            self._fill(self._writer(key, os.link), (data,))  # a link fails where a name exists: one creator wins
        except FileExistsError:
            return False
        return True

    def _writer(self, key: str, publish: Callable[[pathlib.Path, pathlib.Path], None]) -> ObjectWriter:
        path = self._path(key)
        self._check_root()  # never a new root on the disk under an unmounted filesystem
        path.parent.mkdir(parents=True, exist_ok=True)
        return _PosixWriter(path, publish, self._prune)

    def get_range(self, key: str, offset: int, nbytes: int) -> bytes:
        try:
            return read_range(self._path(key), offset, nbytes)
        except (FileNotFoundError, NotADirectoryError):
            self._check_root()  # an object is missing only from a store that is there
            raise

    def local_path(self, key: str) -> pathlib.Path:
        return self._path(key)

    def size(self, key: str) -> int | None:
        try:
            return os.stat(self._path(key)).st_size
        except (FileNotFoundError, NotADirectoryError):
            self._check_root()
            return None

    def list(self, prefix: str) -> list[ObjectInfo]:
        self._check_root()  # os.walk would take a missing root for an empty one
        folder = prefix.rpartition("/")[0]
        base = self._path(folder) if folder else self.root
        found: list[ObjectInfo] = []
        for directory, _dirs, files in os.walk(base):
            rel = os.path.relpath(directory, self.root)
            for name in files:
                key = name if rel == "." else f"{rel}/{name}".replace(os.sep, "/")
                if _TMP_MARK in name or not key.startswith(prefix):
                    continue
                try:
                    stat = os.stat(os.path.join(directory, name))
                except FileNotFoundError:
                    continue  # removed while listing
                found.append(ObjectInfo(key, stat.st_size, f"{stat.st_ino}-{stat.st_mtime_ns}"))
        return sorted(found, key=lambda info: info.key)

    def list_folders(self, prefix: str) -> list[str]:
        self._check_root()
        base = self._path(prefix.rstrip("/")) if prefix else self.root
        try:
            return sorted(entry.name for entry in os.scandir(base) if entry.is_dir(follow_symlinks=False))
        except (FileNotFoundError, NotADirectoryError):
            return []

    def delete(self, key: str) -> None:
        path = self._path(key)
        path.unlink(missing_ok=True)
        self._prune(path.parent)

    def _prune(self, parent: pathlib.Path) -> None:
        """Empty folders left behind are harmless but untidy: removed up to the root."""
        while parent != self.root and self.root in parent.parents:
            try:
                parent.rmdir()
            except OSError:
                break
            parent = parent.parent


class _PosixWriter(ObjectWriter):
    """A temporary file beside ``path``, fsynced at commit, then ``publish(temporary, path)``
    (a rename; a link to create only) and the folder fsynced."""

    def __init__(self, path: pathlib.Path, publish: Callable[[pathlib.Path, pathlib.Path], None],
                 prune: Callable[[pathlib.Path], None]):
        self._path, self._publish, self._prune = path, publish, prune
        self._tmp = path.with_name(path.name + _TMP_MARK + secrets.token_hex(4))
        self._fd: int | None = os.open(self._tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)

    def write(self, data: bytes | memoryview) -> None:
        view = memoryview(data)
        while view.nbytes:
            view = view[os.write(self._fd, view):]  # type: ignore[arg-type]

    def commit(self) -> None:
        os.fsync(self._fd)  # type: ignore[arg-type]
        self._close()
        self._publish(self._tmp, self._path)
        self._tmp.unlink(missing_ok=True)  # a link leaves it as a second name
        fsync_dir(self._path.parent)

    def abort(self) -> None:
        self._close()
        self._tmp.unlink(missing_ok=True)
        self._prune(self._path.parent)

    def _close(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)


class S3ObjectStore(ObjectStore):
    """``s3://bucket/prefix`` through obstore, from the AWS environment (a plain-http endpoint is
    allowed as given). Every request is bounded: ``timeout_s``, a few retries within it."""

    def __init__(self, uri: str, timeout_s: float = STORE_TIMEOUT_S):
        import obstore  # the one place it is imported: a server without a store never needs it
        from obstore.store import S3Store

        self.uri = uri
        self._obs = obstore
        endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or ""
        client_options = {"allow_http": endpoint.startswith("http://"), "timeout": f"{max(1, int(timeout_s))}s",
                          "connect_timeout": f"{max(1, int(min(timeout_s, 10)))}s"}
        backoff = {"init_backoff": datetime.timedelta(milliseconds=100), "max_backoff": datetime.timedelta(seconds=5),
                   "base": 2}
        retry = {"max_retries": 3, "retry_timeout": datetime.timedelta(seconds=timeout_s), "backoff": backoff}
        try:
            self._store = S3Store.from_url(uri, client_options=client_options, retry_config=retry)
        except Exception as exc:  # obstore raises its own config errors
            raise ConfigError(f"{STORE_FLAG} {uri}: {exc}") from exc

    def put(self, key: str, chunks: bytes | Iterable[bytes | memoryview]) -> None:
        if not isinstance(chunks, bytes):
            super().put(key, chunks)
            return
        with self._errors(key):
            self._obs.put(self._store, key, chunks)  # small: one request

    def open_writer(self, key: str) -> ObjectWriter:
        # A multipart upload with parts in flight once past one buffer, completed at commit.
        with self._errors(key):
            file = self._obs.open_writer(self._store, key, buffer_size=8 << 20, max_concurrency=8)
        return _S3Writer(file, lambda: self._errors(key))

    def create(self, key: str, data: bytes) -> bool:
        try:
            with self._errors(key):
                self._obs.put(self._store, key, data, mode="create")  # If-None-Match: *
        except FileExistsError:
            return False
        return True

    def get_range(self, key: str, offset: int, nbytes: int) -> bytes:
        if nbytes <= 0:
            return b""
        with self._errors(key):
            end = min(self._obs.head(self._store, key)["size"], offset + nbytes)
            if end <= offset:
                return b""
            return bytes(self._obs.get_range(self._store, key, start=offset, end=end))

    def size(self, key: str) -> int | None:
        try:
            with self._errors(key):
                return int(self._obs.head(self._store, key)["size"])
        except FileNotFoundError:
            return None

    def list(self, prefix: str) -> list[ObjectInfo]:
        with self._errors(prefix):
            found = [ObjectInfo(m["path"], int(m["size"]), str(m.get("e_tag") or ""))
                     for batch in self._obs.list(self._store, prefix=prefix or None) for m in batch]
        return sorted((i for i in found if i.key.startswith(prefix)), key=lambda i: i.key)

    def get(self, key: str) -> bytes:
        with self._errors(key):  # one request (a missing object: FileNotFoundError)
            return bytes(self._obs.get(self._store, key).bytes())

    def list_folders(self, prefix: str) -> list[str]:
        with self._errors(prefix):
            listed = self._obs.list_with_delimiter(self._store, prefix or None)
        names = (folder.rstrip("/")[len(prefix):] for folder in listed["common_prefixes"])
        return sorted(name for name in names if name and "/" not in name)

    def delete(self, key: str) -> None:
        with contextlib.suppress(FileNotFoundError), self._errors(key):
            self._obs.delete(self._store, key)

    @contextlib.contextmanager
    def _errors(self, key: str) -> Iterator[None]:
        """Re-raises obstore's exceptions as ``OSError`` (``FileNotFoundError`` for a missing
        object) naming the store and the key, with obstore's first line (HTTP status, endpoint)."""
        try:
            yield
        except Exception as error:
            where = self.describe(key)
            if isinstance(error, FileNotFoundError):
                raise FileNotFoundError(f"{where} does not exist") from error
            if type(error).__name__ in ("AlreadyExistsError", "PreconditionError"):  # obstore's, for create
                raise FileExistsError(f"{where} exists") from error
            text = str(error).strip()
            raise OSError(f"{where}: {text.splitlines()[0] if text else type(error).__name__}") from error


class _S3Writer(ObjectWriter):
    """obstore's writer: it completes the upload only at close; left by an exception (abort) it
    abandons it, and nothing becomes visible."""

    def __init__(self, file: Any, errors: Callable[[], contextlib.AbstractContextManager[None]]):
        self._file: Any = file
        self._errors = errors  # the store's error mapping, naming the object

    def write(self, data: bytes | memoryview) -> None:
        with self._errors():
            self._file.write(data)

    def commit(self) -> None:
        file, self._file = self._file, None
        with self._errors():
            file.close()

    def abort(self) -> None:
        file, self._file = self._file, None
        if file is not None:
            with contextlib.suppress(Exception):
                file.__exit__(OSError, OSError("abandoned"), None)


def read_range(path: str | os.PathLike[str], offset: int, nbytes: int) -> bytes:
    """``nbytes`` of a file from ``offset`` (fewer only at its end)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        parts: list[bytes] = []
        while nbytes > 0:
            data = os.pread(fd, nbytes, offset)
            if not data:
                break
            parts.append(data)
            offset += len(data)
            nbytes -= len(data)
        return b"".join(parts)
    finally:
        os.close(fd)


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """Make the directory's entries (created, renamed, removed names) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def open_store(uri: str, timeout_s: float = STORE_TIMEOUT_S) -> ObjectStore:
    """The store ``uri`` names; ConfigError naming ``--snapshot-store`` for anything else."""
    parsed = urlparse(uri)
    if parsed.scheme == "s3":
        if not parsed.netloc:
            raise ConfigError(f"{STORE_FLAG} {uri!r} names no bucket: use s3://BUCKET/PREFIX")
        return S3ObjectStore(uri, timeout_s)
    if parsed.scheme == "file":
        if parsed.netloc not in ("", "localhost"):
            raise ConfigError(f"{STORE_FLAG} {uri!r}: a file:// URI has no host (file:///path)")
        return PosixObjectStore(parsed.path, uri)
    if parsed.scheme == "" and uri:
        return PosixObjectStore(uri)
    raise ConfigError(f"{STORE_FLAG} {uri!r}: expected s3://BUCKET/PREFIX, file:///PATH or a path on a filesystem "
                      "every host mounts")
