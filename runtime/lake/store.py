"""Where the output lives: a local directory or an object store, behind one small port.

:func:`open_store` takes the output's URI — ``s3://bucket/prefix``, ``gs://bucket/prefix``,
``file:///path`` or a plain path — and returns a :class:`Store`: a ``pyarrow.fs`` file system,
the base path in it and the URI, with the few operations a committer needs (read bytes, write
bytes atomically, create if absent, list, delete, exists, an output stream for parquet).

**Atomic writes.** Locally a write goes to a temporary file in the same directory, is fsynced
and renamed into place (and the directory fsynced). On an object store a whole object appears
at once: a single PUT, or the completion of a multipart upload, which is what pyarrow's output
stream ends with; a process killed in the middle leaves no object (an S3 multipart upload left
incomplete is invisible; a bucket lifecycle rule ``AbortIncompleteMultipartUpload`` reclaims
its parts). Object stores cannot rename: :attr:`Store.can_rename` is false there.

**Create if absent** (:meth:`Store.create_if_absent`): locally a hard link of a complete
temporary file (fails if the name exists); on S3 a conditional PUT with ``If-None-Match: *``
(AWS S3 honours it since August 2024; moto's server does too), sent through boto3, which is
optional: without it, or on GCS (pyarrow has no conditional write), the store says it cannot
(:attr:`Store.supports_create_if_absent`).

**Credentials** come only from the standard chains, in every process that opens the store
(the shoal process, Spark executors): for S3 the ``AWS_*`` environment variables, the shared
config and credentials files, the instance or container role (pyarrow and boto3 use the AWS
SDK chain); for GCS Google's application default credentials. S3-compatible servers are
reached through ``AWS_ENDPOINT_URL_S3`` or ``AWS_ENDPOINT_URL``, the region comes from
``AWS_REGION`` or ``AWS_DEFAULT_REGION``. Nothing here copies a credential into an argument,
a pickle, a message or a log line: :meth:`Store.describe` names where credentials come from,
never their values, and :meth:`Store.storage_options` hands delta-rs only the endpoint and
region (delta-rs reads the credentials from the same environment). :meth:`Store.secret_values`
lists the credential values in the environment, for a log formatter that masks them.

**Errors** name the option that gave the URI (``run.output_dir`` unless told otherwise):
a bad URI at :func:`open_store`, a store that cannot be written (no bucket, no permission, no
server) at :meth:`Store.check`, which writes, reads back and deletes a probe object and is
meant to run once at start.
"""

from __future__ import annotations

import contextlib
import os
import threading
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final, Literal
from urllib.parse import urlsplit

import pyarrow as pa
import pyarrow.fs as pafs

from runtime.logs import mask

__all__ = [
    "DEFAULT_OPTION",
    "Entry",
    "Store",
    "StoreError",
    "StoreUnsupported",
    "open_store",
]

DEFAULT_OPTION: Final = "run.output_dir"
PROBE_DIR: Final = "_shoal/probe"

Kind = Literal["file", "s3", "gs"]

# Environment variables that hold credential values (masked in logs, never shown).
_SECRET_ENV: Final = (
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_SECURITY_TOKEN",
    "GOOGLE_SERVICE_ACCOUNT_KEY",
)


class StoreError(ValueError):
    """A bad output URI, or a store that cannot be used; the message names the option."""


class StoreUnsupported(StoreError):
    """The store cannot do this operation (a rename on an object store, a conditional write
    without boto3 or on GCS)."""


@dataclass(frozen=True, slots=True)
class Entry:
    """A file under a store: ``path`` relative to the store's root (``/``-separated)."""

    path: str
    size: int
    mtime: float | None  # seconds since the epoch, if the store says


def _env_get(env: Mapping[str, str], *names: str) -> str | None:
    for name in names:
        value = env.get(name)
        if value:
            return value
    return None


def open_store(
    uri: str | os.PathLike[str],
    *,
    option: str = DEFAULT_OPTION,
    env: Mapping[str, str] | None = None,
) -> Store:
    """The :class:`Store` of ``uri`` (``s3://bucket/prefix``, ``gs://bucket/prefix``,
    ``file:///path`` or a plain path). ``option`` names the setting the URI came from, for the
    error messages; ``env`` is the environment to read the endpoint and region from (default:
    this process's). Raises :class:`StoreError` for a URI it cannot use. Contacts nothing:
    :meth:`Store.check` does."""
    env = os.environ if env is None else env
    text = os.fspath(uri)
    if not text:
        raise StoreError(f"{option} is empty: give a directory or an s3://, gs:// or file:// URI")
    if "://" not in text:
        return Store("file", os.path.abspath(text), option=option)
    parts = urlsplit(text)
    scheme = parts.scheme.lower()
    where = f"{option} ({scheme}://{parts.hostname or ''}{parts.path})"
    if parts.username is not None or parts.password is not None:
        # the URI is not repeated whole: it may hold a secret
        raise StoreError(
            f"{where}: credentials in the URI are not accepted; they come from the "
            "environment's credential chain (AWS_* variables, ~/.aws, an instance role; "
            "Google application default credentials)"
        )
    if parts.query or parts.fragment:
        raise StoreError(
            f"{option} ({text}): query parameters are not supported; set the endpoint with "
            "AWS_ENDPOINT_URL and the region with AWS_REGION"
        )
    if scheme == "file":
        if parts.netloc not in ("", "localhost"):
            raise StoreError(f"{option} ({text}): a file:// URI names no host (file:///path)")
        if not parts.path.startswith("/"):
            raise StoreError(f"{option} ({text}): a file:// URI needs an absolute path")
        return Store("file", os.path.normpath(parts.path), option=option)
    if scheme in ("s3", "s3a"):
        kind: Kind = "s3"
    elif scheme in ("gs", "gcs"):
        kind = "gs"
    else:
        raise StoreError(
            f"{option} ({text}): scheme {scheme!r} is not supported; use a directory, "
            "file:///path, s3://bucket/prefix or gs://bucket/prefix"
        )
    bucket = parts.netloc
    if not bucket:
        raise StoreError(f"{where}: no bucket; write {kind}://bucket/prefix")
    prefix = "/".join(p for p in parts.path.split("/") if p)
    if any(p in (".", "..") for p in prefix.split("/")):
        raise StoreError(f"{where}: '.' and '..' are not allowed in an object store prefix")
    base = f"{bucket}/{prefix}" if prefix else bucket
    if kind == "s3":
        endpoint = _env_get(env, "AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL")
        region = _env_get(env, "AWS_REGION", "AWS_DEFAULT_REGION")
        if endpoint is not None:
            ep = urlsplit(endpoint)
            if ep.scheme not in ("http", "https") or not ep.netloc:
                raise StoreError(
                    f"{where}: AWS_ENDPOINT_URL must be http(s)://host[:port], not {endpoint!r}"
                )
        return Store("s3", base, option=option, endpoint=endpoint, region=region)
    return Store("gs", base, option=option)


def _reopen(kind: Kind, base: str, option: str, endpoint: str | None, region: str | None) -> Store:
    return Store(kind, base, option=option, endpoint=endpoint, region=region)


class Store:
    """A directory in a local file system or an object store; see the module docstring.
    Relative paths (``rel``) are ``/``-separated and relative to the store's root. Thread-safe;
    pickles without credentials (the unpickling process reads its own chain)."""

    def __init__(
        self,
        kind: Kind,
        base: str,
        *,
        option: str = DEFAULT_OPTION,
        endpoint: str | None = None,
        region: str | None = None,
    ) -> None:
        self.kind: Kind = kind
        self.base = base.rstrip("/") if kind != "file" else base
        self.option = option
        self.endpoint = endpoint
        self.region = region
        self.fs: Any
        if kind == "file":
            self.uri = "file://" + base
            self.fs = pafs.LocalFileSystem()
        elif kind == "s3":
            self.uri = f"s3://{self.base}"
            # delayed open: a small object is one PUT at close instead of a multipart upload
            # (three requests); either way it appears whole or not at all
            kwargs: dict[str, Any] = {"allow_delayed_open": True}
            if endpoint is not None:
                ep = urlsplit(endpoint)
                kwargs["endpoint_override"] = ep.netloc
                kwargs["scheme"] = ep.scheme
            if region is not None:
                kwargs["region"] = region
            self.fs = pafs.S3FileSystem(**kwargs)
        else:
            self.uri = f"gs://{self.base}"
            self.fs = pafs.GcsFileSystem()
        self._boto: Any = None
        self._boto_lock = threading.Lock()

    def __reduce__(self) -> tuple[Any, ...]:
        return (_reopen, (self.kind, self.base, self.option, self.endpoint, self.region))

    def __repr__(self) -> str:
        return f"Store({self.describe()})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Store) and self.__reduce__() == other.__reduce__()

    def __hash__(self) -> int:
        return hash(self.__reduce__()[1])

    # --- naming -----------------------------------------------------------------------------

    @property
    def is_local(self) -> bool:
        return self.kind == "file"

    @property
    def can_rename(self) -> bool:
        """Whether :meth:`rename` is atomic here (a local file system only)."""
        return self.kind == "file"

    def path(self, rel: str = "") -> str:
        """The path of ``rel`` in :attr:`fs`."""
        rel = rel.strip("/")
        if not rel:
            return self.base
        return f"{self.base}/{rel}" if self.base != "/" else f"/{rel}"

    def uri_for(self, rel: str = "") -> str:
        """``rel`` as delta-rs and Spark name it: an absolute path locally, else a URI."""
        if self.kind == "file":
            return self.path(rel)
        return f"{self.kind}://{self.path(rel)}"

    def child(self, rel: str) -> Store:
        """The store rooted at ``rel``."""
        return Store(
            self.kind,
            self.path(rel),
            option=self.option,
            endpoint=self.endpoint,
            region=self.region,
        )

    def describe(self) -> str:
        """One line for logs and status: the URI, the endpoint and region, and where the
        credentials come from — never a credential value."""
        if self.kind == "file":
            return self.uri
        parts = [self.uri]
        if self.kind == "s3":
            if self.endpoint is not None:
                parts.append(f"endpoint {self.endpoint}")
            if self.region is not None:
                parts.append(f"region {self.region}")
            source = (
                "credentials from AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY"
                if os.environ.get("AWS_ACCESS_KEY_ID")
                else "credentials from the AWS credential chain"
            )
        else:
            source = (
                "credentials from GOOGLE_APPLICATION_CREDENTIALS"
                if os.environ.get("GOOGLE_APPLICATION_CREDENTIALS")
                else "Google application default credentials"
            )
        parts.append(source)
        return ", ".join(parts)

    def storage_options(self) -> dict[str, str]:
        """Options for delta-rs (object_store keys): the same endpoint and region as this store.
        No credential: delta-rs reads them from the same environment (``AWS_*``; for GCS
        ``GOOGLE_APPLICATION_CREDENTIALS`` or the application default credentials)."""
        options: dict[str, str] = {}
        if self.kind == "s3":
            if self.endpoint is not None:
                options["AWS_ENDPOINT_URL"] = self.endpoint
                if self.endpoint.startswith("http://"):
                    options["AWS_ALLOW_HTTP"] = "true"
            if self.region is not None:
                options["AWS_REGION"] = self.region
        return options

    @staticmethod
    def secret_values(env: Mapping[str, str] | None = None) -> tuple[str, ...]:
        """The credential values in ``env`` (default: this process's environment), for a log
        formatter to mask (:func:`runtime.logs.configure`)."""
        env = os.environ if env is None else env
        return tuple(v for k in _SECRET_ENV if (v := env.get(k)))

    def error(self, what: str, exc: BaseException) -> StoreError:
        """A :class:`StoreError` naming the option and the store, for ``exc`` (its text with
        any credential value masked)."""
        text = mask(str(exc), self.secret_values())
        return StoreError(f"{self.option} ({self.describe()}): {what}: {text}")

    # --- reading ----------------------------------------------------------------------------

    def read_bytes(self, rel: str) -> bytes | None:
        """The content of ``rel``, or None if there is no such file. On S3 with boto3 one GET
        (pyarrow asks for the object's size first: two)."""
        if self.kind == "s3" and self.supports_create_if_absent:
            return self._s3_get(self.path(rel))
        try:
            with self.fs.open_input_stream(self.path(rel)) as f:
                data: bytes = f.read()
        except FileNotFoundError:
            return None
        return data

    def exists(self, rel: str) -> bool:
        info = self.fs.get_file_info(self.path(rel))
        return bool(info.type != pafs.FileType.NotFound)

    def list_files(self, rel: str = "", *, recursive: bool = True) -> list[Entry]:
        """The files under ``rel`` (none if it does not exist), sorted by path."""
        selector = pafs.FileSelector(self.path(rel), recursive=recursive, allow_not_found=True)
        root = self.path()
        out = []
        for info in self.fs.get_file_info(selector):
            if info.type != pafs.FileType.File:
                continue
            path = info.path[len(root) :].lstrip("/") if info.path.startswith(root) else info.path
            mtime = info.mtime.timestamp() if info.mtime is not None else None
            out.append(Entry(path, int(info.size or 0), mtime))
        out.sort(key=lambda e: e.path)
        return out

    def list_dirs(self, rel: str = "") -> list[str]:
        """The names of the directories right under ``rel`` (on an object store: the common
        prefixes), sorted."""
        selector = pafs.FileSelector(self.path(rel), recursive=False, allow_not_found=True)
        return sorted(
            info.base_name
            for info in self.fs.get_file_info(selector)
            if info.type == pafs.FileType.Directory
        )

    def dir_mtimes(self, rel: str = "") -> list[tuple[str, float]]:
        """The directories right under ``rel`` with their modification times, sorted by name:
        locally the directory's own; on an object store (no directories) that of the newest
        file under it."""
        if self.kind == "file":
            out = []
            with contextlib.suppress(FileNotFoundError):
                for entry in os.scandir(self.path(rel)):
                    with contextlib.suppress(FileNotFoundError):
                        if entry.is_dir():
                            out.append((entry.name, entry.stat().st_mtime))
            return sorted(out)
        newest: dict[str, float] = {}
        prefix = rel.strip("/")
        for e in self.list_files(rel):
            name, _, below = e.path[len(prefix) :].lstrip("/").partition("/")
            if below:
                newest[name] = max(newest.get(name, 0.0), e.mtime or 0.0)
        return sorted(newest.items())

    def copy_tree(self, src: str, dst: str) -> int:
        """Copy every file under ``src`` to the same relative path under ``dst``, replacing
        what is there (server-side on an object store); the number of files."""
        files = self.list_files(src)
        root = src.strip("/")
        for e in files:
            target = f"{dst.strip('/')}/{e.path[len(root) :].lstrip('/')}"
            self._makedirs(target)
            self.fs.copy_file(self.path(e.path), self.path(target))
        return len(files)

    def open_input_file(self, rel: str) -> Any:
        """A random-access ``pyarrow.NativeFile`` of ``rel`` (for reading parquet)."""
        return self.fs.open_input_file(self.path(rel))

    # --- writing ----------------------------------------------------------------------------

    def _makedirs(self, rel: str) -> None:
        if self.kind == "file":
            os.makedirs(os.path.dirname(self.path(rel)), exist_ok=True)

    def open_output_stream(self, rel: str) -> Any:
        """A ``pyarrow.NativeFile`` writing ``rel`` (parent directories made). On an object
        store the object appears whole when the stream closes; locally the file is written in
        place (write under a name no reader looks at, then commit it)."""
        self._makedirs(rel)
        return self.fs.open_output_stream(self.path(rel))

    def write_bytes(self, rel: str, data: bytes, *, fsync: bool = True) -> None:
        """Write ``rel`` atomically: readers see the old content or ``data``, never a part."""
        if self.kind != "file":
            with self.fs.open_output_stream(self.path(rel)) as f:
                f.write(data)
            return
        path = self.path(rel)
        tmp = self._write_temp(path, data, fsync)
        os.replace(tmp, path)
        if fsync:
            _fsync_dir(os.path.dirname(path))

    def _write_temp(self, path: str, data: bytes, fsync: bool) -> str:
        directory, name = os.path.split(path)
        os.makedirs(directory, exist_ok=True)
        tmp = os.path.join(directory, f".{name}.{uuid.uuid4().hex[:8]}.tmp")
        with open(tmp, "wb") as f:
            f.write(data)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        return tmp

    @property
    def supports_create_if_absent(self) -> bool:
        """Whether :meth:`create_if_absent` works here: locally, and on S3 with boto3."""
        if self.kind == "file":
            return True
        if self.kind == "s3":
            try:
                import boto3  # noqa: F401
            except ImportError:
                return False
            return True
        return False

    def create_if_absent(self, rel: str, data: bytes, *, fsync: bool = True) -> bool:
        """Write ``rel`` whole unless it exists: True if this call created it, False if it was
        there. Raises :class:`StoreUnsupported` where the store cannot (see
        :attr:`supports_create_if_absent`)."""
        if self.kind == "file":
            path = self.path(rel)
            tmp = self._write_temp(path, data, fsync)
            try:
                os.link(tmp, path)
            except FileExistsError:
                return False
            finally:
                os.unlink(tmp)
            if fsync:
                _fsync_dir(os.path.dirname(path))
            return True
        if self.kind == "s3" and self.supports_create_if_absent:
            return self._s3_put_if_absent(self.path(rel), data)
        raise StoreUnsupported(
            f"{self.option} ({self.describe()}): this store cannot write only if absent"
            + (" (install boto3)" if self.kind == "s3" else " (pyarrow has no conditional write)")
        )

    def _s3_client(self) -> Any:
        with self._boto_lock:  # boto3 makes clients thread-unsafely; a client is thread-safe
            if self._boto is None:
                import boto3

                session = boto3.session.Session()
                self._boto = session.client(
                    "s3", endpoint_url=self.endpoint, region_name=self.region
                )
            return self._boto

    def _s3_put_if_absent(self, path: str, data: bytes) -> bool:
        import botocore.exceptions

        bucket, _, key = path.partition("/")
        for _ in range(5):
            try:
                self._s3_client().put_object(Bucket=bucket, Key=key, Body=data, IfNoneMatch="*")
            except botocore.exceptions.ClientError as exc:
                code = exc.response.get("Error", {}).get("Code")
                if code == "PreconditionFailed":
                    return False
                if code == "ConditionalRequestConflict":
                    continue  # a concurrent conditional write to the key in flight: ask again
                raise
            return True
        return False  # another writer kept the key busy: it was not this call that created it

    def rename(self, src: str, dst: str) -> None:
        """Rename ``src`` to ``dst`` atomically (a file or a directory); local only."""
        if self.kind != "file":
            raise StoreUnsupported(f"{self.option} ({self.uri}): an object store cannot rename")
        target = self.path(dst)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        os.rename(self.path(src), target)

    def delete(self, rel: str) -> None:
        """Delete the file ``rel``; nothing if it is not there. On S3 with boto3 this is one
        DELETE request (pyarrow's asks first whether the object is there, and after deleting
        it writes an empty marker object for its parent "directory": three requests); a store
        error is an ``OSError`` either way."""
        if self.kind == "s3" and self.supports_create_if_absent:
            self._s3_delete(self.path(rel))
            return
        with contextlib.suppress(FileNotFoundError):
            self.fs.delete_file(self.path(rel))

    def _s3_get(self, path: str) -> bytes | None:
        import botocore.exceptions

        bucket, _, key = path.partition("/")
        try:
            response = self._s3_client().get_object(Bucket=bucket, Key=key)
            data: bytes = response["Body"].read()
        except botocore.exceptions.ClientError as exc:
            if exc.response.get("Error", {}).get("Code") in ("NoSuchKey", "404"):
                return None
            raise OSError(f"reading s3://{path} failed: {exc}") from exc
        except botocore.exceptions.BotoCoreError as exc:
            raise OSError(f"reading s3://{path} failed: {exc}") from exc
        return data

    def _s3_delete_prefix(self, prefix: str) -> None:
        import botocore.exceptions

        bucket, _, key_prefix = prefix.partition("/")
        client = self._s3_client()
        try:
            for page in client.get_paginator("list_objects_v2").paginate(
                Bucket=bucket, Prefix=key_prefix
            ):
                keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
                if not keys:
                    continue
                answer = client.delete_objects(
                    Bucket=bucket, Delete={"Objects": keys, "Quiet": True}
                )
                if answer.get("Errors"):
                    first = answer["Errors"][0]
                    raise OSError(
                        f"deleting under s3://{prefix} failed for {len(answer['Errors'])} "
                        f"objects, e.g. {first.get('Key')}: {first.get('Code')} "
                        f"{first.get('Message')}"
                    )
        except (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError) as exc:
            raise OSError(f"deleting under s3://{prefix} failed: {exc}") from exc

    def _s3_delete(self, path: str) -> None:
        import botocore.exceptions

        bucket, _, key = path.partition("/")
        try:
            self._s3_client().delete_object(Bucket=bucket, Key=key)  # absent: 204 all the same
        except (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError) as exc:
            raise OSError(f"deleting s3://{path} failed: {exc}") from exc

    def delete_tree(self, rel: str) -> None:
        """Delete the directory ``rel`` and everything under it; nothing if it is not there.
        On S3 with boto3 a listing and one batch delete (pyarrow also asks first whether it
        is there and writes a marker object for its parent after)."""
        if self.kind == "s3" and self.supports_create_if_absent:
            self._s3_delete_prefix(self.path(rel).rstrip("/") + "/")
            return
        with contextlib.suppress(FileNotFoundError):
            self.fs.delete_dir(self.path(rel))

    # --- checks -----------------------------------------------------------------------------

    def check(self) -> None:
        """Blocking: write, read back and delete a probe object under ``_shoal/probe/``;
        raises :class:`StoreError` naming the option if the store cannot be used (no bucket,
        no permission, no server, no credentials)."""
        rel = f"{PROBE_DIR}/{uuid.uuid4().hex}"
        payload = b"shoal probe\n"
        try:
            self.write_bytes(rel, payload, fsync=False)
        except (OSError, pa.ArrowException) as exc:
            raise self.error("cannot write to the store", exc) from None
        try:
            back = self.read_bytes(rel)
            if back != payload:
                raise StoreError(
                    f"{self.option} ({self.describe()}): a probe object written to the store "
                    "did not read back the same"
                )
            self.delete(rel)
        except (OSError, pa.ArrowException) as exc:
            raise self.error("cannot read or delete in the store", exc) from None

    def probe_conditional_put(self) -> bool | None:
        """Blocking: whether this store refuses to overwrite an object written only if absent
        (what makes concurrent Delta commits safe: two writers of one log version cannot both
        win). True locally; on S3 tried with two conditional writes of a probe object (a store
        that ignores ``If-None-Match`` answers False); None where it cannot be tried (GCS, or
        S3 without boto3)."""
        if not self.supports_create_if_absent:
            return None
        if self.kind == "file":
            return True
        rel = f"{PROBE_DIR}/{uuid.uuid4().hex}.cas"
        try:
            first = self.create_if_absent(rel, b"1")
            second = self.create_if_absent(rel, b"2")
        except Exception as exc:
            raise self.error("a conditional write failed", exc) from None
        finally:
            self.delete(rel)
        return first and not second


def _fsync_dir(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
