"""Deliberate faults of the object store client, for tests and drills only: kept out of the store
itself (:mod:`tiering.remote.objectstore` holds no test code). ``tiering upload --inject-fault`` and the
training config's ``fault_tolerance.inject.s3_fault`` (through ``pretrain upload``) install them
on a store that :func:`tiering.remote.objectstore.open_store` returned; server-side faults (cut bodies,
throttling, a dead endpoint) come from the test proxy in ``tests/cluster/s3proxy.py``."""

from __future__ import annotations

import os
import signal
from typing import Any

from tiering.remote.objectstore import ObjectStore


def install_s3_faults(store: ObjectStore, spec: str) -> None:
    """Deliberate faults for tests and drills (``tiering upload --inject-fault``, or the training
    config's ``fault_tolerance.inject.s3_fault`` through ``pretrain upload``):

    * ``kill_after_parts=N``: SIGKILL this process once N multipart parts were uploaded;
    * ``timeout_parts=N``: the first N UploadPart requests time out (the client retries them).
    """
    from botocore.exceptions import ReadTimeoutError  # boto3/botocore: only with an s3:// store

    client = getattr(store, "client", None)
    if client is None:
        raise ValueError(f"S3 fault {spec!r}: needs an s3:// store, not {store.url}")

    kind, _, count = spec.partition("=")
    limit = int(count or "1")
    seen = {"n": 0}

    def kill_after(**_: Any) -> None:
        seen["n"] += 1
        if seen["n"] >= limit:
            os.kill(os.getpid(), signal.SIGKILL)

    def time_out(request: Any = None, **_: Any) -> None:
        if seen["n"] < limit:
            seen["n"] += 1
            raise ReadTimeoutError(endpoint_url=getattr(request, "url", "s3"))

    if kind == "kill_after_parts":
        client.meta.events.register("after-call.s3.UploadPart", kill_after)
    elif kind == "timeout_parts":
        client.meta.events.register("before-send.s3.UploadPart", time_out)
    else:
        raise ValueError(f"S3 fault {spec!r}: unknown; use kill_after_parts=N or timeout_parts=N")
