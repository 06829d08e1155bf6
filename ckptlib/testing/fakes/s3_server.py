"""A moto S3 server on 127.0.0.1 for tests: pytest fixtures and the helpers behind them.

The fixtures come with the plugin (``pytest_plugins = ["ckptlib.testing.plugin"]``)::

    def test_roundtrip(s3_root):          # "s3://<fresh bucket>/run"
        ckptlib.save(s3_root, state)

`moto_server` (session scope) starts one `ThreadedMotoServer` per pytest process (so one per
xdist worker) on a port the kernel picks, points the AWS environment of this process at it
(fake credentials, no profiles, no instance metadata lookups) and yields the endpoint URL.
`s3_root` (function scope) creates a bucket with a unique name for each test and empties
and removes it afterwards.

Ranks started by `ckptlib.testing.launch` inherit `os.environ`; pass `s3_env(endpoint)` as
`env=` anyway to make the dependency explicit. An in-process `mock_aws` would not work
there: it does not cross process boundaries, a real server on loopback does.
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
import uuid
from typing import Iterator

import pytest

from ckptlib.testing.fakes.emulators import environ, fresh_root, require

__all__ = ["moto_server", "s3_root", "s3_env", "start_moto_server", "create_bucket", "remove_bucket", "s3_client"]

FAKE_KEY_ID = "testing"
FAKE_SECRET = "testing"
REGION = "us-east-1"

# Variables that would send a test to a real account, a profile or the instance-metadata
# endpoint; cleared while the server is up.
_CLEARED = (
    "AWS_SESSION_TOKEN",
    "AWS_SECURITY_TOKEN",
    "AWS_PROFILE",
    "AWS_DEFAULT_PROFILE",
    "AWS_ROLE_ARN",
    "AWS_WEB_IDENTITY_TOKEN_FILE",
    "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
    "AWS_CONTAINER_CREDENTIALS_FULL_URI",
    "AWS_REGION",
)


def s3_env(endpoint: str, config_dir: str | None = None) -> dict[str, str | None]:
    """The environment that points boto3 (in this process or a spawned rank) at `endpoint`.
    `None` values mean "remove" (the convention of `launch(env=...)`)."""
    env: dict[str, str | None] = {
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_ENDPOINT_URL_S3": endpoint,
        "AWS_ACCESS_KEY_ID": FAKE_KEY_ID,
        "AWS_SECRET_ACCESS_KEY": FAKE_SECRET,
        "AWS_DEFAULT_REGION": REGION,
        "AWS_EC2_METADATA_DISABLED": "true",
    }
    if config_dir is not None:  # no ~/.aws files: a developer's profile must not leak in
        env["AWS_CONFIG_FILE"] = os.path.join(config_dir, "config")
        env["AWS_SHARED_CREDENTIALS_FILE"] = os.path.join(config_dir, "credentials")
    env.update({name: None for name in _CLEARED})
    return env


@contextlib.contextmanager
def start_moto_server() -> Iterator[str]:
    """Run a moto S3 server on 127.0.0.1 (kernel-chosen port) with this process's AWS
    environment pointed at it; yields the endpoint URL."""
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one log line per request otherwise
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        endpoint = f"http://127.0.0.1:{port}"
        with tempfile.TemporaryDirectory(prefix="ckptlib-aws-") as config_dir:
            with environ(s3_env(endpoint, config_dir)):
                yield endpoint
    finally:
        server.stop()


_CLIENTS: dict[tuple[int, str], object] = {}


def s3_client(endpoint: str):
    """A plain boto3 client for test set-up and inspection (not ckptlib's client)."""
    import boto3

    key = (os.getpid(), endpoint)
    if key not in _CLIENTS:
        _CLIENTS[key] = boto3.session.Session().client(
            "s3",
            endpoint_url=endpoint,
            aws_access_key_id=FAKE_KEY_ID,
            aws_secret_access_key=FAKE_SECRET,
            region_name=REGION,
        )
    return _CLIENTS[key]


def create_bucket(endpoint: str, prefix: str = "ckpt") -> str:
    """A new bucket with a unique, valid name (safe across xdist workers and repeated runs)."""
    name = f"{prefix}-{uuid.uuid4().hex[:24]}"
    s3_client(endpoint).create_bucket(Bucket=name)
    return name


def remove_bucket(endpoint: str, bucket: str) -> None:
    """Empty and delete a bucket (objects and pending multipart uploads); best effort."""
    client = s3_client(endpoint)
    with contextlib.suppress(Exception):
        for page in client.get_paginator("list_multipart_uploads").paginate(Bucket=bucket):
            for up in page.get("Uploads") or ():
                client.abort_multipart_upload(Bucket=bucket, Key=up["Key"], UploadId=up["UploadId"])
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket):
            keys = [{"Key": o["Key"]} for o in page.get("Contents") or ()]
            if keys:
                client.delete_objects(Bucket=bucket, Delete={"Objects": keys, "Quiet": True})
        client.delete_bucket(Bucket=bucket)


@pytest.fixture(scope="session")
def moto_server() -> Iterator[str]:
    """The endpoint URL of a moto S3 server on 127.0.0.1, up for the whole session."""
    require(("boto3", "moto.server"), "boto3 and moto[server] (the S3 test server)", "pip install -e '.[test]'")
    with start_moto_server() as endpoint:
        yield endpoint


@pytest.fixture
def s3_root(moto_server: str) -> Iterator[str]:
    """`s3://<fresh bucket>/run` for one test; the bucket is removed afterwards."""
    yield from fresh_root("s3", moto_server, create_bucket, remove_bucket)
