"""S3 backend (boto3): objects as ``s3://BUCKET/PREFIX/KEY``.

Credentials come from boto3's usual chain (environment, shared config/credentials files,
instance profile). The endpoint of an S3-compatible server (Ceph RGW, MinIO, moto) comes from
the ``endpoint_url`` argument, else ``$WARMCTL_S3_ENDPOINT``, else ``$AWS_ENDPOINT_URL``; with a
custom endpoint, path-style addressing is used. Large objects are uploaded with multipart
upload; loads are ranged GETs. botocore's own retries are off: wrap in
:class:`warmctl.store.RetryingBackend` (``open_store`` does).
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import boto3
import botocore.config
import botocore.exceptions as bx

from warmctl.errors import HostError
from warmctl.store.backend import Backend, BackendProperties, ObjectInfo, ObjectNotFound, TransientBackendError

_TRANSIENT_CODES = {
    "InternalError",
    "ServiceUnavailable",
    "SlowDown",
    "RequestTimeout",
    "RequestTimeTooSkewed",
    "Throttling",
    "ThrottlingException",
    "503",
    "500",
    "502",
    "504",
}
_TRANSIENT_EXC = (
    bx.HTTPClientError,  # connection refused/reset/closed, read/connect timeouts
    bx.IncompleteReadError,
    bx.ResponseStreamingError,
)


def s3_endpoint_from_env() -> str | None:
    """``$WARMCTL_S3_ENDPOINT`` or ``$AWS_ENDPOINT_URL`` (or None)."""
    return os.environ.get("WARMCTL_S3_ENDPOINT") or os.environ.get("AWS_ENDPOINT_URL") or None


class S3Backend(Backend):
    """Objects in ``bucket`` under ``prefix`` (no leading/trailing slash needed).

    ``max_connections``: HTTP connection pool size (match the store's parallelism).
    ``multipart_threshold``/``part_size``: bytes; objects at least the threshold are sent with
    multipart upload in parts of ``part_size`` (>= 5 MiB, S3's minimum except the last part).
    """

    properties = BackendProperties(local=False, prefetch=False, workers=16)

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        endpoint_url: str | None = None,
        region: str | None = None,
        max_connections: int = 32,
        multipart_threshold: int = 64 * 1024 * 1024,
        part_size: int = 16 * 1024 * 1024,
        connect_timeout: float = 10.0,
        read_timeout: float = 60.0,
    ):
        self.bucket = bucket
        self.prefix = prefix.strip("/") + "/" if prefix.strip("/") else ""
        self.endpoint_url = endpoint_url or s3_endpoint_from_env()
        self.multipart_threshold = multipart_threshold
        self.part_size = part_size
        cfg = botocore.config.Config(
            max_pool_connections=max_connections,
            retries={"total_max_attempts": 1, "mode": "standard"},
            connect_timeout=connect_timeout,
            read_timeout=read_timeout,
            s3={"addressing_style": "path"} if self.endpoint_url else {},
            # Chunks carry their own digests; skip the SDK's extra CRCs (CPU, and some
            # S3-compatible servers reject them).
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
        )
        session = boto3.session.Session()
        self.client = session.client(
            "s3",
            endpoint_url=self.endpoint_url,
            region_name=region or session.region_name or "us-east-1",
            config=cfg,
        )

    def __repr__(self) -> str:
        return f"S3Backend({self.location()!r}, endpoint={self.endpoint_url!r})"

    def location(self, key: str = "") -> str:
        return f"s3://{self.bucket}/{self.prefix}{key}"

    def _err(self, op: str, key: str, e: Exception) -> Exception:
        where = self.location(key)
        if isinstance(e, bx.ClientError):
            code = str(e.response.get("Error", {}).get("Code", ""))
            status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
            if code in ("NoSuchKey", "404", "NotFound"):
                return ObjectNotFound(key, where)
            if code == "NoSuchBucket":
                return HostError(f"S3 bucket {self.bucket!r} does not exist (endpoint {self.endpoint_url or 'AWS'})")
            if code in _TRANSIENT_CODES or status >= 500:
                return TransientBackendError(f"{op} {where}: {code or status}: {e}")
            return HostError(f"{op} {where}: {code or status}: {e}")
        if isinstance(e, _TRANSIENT_EXC):
            return TransientBackendError(f"{op} {where}: {e}")
        if isinstance(e, bx.NoCredentialsError):
            return HostError(f"{op} {where}: no S3 credentials (set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or a profile)")
        return e

    def save(self, key: str, data: bytes | memoryview) -> None:
        k = self.prefix + key
        if not isinstance(data, bytes):
            data = bytes(data)  # boto3 wants bytes (a view may be a memory map of a local object)
        try:
            if len(data) < self.multipart_threshold:
                self.client.put_object(Bucket=self.bucket, Key=k, Body=data)
                return
            self._multipart(k, data)
        except Exception as e:  # noqa: BLE001 - translated
            raise self._err("save", key, e) from e

    def _multipart(self, k: str, data: bytes) -> None:
        up = self.client.create_multipart_upload(Bucket=self.bucket, Key=k)
        uid = up["UploadId"]
        try:
            parts = []
            view = memoryview(data)
            for i, off in enumerate(range(0, len(data), self.part_size), start=1):
                body = view[off : off + self.part_size].tobytes()
                r = self.client.upload_part(Bucket=self.bucket, Key=k, UploadId=uid, PartNumber=i, Body=body)
                parts.append({"PartNumber": i, "ETag": r["ETag"]})
            self.client.complete_multipart_upload(
                Bucket=self.bucket, Key=k, UploadId=uid, MultipartUpload={"Parts": parts}
            )
        except BaseException:
            try:
                self.client.abort_multipart_upload(Bucket=self.bucket, Key=k, UploadId=uid)
            except Exception:  # noqa: BLE001 - best effort; the original error matters
                pass
            raise

    def load(self, key: str, offset: int = 0, length: int | None = None) -> bytes:
        kw = {}
        if length is not None:
            if length == 0:
                self.stat(key)
                return b""
            kw["Range"] = f"bytes={offset}-{offset + length - 1}"
        elif offset:
            kw["Range"] = f"bytes={offset}-"
        try:
            r = self.client.get_object(Bucket=self.bucket, Key=self.prefix + key, **kw)
            return r["Body"].read()
        except Exception as e:  # noqa: BLE001 - translated
            raise self._err("load", key, e) from e

    def stat(self, key: str) -> ObjectInfo:
        try:
            r = self.client.head_object(Bucket=self.bucket, Key=self.prefix + key)
        except Exception as e:  # noqa: BLE001 - translated
            raise self._err("stat", key, e) from e
        return ObjectInfo(key, r["ContentLength"], r["LastModified"].timestamp())

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        pag = self.client.get_paginator("list_objects_v2")
        n = len(self.prefix)
        try:
            for page in pag.paginate(Bucket=self.bucket, Prefix=self.prefix + prefix):
                for o in page.get("Contents", []):
                    yield ObjectInfo(o["Key"][n:], o["Size"], o["LastModified"].timestamp())
        except Exception as e:  # noqa: BLE001 - translated
            raise self._err("list", prefix, e) from e

    def remove(self, key: str) -> None:
        try:
            self.client.delete_object(Bucket=self.bucket, Key=self.prefix + key)
        except Exception as e:  # noqa: BLE001 - translated
            err = self._err("remove", key, e)
            if not isinstance(err, ObjectNotFound):
                raise err from e

    def close(self) -> None:
        self.client.close()
