"""The run lease in an object store: ``run.json`` names the identity that may write the run.

The first writer creates it with ``If-None-Match: *``; every later writer must be that identity.
A read-only identity (the trainer's role) can check a lease but never creates one. Called by the
uploader before its first upload and by the trainer's tiers at start; it writes nothing else.
"""

from __future__ import annotations

import getpass
import json
import logging
import os
import socket
import time

from tiering.errors import AccessDenied, LeaseError, ObjectNotFound
from tiering.remote.objectstore import PreconditionFailed
from tiering.remote.run import RemoteRun

log = logging.getLogger(__name__)


def default_owner() -> str:
    """The lease identity when none is given: ``RP_RUN_OWNER``, else ``user@host``."""
    return os.environ.get("RP_RUN_OWNER") or f"{getpass.getuser()}@{socket.gethostname()}"


def acquire_lease(run: RemoteRun, identity: str) -> None:
    """Create ``run.json`` for ``identity`` or confirm it already owns the run; :class:`LeaseError` if not."""
    key = run.key("run.json")
    body = json.dumps(
        {"run_id": run.run_id, "owner": identity, "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    ).encode()
    try:
        run.store.put_bytes(key, body, if_none_match=True)
        log.info("%s: run lease created for %s", run.where(key), identity)
        return
    except PreconditionFailed:
        pass  # a lease exists: whose it is is read below
    except AccessDenied:
        pass  # a read-only identity (the trainer's role): it can check a lease, not create one
    try:
        raw, _ = run.store.get_bytes(key)
    except ObjectNotFound:
        log.info("%s: no run lease yet; the uploader's identity creates it", run.where(key))
        return
    try:
        owner = json.loads(raw)["owner"]
    except (ValueError, KeyError) as exc:
        raise LeaseError(f"{run.where(key)}: unreadable run lease; fix: inspect it, or use a new run.id") from exc
    if owner != identity:
        raise LeaseError(
            f"{run.where(key)}: run {run.run_id!r} is owned by {owner!r}, "
            f"not {identity!r}; refusing to write; fix: use a new run.id or run as the owner"
        )
