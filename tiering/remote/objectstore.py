"""Object stores behind one small Protocol: S3 (boto3) and a ``file://`` directory that emulates it.

Only what the durable tier needs: immutable uploads (multipart for large files), conditional
writes (``If-None-Match: *`` to create, ``If-Match: <etag>`` to replace), listing, whole and
ranged downloads (a restore fetches one digest chunk per ranged GET and hashes and writes it piece
by piece as it arrives) and deletes. The file emulation gives conditional create through an
exclusive hard link and conditional replace under a lock, so the same protocol runs with no server
(``make demo``).
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import hashlib
import os
import shutil
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlparse

from tiering.errors import AccessDenied, ObjectNotFound, ObjectStoreError, PreconditionFailed, TransferInterrupted

# A ranged GET is consumed in pieces this size: each piece is hashed and written while it is still in
# the CPU's cache, and eight downloads in flight hold 8 MiB of buffers, not eight whole chunks.
RANGE_PIECE_BYTES = 1024 * 1024


@dataclass(frozen=True)
class ObjectInfo:
    key: str
    size: int
    etag: str
    digest: str | None = None  # "<hash>:<whole-file digest>" recorded at upload (object metadata), when known
    mtime: float | None = None  # Unix time the object was written (listings only)


class ObjectStore(Protocol):
    url: str

    def put_file(self, key: str, path: Path, digest: str) -> None: ...

    def put_bytes(self, key: str, data: bytes, *, if_none_match: bool = False, if_match: str | None = None) -> str:
        """Write ``data``; return the new ETag. Raises PreconditionFailed when a condition fails."""
        ...

    def get_bytes(self, key: str) -> tuple[bytes, str]:
        """Return (content, etag); raise ObjectNotFound if the object does not exist."""
        ...

    def download_file(self, key: str, path: Path) -> None: ...

    def iter_range(self, key: str, start: int, length: int, piece_bytes: int = RANGE_PIECE_BYTES) -> Iterator[bytes]:
        """Bytes ``[start, start + length)`` of the object (one ranged GET), as they arrive, in pieces
        of at most ``piece_bytes``; fewer bytes in all if the object is shorter. Raised when the
        first piece is asked for: ObjectNotFound if the object is missing, ObjectStoreError if the store
        fails or does not honour the range; later, TransferInterrupted if the body breaks off."""
        ...

    def head(self, key: str) -> ObjectInfo | None: ...

    def list(self, prefix: str) -> list[ObjectInfo]: ...

    def delete(self, keys: list[str]) -> None: ...

    def abort_multipart_uploads(self, prefix: str) -> int: ...


def split_uri(uri: str) -> tuple[str, str, str]:
    """``s3://bucket/pre/fix`` -> ("s3", "bucket", "pre/fix"); ``file:///dir`` -> ("file", "/dir", "")."""
    parsed = urlparse(uri)
    if parsed.scheme == "s3" and parsed.netloc:
        return "s3", parsed.netloc, parsed.path.strip("/")
    if parsed.scheme == "file" and parsed.path:
        return "file", parsed.path, ""
    raise ValueError(f"{uri!r} is not an s3://bucket[/prefix] or file:///path URI")


def open_store(
    uri: str,
    endpoint_url: str | None = None,
    concurrency: int = 8,
    chunk_mb: int = 64,
    checksum_header: bool = False,
    connect_timeout_s: float = 5.0,
    read_timeout_s: float = 60.0,
    max_attempts: int = 5,
) -> tuple[ObjectStore, str]:
    """Return the store and the key prefix inside it."""
    scheme, where, prefix = split_uri(uri)
    if scheme == "file":
        return FileStore(Path(where)), prefix
    store = S3Store(
        where, endpoint_url, concurrency, chunk_mb, checksum_header, connect_timeout_s, read_timeout_s, max_attempts
    )
    return store, prefix


# ---------------------------------------------------------------------------------------------
# S3


class S3Store:
    def __init__(
        self,
        bucket: str,
        endpoint_url: str | None,
        concurrency: int,
        chunk_mb: int,
        checksum_header: bool,
        connect_timeout_s: float,
        read_timeout_s: float,
        max_attempts: int,
    ) -> None:
        import boto3
        from boto3.s3.transfer import TransferConfig
        from botocore.config import Config

        self.bucket = bucket
        self.url = f"s3://{bucket}" + (f" at {endpoint_url}" if endpoint_url else "")
        # The standard boto3 credential chain (env, profile, IRSA web identity) applies unchanged.
        self.client = boto3.client(
            "s3",
            endpoint_url=endpoint_url,
            config=Config(
                # total_max_attempts counts every try; botocore's max_attempts counts only the retries
                retries={"total_max_attempts": max_attempts, "mode": "standard"},
                connect_timeout=connect_timeout_s,
                read_timeout=read_timeout_s,
                s3={"addressing_style": "path"},
                max_pool_connections=max(10, concurrency * 2),
                request_checksum_calculation="when_required",
                response_checksum_validation="when_required",
            ),
        )
        self.transfer = TransferConfig(
            multipart_threshold=chunk_mb * 1024 * 1024,
            multipart_chunksize=chunk_mb * 1024 * 1024,
            max_concurrency=concurrency,
            use_threads=concurrency > 1,
        )
        self.checksum_header = checksum_header

    @contextlib.contextmanager
    def _errors(self, what: str) -> Iterator[None]:
        from boto3.exceptions import Boto3Error
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            yield
        except ClientError as exc:
            code = exc.response.get("Error", {}).get("Code", "")
            status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if code in ("PreconditionFailed", "ConditionalRequestConflict") or status == 412:
                raise PreconditionFailed(f"{self.url}/{what}: precondition failed") from exc
            if code in ("NoSuchKey", "404", "NotFound") or status == 404:
                raise ObjectNotFound(what) from exc
            if code in ("AccessDenied", "403", "Forbidden") or status == 403:
                raise AccessDenied(
                    f"{self.url}/{what}: access denied (HTTP 403); fix: grant this identity's role the run "
                    "prefix's actions in k8s/common/iam-policy.json"
                ) from exc
            raise ObjectStoreError(f"{self.url}/{what}: {code or status}: {exc}") from exc
        except (BotoCoreError, Boto3Error) as exc:
            # Boto3Error: upload_file/download_file wrap a part's final error (e.g. 503 SlowDown after
            # the client's retries) in S3UploadFailedError / S3TransferFailedError.
            first = str(exc).splitlines()[0] if str(exc) else ""
            raise ObjectStoreError(
                f"{self.url}/{what}: {type(exc).__name__}: {first}; fix: check "
                "checkpoint.s3.endpoint_url, network and credentials"
            ) from exc

    def put_file(self, key: str, path: Path, digest: str) -> None:
        extra: dict[str, Any] = {"Metadata": {"digest": digest}}
        if self.checksum_header:
            extra["ChecksumAlgorithm"] = "SHA256"
        with self._errors(key):
            self.client.upload_file(str(path), self.bucket, key, ExtraArgs=extra, Config=self.transfer)

    def put_bytes(self, key: str, data: bytes, *, if_none_match: bool = False, if_match: str | None = None) -> str:
        kwargs: dict[str, Any] = {"Bucket": self.bucket, "Key": key, "Body": data, "ContentMD5": _b64md5(data)}
        if if_none_match:
            kwargs["IfNoneMatch"] = "*"
        if if_match is not None:
            kwargs["IfMatch"] = if_match.strip('"')  # Ceph RGW compares the unquoted ETag
        with self._errors(key):
            return self.client.put_object(**kwargs)["ETag"].strip('"')

    def get_bytes(self, key: str) -> tuple[bytes, str]:
        try:
            with self._errors(key):
                resp = self.client.get_object(Bucket=self.bucket, Key=key)
                return resp["Body"].read(), resp["ETag"].strip('"')
        except AccessDenied:
            raise self._absent_or_denied(key) from None

    def _absent_or_denied(self, key: str) -> ObjectStoreError:
        """What a 403 on ``key`` means. S3 (and Ceph RGW, tested) answers 403, not 404, for a
        missing key to a caller whose ListBucket grant does not cover that request: a GET carries
        no ``s3:prefix``, so a grant conditioned on one (the least-privilege policy) never
        applies. Listing the key's own name, which that grant allows, tells absent (ObjectNotFound) from
        really denied (the listing names the key, or is refused too)."""
        try:
            listed = self.list(key)
        except AccessDenied as exc:
            return exc
        if any(o.key == key for o in listed):
            return AccessDenied(
                f"{self.url}/{key}: exists but reading it is denied (HTTP 403); fix: grant this identity's "
                "role s3:GetObject on the run prefix (k8s/common/iam-policy.json)"
            )
        return ObjectNotFound(key)

    def download_file(self, key: str, path: Path) -> None:
        with self._errors(key):
            self.client.download_file(self.bucket, key, str(path), Config=self.transfer)

    def iter_range(self, key: str, start: int, length: int, piece_bytes: int = RANGE_PIECE_BYTES) -> Iterator[bytes]:
        if length == 0:
            return
        body = self._ranged_body(key, start, length)
        if body is None:
            return
        received = 0
        try:
            for piece in body.iter_chunks(piece_bytes):
                received += len(piece)
                yield piece
        except Exception as exc:
            # botocore wraps a reset or a timeout mid-body (ResponseStreamingError, ReadTimeoutError,
            # IncompleteReadError); urllib3 lets TLS and decoding errors through unwrapped.
            first = str(exc).splitlines()[0] if str(exc) else ""
            raise TransferInterrupted(
                f"{self.url}/{key}: body broke off after {received} of {length} bytes: "
                f"{type(exc).__name__}: {first}; fix: check the network to checkpoint.s3.endpoint_url"
            ) from exc
        finally:
            body.close()  # a consumer that stops early must not leave the connection half-read

    def _ranged_body(self, key: str, start: int, length: int) -> Any:
        """The body of ``GET key`` for bytes ``[start, start + length)``; None if the range starts
        at or past the object's end (HTTP 416: no bytes, the caller reports the object short)."""
        span = f"bytes={start}-{start + length - 1}"
        try:
            with self._errors(key):
                resp = self.client.get_object(Bucket=self.bucket, Key=key, Range=span)
        except ObjectStoreError as exc:
            if getattr(exc.__cause__, "response", {}).get("ResponseMetadata", {}).get("HTTPStatusCode") == 416:
                return None
            raise
        status, got = resp["ResponseMetadata"]["HTTPStatusCode"], resp.get("ContentRange", "")
        if status != 206 or not got.startswith(f"bytes {start}-"):
            resp["Body"].close()
            raise ObjectStoreError(
                f"{self.url}/{key}: asked for {span}, got HTTP {status} {got!r}; fix: the endpoint "
                "(or a proxy in front of it) must honour Range requests"
            )
        return resp["Body"]

    def head(self, key: str) -> ObjectInfo | None:
        try:
            with self._errors(key):
                resp = self.client.head_object(Bucket=self.bucket, Key=key)
        except ObjectNotFound:
            return None
        except AccessDenied:
            reason = self._absent_or_denied(key)
            if isinstance(reason, ObjectNotFound):
                return None
            raise reason from None
        meta = resp.get("Metadata", {})
        digest = meta.get("digest") or (f"sha256:{meta['sha256']}" if "sha256" in meta else None)
        return ObjectInfo(key, resp["ContentLength"], resp["ETag"].strip('"'), digest)

    def list(self, prefix: str) -> list[ObjectInfo]:
        out = []
        with self._errors(prefix):
            for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix):
                out += [
                    ObjectInfo(o["Key"], o["Size"], o["ETag"].strip('"'), mtime=o["LastModified"].timestamp())
                    for o in page.get("Contents", [])
                ]
        return out

    def delete(self, keys: list[str]) -> None:
        for i in range(0, len(keys), 1000):
            with self._errors(keys[i]):
                self.client.delete_objects(
                    Bucket=self.bucket, Delete={"Objects": [{"Key": k} for k in keys[i : i + 1000]], "Quiet": True}
                )

    def abort_multipart_uploads(self, prefix: str) -> int:
        n = 0
        with self._errors(prefix):
            for page in self.client.get_paginator("list_multipart_uploads").paginate(Bucket=self.bucket, Prefix=prefix):
                for up in page.get("Uploads", []):
                    self.client.abort_multipart_upload(Bucket=self.bucket, Key=up["Key"], UploadId=up["UploadId"])
                    n += 1
        return n


def _b64md5(data: bytes) -> str:
    return base64.b64encode(hashlib.md5(data).digest()).decode()


# ---------------------------------------------------------------------------------------------
# file:// emulation


class FileStore:
    """Objects as files under ``root``; writes are atomic, conditional writes are exact."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.url = f"file://{self.root}"

    def _path(self, key: str) -> Path:
        if not key or key.startswith("/") or ".." in key.split("/"):
            raise ObjectStoreError(f"{self.url}: refusing key {key!r}")
        return self.root / key

    def _stage(self, path: Path, writer: Any) -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.parent / f".{path.name}.upload-{uuid.uuid4().hex}"
        with open(tmp, "wb") as fh:
            writer(fh)
            fh.flush()
            os.fsync(fh.fileno())
        return tmp

    def _meta(self, dst: Path) -> Path:
        return dst.parent / f".{dst.name}.digest"  # object metadata (dot files are not objects)

    def put_file(self, key: str, path: Path, digest: str) -> None:
        dst = self._path(key)
        with open(path, "rb") as src:
            tmp = self._stage(dst, lambda fh: shutil.copyfileobj(src, fh, 16 * 1024 * 1024))
        os.replace(tmp, dst)
        self._meta(dst).write_text(digest)

    def put_bytes(self, key: str, data: bytes, *, if_none_match: bool = False, if_match: str | None = None) -> str:
        dst = self._path(key)
        tmp = self._stage(dst, lambda fh: fh.write(data))
        try:
            if if_none_match:
                try:
                    os.link(tmp, dst)  # exclusive create: fails if the object exists
                except FileExistsError as exc:
                    raise PreconditionFailed(f"{self.url}/{key}: precondition failed (exists)") from exc
            elif if_match is not None:
                with self._lock(dst):
                    current = self.head(key)
                    if current is None or current.etag != if_match.strip('"'):
                        raise PreconditionFailed(f"{self.url}/{key}: precondition failed (changed)")
                    os.replace(tmp, dst)
            else:
                os.replace(tmp, dst)
        finally:
            tmp.unlink(missing_ok=True)
        return hashlib.md5(data).hexdigest()

    @contextlib.contextmanager
    def _lock(self, dst: Path) -> Iterator[None]:
        lock = dst.parent / f".{dst.name}.lock"
        with open(lock, "a") as fh:
            fcntl.flock(fh, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(fh, fcntl.LOCK_UN)

    def get_bytes(self, key: str) -> tuple[bytes, str]:
        path = self._path(key)
        if not path.is_file():
            raise ObjectNotFound(key)
        data = path.read_bytes()
        return data, hashlib.md5(data).hexdigest()

    def download_file(self, key: str, path: Path) -> None:
        src = self._path(key)
        if not src.is_file():
            raise ObjectNotFound(key)
        shutil.copyfile(src, path)

    def iter_range(self, key: str, start: int, length: int, piece_bytes: int = RANGE_PIECE_BYTES) -> Iterator[bytes]:
        path = self._path(key)
        if not path.is_file():
            raise ObjectNotFound(key)
        with open(path, "rb", buffering=0) as fh:
            end = start + length
            while start < end:
                try:
                    piece = os.pread(fh.fileno(), min(piece_bytes, end - start), start)
                except OSError as exc:
                    raise TransferInterrupted(f"{self.url}/{key}: read failed at byte {start}: {exc}") from exc
                if not piece:
                    return
                start += len(piece)
                yield piece

    def head(self, key: str) -> ObjectInfo | None:
        path = self._path(key)
        if not path.is_file():
            return None
        meta = self._meta(path)
        digest = meta.read_text() if meta.is_file() else None
        return ObjectInfo(key, path.stat().st_size, hashlib.md5(path.read_bytes()).hexdigest(), digest)

    def list(self, prefix: str) -> list[ObjectInfo]:
        base = self.root
        out = []
        if not base.exists():
            return out
        for dirpath, _dirs, files in os.walk(base):
            for name in files:
                if name.startswith("."):
                    continue
                key = (Path(dirpath) / name).relative_to(base).as_posix()
                if key.startswith(prefix):
                    st = (Path(dirpath) / name).stat()
                    out.append(ObjectInfo(key, st.st_size, "", mtime=st.st_mtime))
        return sorted(out, key=lambda o: o.key)

    def delete(self, keys: list[str]) -> None:
        for key in keys:
            self._path(key).unlink(missing_ok=True)
            self._meta(self._path(key)).unlink(missing_ok=True)

    def abort_multipart_uploads(self, prefix: str) -> int:
        n = 0
        for dirpath, _dirs, files in os.walk(self.root / prefix if (self.root / prefix).exists() else self.root):
            for name in files:
                if ".upload-" in name:
                    (Path(dirpath) / name).unlink(missing_ok=True)
                    n += 1
        return n
