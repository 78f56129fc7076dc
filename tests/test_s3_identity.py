"""The run's S3 identities against a real S3 (the test Ceph RGW), with the bucket policy built from
k8s/common/iam-policy.json: its ListBucket grant is conditioned on ``s3:prefix``, which a GET
never carries, so S3 answers 403 (not 404) for a missing key. A fresh run's restore and first
promotion read the optional ``latest.json``; they must take that 403 for "absent" (after a listing
of the key, which the policy does allow), while a caller denied outright still fails loudly
instead of looking like a run with no checkpoint.
"""

from __future__ import annotations

import json
import os
import subprocess
import uuid
from pathlib import Path

import boto3
import botocore.exceptions
import pytest

from tests.conftest import RGW_SECRET
from tests.helpers import PYTHON, REPO
from tests.test_s3_tier import RUN, make_step, run_key_file  # noqa: F401 (the run key fixture: autouse)
from tiering.errors import AccessDenied, LeaseError
from tiering.layout import RunLayout
from tiering.remote.objectstore import open_store
from tiering.remote.tier import RemoteTier

PREFIX = "ckpt"
POLICY = json.loads((REPO / "k8s" / "common" / "iam-policy.json").read_text())


def make_user(role: str) -> dict[str, str]:
    """A new RGW user: the credentials a pod of that identity would get (AWS_* environment)."""
    conf = os.environ.get("RP_TEST_RGW_CONF")
    if not conf:
        pytest.skip("needs the test RGW's radosgw-admin (S3_ENDPOINT_URL points elsewhere)")
    uid = f"{role}-{uuid.uuid4().hex[:8]}"
    subprocess.run(
        ["radosgw-admin", "-c", conf, "user", "create", f"--uid={uid}", f"--display-name={uid}",
         f"--access-key={uid}", f"--secret-key={uid}-secret"],
        check=True, capture_output=True, timeout=60,
    )  # fmt: skip
    return {"uid": uid, "AWS_ACCESS_KEY_ID": uid, "AWS_SECRET_ACCESS_KEY": f"{uid}-secret"}


def bucket_policy(bucket: str, grants: dict[str, tuple[str, str]], condition: str = "StringLike") -> str:
    """The roles of iam-policy.json as one bucket policy: ``grants`` maps role -> (RGW user id, run id)."""
    statements = []
    for role, (uid, run) in grants.items():
        text = json.dumps(POLICY[role]["Statement"])
        for st in json.loads(text.replace("BUCKET", bucket).replace("PREFIX", PREFIX).replace("RUN_ID", run)):
            if "Condition" in st:
                st["Condition"] = {condition: st["Condition"]["StringLike"]}
            st["Principal"] = {"AWS": [f"arn:aws:iam:::user/{uid}"]}
            statements.append(st)
    return json.dumps({"Version": "2012-10-17", "Statement": statements})


def client(endpoint: str, user: dict[str, str]):  # noqa: ANN201 (boto3 client)
    return boto3.client(
        "s3",
        endpoint_url=endpoint,
        aws_access_key_id=user["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=user["AWS_SECRET_ACCESS_KEY"],
        region_name="us-east-1",
    )


def status_of(call) -> int:  # noqa: ANN001
    try:
        call()
    except botocore.exceptions.ClientError as exc:
        return exc.response["ResponseMetadata"]["HTTPStatusCode"]
    return 200


def remote_as(user: dict[str, str], bucket: str, endpoint: str, monkeypatch: pytest.MonkeyPatch) -> RemoteTier:
    """The tier as ``user`` sees it: the product's client, built from that user's environment (a fresh
    default boto3 session: the old one keeps the credentials it resolved first; restored after)."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", user["AWS_ACCESS_KEY_ID"])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", user["AWS_SECRET_ACCESS_KEY"])
    monkeypatch.setattr(boto3, "DEFAULT_SESSION", None)
    store, prefix = open_store(f"s3://{bucket}/{PREFIX}", endpoint, chunk_mb=5, max_attempts=1)
    return RemoteTier(store, prefix, RUN)


def tiering(user: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONWARNINGS": "ignore", **{k: v for k, v in user.items() if k != "uid"}}
    return subprocess.run([PYTHON, "-m", "tiering", *args], capture_output=True, text=True, timeout=300, env=env)


def test_a_fresh_run_restores_nothing_under_the_reader_policy_and_restores_what_is_promoted(
    s3_endpoint: str, bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    reader = make_user("reader")
    owner = boto3.client("s3", endpoint_url=s3_endpoint)
    owner.put_bucket_policy(Bucket=bucket, Policy=bucket_policy(bucket, {"Reader": (reader["uid"], RUN)}))
    latest = f"{PREFIX}/{RUN}/latest.json"
    # The premise: a missing key is 403 to this identity, not 404.
    assert status_of(lambda: client(s3_endpoint, reader).get_object(Bucket=bucket, Key=latest)) == 403
    assert status_of(lambda: client(s3_endpoint, reader).head_object(Bucket=bucket, Key=latest)) == 403
    # The trainer's restore: no checkpoint, not an error.
    remote = remote_as(reader, bucket, s3_endpoint, monkeypatch)
    assert remote.latest_hint() is None and remote.store.head(latest) is None
    assert remote.restore_newest(RunLayout(tmp_path / "restore", RUN), "a0") == (None, [])
    # The trainer's start-up lease check: it cannot create run.json (read-only), and does not fail.
    remote.acquire_lease("eks/pretrain/r1")
    # Promoted by the bucket's owner (on AWS every role of the account writes objects the account
    # owns; on this RGW release an object belongs to the user that wrote it, and a bucket policy
    # covers only the bucket owner's objects).
    staging = tmp_path / "staging"
    make_step(staging, 10)
    endpoint = ["--endpoint-url", s3_endpoint]
    uri = f"s3://{bucket}/{PREFIX}"
    env = {"RP_RUN_OWNER": "eks/pretrain/r1", "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": RGW_SECRET}
    out = tiering(env, "upload", uri, "--run-id", RUN, "--staging-dir", str(staging), "--once", *endpoint)
    assert out.returncode == 0, out.stderr
    assert remote.latest_hint() == 10
    remote.acquire_lease("eks/pretrain/r1")
    with pytest.raises(LeaseError):
        remote.acquire_lease("someone-else")
    back = tiering(reader, "restore", uri, "--run-id", RUN, "--to", str(tmp_path / "back"), *endpoint)
    assert back.returncode == 0 and "restored step 10" in back.stdout, back.stderr
    # The reader cannot overwrite what was committed.
    assert status_of(lambda: client(s3_endpoint, reader).put_object(Bucket=bucket, Key=latest, Body=b"{}")) == 403


def test_the_first_promotion_under_the_writer_policy_creates_latest_json(
    s3_endpoint: str, bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The uploader's first promotion reads latest.json (403: absent) and aborts stale multipart
    uploads at start (ListBucketMultipartUploads has no s3:prefix key: granted unconditioned)."""
    writer = make_user("writer")
    owner = boto3.client("s3", endpoint_url=s3_endpoint)
    owner.put_bucket_policy(Bucket=bucket, Policy=bucket_policy(bucket, {"Writer": (writer["uid"], RUN)}))
    staging = tmp_path / "staging"
    make_step(staging, 10)
    uri, endpoint = f"s3://{bucket}/{PREFIX}", ["--endpoint-url", s3_endpoint]
    out = tiering(writer, "upload", uri, "--run-id", RUN, "--staging-dir", str(staging), "--once", *endpoint)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.splitlines()[-1]) == {"uploaded": [10], "pending": []}
    remote = remote_as(writer, bucket, s3_endpoint, monkeypatch)
    assert remote.latest_hint() == 10 and remote.committed_steps() == [10]
    # Outside its run the writer can neither read nor list.
    assert status_of(lambda: client(s3_endpoint, writer).list_objects_v2(Bucket=bucket, Prefix=f"{PREFIX}/")) == 403


def test_a_caller_denied_outright_fails_instead_of_finding_no_checkpoint(
    s3_endpoint: str, bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    stranger = make_user("stranger")  # no statement names it: denied listing and reading alike
    boto3.client("s3", endpoint_url=s3_endpoint).put_object(
        Bucket=bucket, Key=f"{PREFIX}/{RUN}/latest.json", Body=b"{}"
    )
    remote = remote_as(stranger, bucket, s3_endpoint, monkeypatch)
    with pytest.raises(AccessDenied) as err:
        remote.latest_hint()
    assert "HTTP 403" in str(err.value) and "fix:" in str(err.value) and "\n" not in str(err.value)
    # The init container's restore (--allow-none forgives an outage) fails the pod on a refusal.
    args = ["restore", f"s3://{bucket}/{PREFIX}", "--run-id", RUN, "--to", str(tmp_path), "--allow-none"]
    out = tiering(stranger, *args, "--endpoint-url", s3_endpoint)
    assert out.returncode == 1 and "HTTP 403" in out.stderr.strip().splitlines()[-1]


def test_string_like_if_exists_answers_404_but_lets_the_role_list_the_whole_bucket(
    s3_endpoint: str, bucket: str
) -> None:
    """Why iam-policy.json keeps StringLike: the IfExists form makes a missing key a 404, and also
    grants a listing without any prefix, i.e. every other run's key names in the bucket."""
    reader = make_user("reader")
    owner = boto3.client("s3", endpoint_url=s3_endpoint)
    owner.put_object(Bucket=bucket, Key="other-team/run-9/steps/x", Body=b"x")
    missing = f"{PREFIX}/{RUN}/latest.json"
    as_reader = client(s3_endpoint, reader)
    for condition, get_missing, list_all in (("StringLike", 403, 403), ("StringLikeIfExists", 404, 200)):
        policy = bucket_policy(bucket, {"Reader": (reader["uid"], RUN)}, condition)
        owner.put_bucket_policy(Bucket=bucket, Policy=policy)
        assert status_of(lambda: as_reader.get_object(Bucket=bucket, Key=missing)) == get_missing, condition
        assert status_of(lambda: as_reader.list_objects_v2(Bucket=bucket)) == list_all, condition
        assert status_of(lambda: as_reader.list_objects_v2(Bucket=bucket, Prefix="other-team/")) == 403, condition
