"""What only S3 does, against a real moto server on 127.0.0.1 (what every backend does the
same way is in test_storage_conformance.py): bucket names and limits, botocore's answers
classified (412 taken, 409 and 503 and broken bodies retried, 416 past the end, a Content-Range
without a size), batch deletes and their per-key errors, pending multipart uploads, a Complete
whose answer was lost, and credentials in messages. Requests are counted and answered through
botocore's before-send event (`Wire`)."""

from __future__ import annotations

import dataclasses
import io
import os
import threading
import uuid

import pytest
import torch
from helpers.storage import record_sleeps

import ckptlib
from ckptlib.errors import CheckpointError, StorageError
from ckptlib.storage import open_storage
from ckptlib.storage.s3 import MAX_PART_SIZE, MAX_PUT_SIZE, MIN_PART_SIZE, S3Storage, make_client, parse_uri
from ckptlib.storage.s3_client import S3Client
from ckptlib.testing.fakes.s3_server import s3_client

pytestmark = pytest.mark.s3

MiB = 1 << 20
GiB = 1 << 30


# --------------------------------------------------------------------------------------
# Helpers: request counting and fault injection through botocore's before-send event
# --------------------------------------------------------------------------------------
class _Raw(io.BytesIO):
    """Stands in for urllib3's response: botocore reads error bodies through stream()."""

    def stream(self, amt=None, decode_content=True):
        data = self.read()
        if data:
            yield data


def _fake_response(request, status: int, body: bytes = b"", headers: dict | None = None):
    from botocore.awsrequest import AWSResponse

    hdrs = {"content-length": str(len(body)), "x-amz-request-id": "FAKE"}
    if body.startswith(b"<"):
        hdrs["content-type"] = "application/xml"
    hdrs.update(headers or {})
    return AWSResponse(request.url, status, hdrs, _Raw(body))


def _error_body(code: str, message: str) -> bytes:
    return (
        f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code><Message>{message}</Message>'
        f"<RequestId>FAKE</RequestId></Error>"
    ).encode()


class Wire:
    """Records every request a client sends (operation, method, url) and can answer some of
    them itself: `rule(op, request, n)` returns a response (or raises) to replace the real one,
    or None to let the request through. `n` counts requests (attempts) from 1."""

    def __init__(self, client):
        self.client = client
        self.requests: list[tuple[str, str, str]] = []
        self.rules: list = []
        self.injected: list[tuple[str, str]] = []
        self._lock = threading.Lock()
        self._id = f"wire-{uuid.uuid4().hex}"
        client.meta.events.register("before-send.s3", self._hook, unique_id=self._id)

    def _hook(self, request, event_name, **kwargs):
        op = event_name.rsplit(".", 1)[-1]
        with self._lock:
            self.requests.append((op, request.method, request.url))
            n = len(self.requests)
        for rule in self.rules:
            try:
                response = rule(op, request, n)
            except Exception:
                with self._lock:
                    self.injected.append((op, request.url))
                raise
            if response is not None:
                with self._lock:
                    self.injected.append((op, request.url))
                return response
        return None

    def count(self, op: str) -> int:
        return sum(1 for r in self.requests if r[0] == op)

    def close(self) -> None:
        self.client.meta.events.unregister("before-send.s3", unique_id=self._id)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _delete_result(*errors: tuple[str, str, str | None]) -> bytes:
    """A DeleteObjects reply listing (key, code, message or None) errors."""
    items = "".join(
        f"<Error><Key>{key}</Key><Code>{code}</Code>"
        + (f"<Message>{message}</Message>" if message else "")
        + "</Error>"
        for key, code, message in errors
    )
    return f'<?xml version="1.0" encoding="UTF-8"?><DeleteResult>{items}</DeleteResult>'.encode()


@pytest.fixture
def client(moto_server):
    """A fresh ckptlib-configured client per test, so hooks never leak between tests."""
    return make_client()


@pytest.fixture(autouse=True)
def no_waits(monkeypatch) -> list[float]:
    """The shared back-off's sleeps, recorded instead of slept (jitter at its high end)."""
    return record_sleeps(monkeypatch, "high")


@pytest.fixture
def store(s3_root, client) -> S3Storage:
    return S3Storage.from_uri(s3_root, client=client)


def _bucket_keys(endpoint: str, bucket: str) -> set[str]:
    out = set()
    for page in s3_client(endpoint).get_paginator("list_objects_v2").paginate(Bucket=bucket):
        out.update(o["Key"] for o in page.get("Contents") or ())
    return out


def _pending_uploads(endpoint: str, bucket: str) -> list[str]:
    response = s3_client(endpoint).list_multipart_uploads(Bucket=bucket)
    return [u["Key"] for u in response.get("Uploads") or ()]


# --------------------------------------------------------------------------------------
# URIs, limits and settings
# --------------------------------------------------------------------------------------


def test_uri_parsing_and_open_storage(moto_server):
    assert parse_uri("s3://my-bucket/a/b/") == ("my-bucket", "a/b")
    assert parse_uri("s3://my-bucket") == ("my-bucket", "")
    assert parse_uri("s3://my-bucket/") == ("my-bucket", "")
    assert S3Storage.from_uri("s3://my-bucket/a/b/").uri == "s3://my-bucket/a/b"
    assert S3Storage.from_uri("s3://my-bucket").uri == "s3://my-bucket"
    storage = open_storage("s3://my.bucket-1/ckpt")
    assert isinstance(storage, S3Storage)
    assert (storage.bucket, storage.prefix, storage.uri) == ("my.bucket-1", "ckpt", "s3://my.bucket-1/ckpt")
    assert storage.child("step_1").uri == "s3://my.bucket-1/ckpt/step_1"
    assert storage.local_path() is None and storage.local_path("x") is None
    for bad in (
        "s3://",
        "s3://ab/x",
        "s3://Upper/x",
        "s3://under_score/x",
        "s3://-dash/x",
        "s3://a..b/x",
        "s3://192.168.1.1/x",
        "s3://" + "a" * 64 + "/x",
    ):
        with pytest.raises(StorageError, match="invalid S3 bucket name"):
            S3Storage.from_uri(bad)
    for bad in ("s3://bucket/../x", "s3://bucket/a//b", "s3://bucket/a/./b"):
        with pytest.raises(StorageError, match="escapes"):
            S3Storage.from_uri(bad)


@pytest.mark.parametrize(
    "option,value,message",
    [
        (
            "multipart_threshold",
            MAX_PUT_SIZE + 1,
            f"multipart_threshold must be within [1, {5 * GiB}], got {5 * GiB + 1}",
        ),
        ("part_size", 5 * MiB - 1, f"part_size must be within [{5 * MiB}, {5 * GiB}] bytes, got {5 * MiB - 1}"),
        ("part_size", 5 * GiB + 1, f"part_size must be within [{5 * MiB}, {5 * GiB}] bytes, got {5 * GiB + 1}"),
    ],
    ids=["threshold-over-max-put", "part-under-min", "part-over-max"],
)
def test_s3_limits_bound_the_transfer_settings(option, value, message):
    """S3's own limits: parts of 5 MiB..5 GiB, at most 10,000 of them, one PUT up to 5 GiB."""
    assert (MIN_PART_SIZE, MAX_PART_SIZE, MAX_PUT_SIZE, S3Storage.DEFAULTS.max_parts) == (
        5 * MiB,
        5 * GiB,
        5 * GiB,
        10_000,
    )
    assert S3Storage("bucket-name", "run", part_size=5 * MiB, multipart_threshold=5 * GiB).part_size == 5 * MiB
    with pytest.raises(ValueError) as info:
        S3Storage("bucket-name", "run", **{option: value})
    assert str(info.value) == message


def test_parts_grow_every_1000_so_a_stream_fits_10000_parts():
    storage = S3Storage("bucket-name", "run", part_size=16 * MiB)
    sizes = {n: storage.part_size_of(n) for n in (1, 1000, 1001, 2000, 2001, 10_000)}
    assert sizes == {1: 16 * MiB, 1000: 16 * MiB, 1001: 32 * MiB, 2000: 32 * MiB, 2001: 64 * MiB, 10_000: 5 * GiB}
    assert sum(storage.part_size_of(n) for n in range(1, 10_001)) > 5 * (1 << 40)  # S3's largest object fits
    assert S3Storage("bucket-name", "run", part_size=5 * GiB).part_size_of(1001) == 5 * GiB


def test_defaults_and_botocores_retries_off(monkeypatch):
    """Multipart from 16 MiB in 16 MiB parts, 8 requests at once, 32 MiB read chunks, 8 tries;
    botocore makes one try per call (ckptlib retries), so the two never multiply. The tries
    also come from AWS_MAX_ATTEMPTS (which used to set botocore's), CKPTLIB_S3_MAX_ATTEMPTS first."""
    monkeypatch.delenv("AWS_MAX_ATTEMPTS", raising=False)
    monkeypatch.delenv("CKPTLIB_S3_MAX_ATTEMPTS", raising=False)
    assert S3Storage.from_uri("s3://bucket-name/run")._options() == {
        "multipart_threshold": 16 * MiB,
        "part_size": 16 * MiB,
        "max_concurrency": 8,
        "read_chunk_size": 32 * MiB,
        "max_attempts": 8,
        "backoff_base": 0.1,
        "backoff_cap": 8.0,
    }
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "3")
    assert S3Storage.from_uri("s3://bucket-name/run").max_attempts == 3
    monkeypatch.setenv("CKPTLIB_S3_MAX_ATTEMPTS", "4")
    assert S3Storage.from_uri("s3://bucket-name/run").max_attempts == 4
    assert S3Storage.from_uri("s3://bucket-name/run", max_attempts=5).max_attempts == 5
    monkeypatch.delenv("CKPTLIB_S3_MAX_ATTEMPTS")
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "many")
    with pytest.raises(StorageError, match="AWS_MAX_ATTEMPTS='many' is not an integer"):
        S3Storage.from_uri("s3://bucket-name/run")
    retries = make_client().meta.config.retries
    assert retries["total_max_attempts"] == 1


def test_each_request_is_tried_max_attempts_times_in_all(s3_root, client, no_waits):
    storage = S3Storage.from_uri(s3_root, client=client, max_attempts=3)
    with Wire(client) as wire:
        wire.rules.append(lambda op, req, n: _fake_response(req, 503, _error_body("SlowDown", "Reduce your rate.")))
        with pytest.raises(StorageError) as info:
            storage.write("x", b"1")
        assert wire.count("PutObject") == 3
    assert str(info.value) == (
        f"S3 put failed for {s3_root}/x: SlowDown (HTTP 503): Reduce your rate. (gave up after 3 attempts)"
    )
    assert no_waits == pytest.approx([0.1, 0.2])


def test_exists_from_a_listing_without_key_count(store, client):
    """exists() trusts the listed objects when a ListObjectsV2 reply has no KeyCount (as some
    S3-compatible servers send it), and KeyCount when it has no Contents."""
    listing = (
        '<?xml version="1.0" encoding="UTF-8"?><ListBucketResult><Name>{b}</Name><Prefix>run/</Prefix>{extra}'
        "<MaxKeys>1</MaxKeys><IsTruncated>false</IsTruncated></ListBucketResult>"
    )
    replies = {
        "Contents": "<Contents><Key>run/x</Key><Size>1</Size></Contents>",
        "KeyCount": "<KeyCount>1</KeyCount>",
    }
    for extra in replies.values():
        body = listing.format(b=store.bucket, extra=extra).encode()
        with Wire(client) as wire:
            wire.rules.append(lambda op, req, n: _fake_response(req, 200, body) if op == "ListObjectsV2" else None)
            assert store.exists() is True
    assert store.exists() is False


def test_list_pagination(s3_root, client, monkeypatch):
    storage = S3Storage.from_uri(s3_root, client=client)
    for i in range(7):
        storage.write(f"d/f{i}", b"x" * i)
    original = client.get_paginator

    def small_pages(name):
        paginator = original(name)
        paginate = paginator.paginate
        paginator.paginate = lambda **kw: paginate(PaginationConfig={"PageSize": 2}, **kw)
        return paginator

    monkeypatch.setattr(client, "get_paginator", small_pages)
    with Wire(client) as wire:
        assert storage.list() == {f"d/f{i}": i for i in range(7)}
        assert wire.count("ListObjectsV2") == 4  # pages of 2, 2, 2, 1
        assert storage.list_children() == ["d"]


# --------------------------------------------------------------------------------------
# Deletes
# --------------------------------------------------------------------------------------


def test_delete_batches_and_ignores_absent(s3_root, client, monkeypatch):
    storage = S3Storage.from_uri(s3_root, client=client)
    for i in range(5):
        storage.write(f"f{i}", b"x")
    monkeypatch.setattr(S3Client, "delete_batch", 2)
    with Wire(client) as wire:
        storage.delete(["f0", "f1", "f2", "f3", "absent", "f0"])
        assert wire.count("DeleteObjects") == 2 and wire.count("DeleteObject") == 1  # 5 keys: 2 + 2 + 1
    assert storage.list() == {"f4": 1}
    storage.delete([])
    assert storage.list() == {"f4": 1}
    with Wire(client) as wire:
        storage.delete(["f4"])  # one object: a plain DELETE
        assert [r[0] for r in wire.requests] == ["DeleteObject"]
    assert storage.list() == {}


def _answer_deletes(client, reply: bytes) -> Wire:
    """A Wire on `client` that answers every DeleteObjects with `reply` (status 200)."""
    wire = Wire(client)
    wire.rules.append(lambda op, req, n: _fake_response(req, 200, reply) if op == "DeleteObjects" else None)
    return wire


def test_delete_reports_per_key_errors(store, client):
    store.write("a", b"1")
    store.write("b", b"2")
    with _answer_deletes(client, _delete_result(("run/b", "AccessDenied", "Access Denied"))):
        with pytest.raises(
            StorageError, match=r"S3 delete failed for 1 object\(s\) under s3://.*/run: run/b: AccessDenied"
        ):
            store.delete(["a", "b"])


def test_delete_reports_every_failure_but_absent_keys(store, client):
    """Per-key errors of a batch delete are all reported, each as 'key: code message' (the
    message left out when there is none), wherever an absent key (NoSuchKey) sits among them;
    a reply whose only errors are absent keys is success."""
    reply = _delete_result(
        ("run/a", "NoSuchKey", "The specified key does not exist."),
        ("run/b", "AccessDenied", "Access Denied"),
        ("run/c", "InternalError", None),
    )
    with _answer_deletes(client, reply):
        with pytest.raises(StorageError) as info:
            store.delete(["a", "b", "c"])
    assert str(info.value) == (
        f"S3 delete failed for 2 object(s) under {store.uri}: run/b: AccessDenied Access Denied; run/c: InternalError"
    )
    with _answer_deletes(client, _delete_result(("run/a", "NoSuchKey", None), ("run/b", "NoSuchKey", None))):
        store.delete(["a", "b"])


@pytest.mark.parametrize("failed", [5, 6])
def test_delete_failure_message_shows_five_failures_and_the_count(store, client, failed):
    """The error shows the first five failures; beyond five it adds how many failed in all."""
    names = [f"f{i}" for i in range(failed)]
    reply = _delete_result(*((f"run/{name}", "AccessDenied", None) for name in names))
    with _answer_deletes(client, reply):
        with pytest.raises(StorageError) as info:
            store.delete(names)
    shown = "; ".join(f"run/f{i}: AccessDenied" for i in range(5))
    more = " ... (6 in all)" if failed == 6 else ""
    assert str(info.value) == f"S3 delete failed for {failed} object(s) under {store.uri}: {shown}{more}"


def test_delete_tree_aborts_pending_multipart_uploads(moto_server, store):
    """Multipart uploads a crashed writer never completed (invisible to listing) are aborted
    with the tree they were in, and only those."""
    store.write("step_1/ckptlib.json", b"data")
    store.write("step_10/ckptlib.json", b"data")
    raw = s3_client(moto_server)
    raw.create_multipart_upload(Bucket=store.bucket, Key="run/step_1/__2_0.distcp")
    raw.create_multipart_upload(Bucket=store.bucket, Key="run/step_10/__2_0.distcp")
    store.delete_tree("step_1")
    assert store.list() == {"step_10/ckptlib.json": 4}
    assert _pending_uploads(moto_server, store.bucket) == ["run/step_10/__2_0.distcp"]
    store.delete_tree()
    assert store.list() == {} and not store.exists()
    assert _pending_uploads(moto_server, store.bucket) == []


# --------------------------------------------------------------------------------------
# Pointers and exclusive create
# --------------------------------------------------------------------------------------


def test_pointer_is_read_with_a_plain_get(store, client):
    """read_pointer reads the whole object without a Range header: there is no range to ask
    for, and a server may reject an invalid one (RFC 9110) and lose the pointer. The pointer
    is UTF-8 text, and says so."""
    store.set_pointer("latest", "step_0000000003")
    gets: list[dict] = []

    def record(op, request, n):
        if op == "GetObject":
            gets.append(dict(request.headers))
        return None

    with Wire(client) as wire:
        wire.rules.append(record)
        assert store.read_pointer("latest") == "step_0000000003"
    assert len(gets) == 1 and "Range" not in gets[0]
    head = client.head_object(Bucket=store.bucket, Key="run/latest")
    assert head["ContentType"] == "text/plain; charset=utf-8"


@pytest.mark.parametrize("answer", ["PreconditionFailed", "no-body"])
@pytest.mark.parametrize("there", [b"mine", b"theirs"])
def test_create_exclusive_taken_answer_compares_the_whole_object(moto_server, store, client, answer, there):
    """A 412 (with S3's PreconditionFailed body, or bare as a proxy may send it) means the key
    is taken: the call is ours only if the object holds our bytes. The check reads the whole
    object with a plain GET: a server may reject an invalid Range (RFC 9110) and disown us."""
    s3_client(moto_server).put_object(Bucket=store.bucket, Key="run/lock", Body=there)
    gets: list[dict] = []

    def taken(op, request, n):
        if op == "GetObject":
            gets.append(dict(request.headers))
        if op == "PutObject":
            body = _error_body("PreconditionFailed", "At least one of the pre-conditions you specified did not hold")
            return _fake_response(request, 412, body if answer == "PreconditionFailed" else b"")
        return None

    with Wire(client) as wire:
        wire.rules.append(taken)
        assert store.create_exclusive("lock", b"mine") is (there == b"mine")
        assert wire.count("PutObject") == 1
    assert len(gets) == 1 and "Range" not in gets[0]
    assert store.read("lock") == there


@pytest.mark.parametrize("answer", ["ConditionalRequestConflict", "OperationAborted", "no-body"])
def test_create_exclusive_retries_any_409(store, client, no_waits, answer):
    """A 409 means a concurrent conditional write is in flight (ConditionalRequestConflict, or
    OperationAborted: "a conflicting conditional operation ... try again"): sent again after
    the shared back-off, whatever the code."""

    def conflict_once(op, request, n):
        if op == "PutObject" and n == 1:
            return _fake_response(request, 409, b"" if answer == "no-body" else _error_body(answer, "try again"))
        return None

    with Wire(client) as wire:
        wire.rules.append(conflict_once)
        assert store.create_exclusive("lock", b"mine") is True
        assert wire.count("PutObject") == 2
    assert no_waits == [0.1]
    assert store.read("lock") == b"mine"


def test_create_exclusive_conflicts_give_up_after_max_attempts(store, client, no_waits):
    """409s back off like every transient answer (0.1 s doubling, jitter in [0.5, 1.0]) for
    max_attempts tries; then a StorageError says the writes kept conflicting."""
    with Wire(client) as wire:
        wire.rules.append(
            lambda op, req, n: _fake_response(req, 409, _error_body("ConditionalRequestConflict", "again"))
        )
        with pytest.raises(StorageError) as info:
            store.create_exclusive("lock", b"mine")
        assert wire.count("PutObject") == 8 and wire.count("GetObject") == 0
    assert str(info.value) == (
        f"S3 conditional put failed for {store.uri}/lock: ConditionalRequestConflict (HTTP 409): again - "
        "concurrent conditional writes to this key kept conflicting (gave up after 8 attempts)"
    )
    assert no_waits == pytest.approx([0.1, 0.2, 0.4, 0.8, 1.6, 3.2, 6.4])


# --------------------------------------------------------------------------------------
# Reads: botocore's answers
# --------------------------------------------------------------------------------------


def _invalid_range(size: str) -> bytes:
    return (
        '<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>InvalidRange</Code>'
        "<Message>The requested range is not satisfiable</Message><RangeRequested>bytes=5000-5009</RangeRequested>"
        f"<ActualObjectSize>{size}</ActualObjectSize><RequestId>FAKE</RequestId></Error>"
    ).encode()


@pytest.mark.parametrize("answer", ["InvalidRange", "InvalidRange-size-unreadable", "no-body"])
def test_416_reads_as_past_the_end(store, client, answer):
    """A range past the end answered 416, with S3's InvalidRange body (which gives the object
    size, used if it is a number) or bare, reads as end of object: b"" without a length,
    EOFError with one, giving the object's size (from a HEAD when the answer has none)."""
    store.write("x", bytes(1024))
    reply = {
        "InvalidRange": _invalid_range("1024"),
        "InvalidRange-size-unreadable": _invalid_range("n/a"),
        "no-body": b"",
    }[answer]

    def unsatisfiable(op, request, n):
        if op == "GetObject":
            return _fake_response(request, 416, reply)
        return None

    with Wire(client) as wire:
        wire.rules.append(unsatisfiable)
        assert store.read("x", 5000) == b""
        with pytest.raises(EOFError) as info:
            store.read("x", 5000, 10)
        assert wire.count("GetObject") == 2
        assert wire.count("HeadObject") == (0 if answer == "InvalidRange" else 1)
    assert str(info.value) == f"{store.uri}/x: wanted 10 bytes at offset 5000, object holds 1024"


def test_short_range_whose_content_range_has_no_size(store, client):
    """A short ranged answer whose Content-Range leaves the size unknown (`bytes a-b/*`, which
    RFC 9110 allows) gives the size as offset + bytes received, not the answer's length."""

    store.write("x", bytes(1024))

    def unknown_size(op, request, n):
        if op == "GetObject":
            return _fake_response(request, 206, bytes(24), {"content-range": "bytes 1000-1023/*"})
        return None

    with Wire(client) as wire:
        wire.rules.append(unknown_size)
        with pytest.raises(EOFError) as info:
            store.read("x", 1000, 100)
    assert str(info.value) == f"{store.uri}/x: wanted 100 bytes at offset 1000, object holds 1024"


def _broken_bodies(data: bytes, times: int):
    """A Wire rule: the first `times` GETs answer 200 with a body that breaks off."""
    state = {"broken": 0}

    def rule(op, request, n):
        if op == "GetObject" and state["broken"] < times:
            state["broken"] += 1
            return _fake_response(
                request, 200, data[:10], {"content-length": str(len(data)), "content-type": "binary/octet-stream"}
            )
        return None

    return rule


@pytest.mark.parametrize(
    "fault",
    ["slowdown-503", "internal-500", "throttled-429", "request-timeout-400", "connection-closed", "body-broke-off"],
)
def test_transient_s3_answers_are_retried(store, client, fault):
    """What S3 and botocore say when a try may succeed is classified transient: the request is
    sent again and the read succeeds."""
    from botocore.exceptions import ConnectionClosedError

    data = os.urandom(100_000)
    store.write("x.bin", data)
    answers = {
        "slowdown-503": (503, "SlowDown"),
        "internal-500": (500, "InternalError"),
        "throttled-429": (429, "TooManyRequests"),
        "request-timeout-400": (400, "RequestTimeout"),
    }
    broken = _broken_bodies(data, 1)

    def fail_once(op, request, n):
        if op != "GetObject" or n != 1:
            return None
        if fault == "connection-closed":
            raise ConnectionClosedError(endpoint_url=request.url)
        if fault == "body-broke-off":
            return broken(op, request, n)
        status, code = answers[fault]
        return _fake_response(request, status, _error_body(code, "try again"))

    with Wire(client) as wire:
        wire.rules.append(fail_once)
        assert store.read("x.bin") == data
        assert wire.count("GetObject") == 2


def test_a_body_that_keeps_breaking_off_is_a_storage_error(s3_root, client):
    data = os.urandom(1000)
    storage = S3Storage.from_uri(s3_root, client=client, max_attempts=2)
    storage.write("x.bin", data)
    with Wire(client) as wire:
        wire.rules.append(_broken_bodies(data, 100))
        with pytest.raises(StorageError) as info:
            storage.read("x.bin")
        assert wire.count("GetObject") == 2
    assert str(info.value).startswith(f"S3 get failed for {s3_root}/x.bin: IncompleteReadError: ")
    assert str(info.value).endswith("(gave up after 2 attempts)")


# --------------------------------------------------------------------------------------
# Writes: the single-PUT limit, multipart uploads
# --------------------------------------------------------------------------------------


def test_write_is_one_put_up_to_the_single_put_limit(monkeypatch, s3_root, client):
    """`write` sends one PUT whatever the multipart threshold, up to the largest single PUT;
    beyond that (5 GiB on S3, made smaller here) it is a multipart upload."""
    storage = _writer_storage(s3_root, client)
    monkeypatch.setattr(S3Storage, "DEFAULTS", dataclasses.replace(S3Storage.DEFAULTS, max_put_size=6 * MiB))
    at_limit, beyond = os.urandom(6 * MiB), os.urandom(6 * MiB + 1)
    with Wire(client) as wire:
        storage.write("at-limit.bin", at_limit)
        assert (wire.count("PutObject"), wire.count("CreateMultipartUpload")) == (1, 0)
        storage.write("beyond.bin", beyond)
        assert (wire.count("PutObject"), wire.count("CreateMultipartUpload"), wire.count("UploadPart")) == (1, 1, 2)
    assert storage.read("at-limit.bin") == at_limit and storage.read("beyond.bin") == beyond


def _writer_storage(s3_root, client, **kw) -> S3Storage:
    return S3Storage.from_uri(s3_root, client=client, multipart_threshold=5 * MiB, part_size=5 * MiB, **kw)


@pytest.mark.parametrize("ending", ["completed", "exception-after-parts", "failed-part"])
def test_multipart_uploads_leave_none_pending(moto_server, s3_root, client, ending):
    """However a multipart stream ends, no upload is left pending in the bucket (an aborted one
    would otherwise be billed, invisible, until a lifecycle rule removed it)."""
    storage = _writer_storage(s3_root, client)

    def deny_second_part(op, request, n):
        if op == "UploadPart" and "partNumber=2" in request.url:
            return _fake_response(request, 403, _error_body("AccessDenied", "Access Denied"))
        return None

    with Wire(client) as wire:
        wire.rules.append(deny_second_part if ending == "failed-part" else lambda op, req, n: None)
        with pytest.raises((RuntimeError, StorageError)) if ending != "completed" else _nothing():
            with storage.open_writer("obj.bin") as stream:
                stream.write(os.urandom(16 * MiB))
                if ending == "exception-after-parts":
                    raise RuntimeError("boom")
        aborts = wire.count("AbortMultipartUpload")
    assert aborts == (0 if ending == "completed" else 1)
    assert storage.list() == ({"obj.bin": 16 * MiB} if ending == "completed" else {})
    assert _pending_uploads(moto_server, storage.bucket) == []


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@pytest.mark.parametrize("meanwhile", ["nothing", "overwritten"])
def test_lost_complete_response(moto_server, s3_root, client, meanwhile):
    """CompleteMultipartUpload succeeds on the server but its response is lost (a 500 comes
    back); botocore's retry then gets NoSuchUpload. The writer recognises its own object by
    the multipart ETag and succeeds; if another writer replaced the object meanwhile, it fails."""
    from botocore.httpsession import URLLib3Session

    storage = _writer_storage(s3_root, client)
    data = os.urandom(11 * MiB)
    sent = {"n": 0}

    def complete_then_lose_response(op, request, n):
        if op == "CompleteMultipartUpload" and sent["n"] == 0:
            sent["n"] += 1
            real = URLLib3Session().send(request)  # the server completes the upload...
            assert real.status_code == 200
            if meanwhile == "overwritten":
                s3_client(moto_server).put_object(Bucket=storage.bucket, Key="run/obj.bin", Body=b"someone else")
            return _fake_response(request, 500, _error_body("InternalError", "lost"))  # ...the client never hears
        if op == "CompleteMultipartUpload":
            # what S3 answers once the upload id is gone (moto keeps accepting it)
            return _fake_response(request, 404, _error_body("NoSuchUpload", "The specified upload does not exist."))
        return None

    with Wire(client) as wire:
        wire.rules.append(complete_then_lose_response)
        if meanwhile == "nothing":
            with storage.open_writer("obj.bin") as stream:
                stream.write(data)
        else:
            with pytest.raises(
                StorageError, match=r"S3 complete multipart upload failed for s3://.*/run/obj.bin: NoSuchUpload"
            ):
                with storage.open_writer("obj.bin") as stream:
                    stream.write(data)
        assert wire.count("CompleteMultipartUpload") == 2 and wire.count("HeadObject") == 1
    assert storage.read("obj.bin") == (data if meanwhile == "nothing" else b"someone else")
    assert _pending_uploads(moto_server, storage.bucket) == []


# --------------------------------------------------------------------------------------
# Errors: codes, hints, credentials never shown
# --------------------------------------------------------------------------------------


def test_missing_bucket_is_a_storage_error_without_credentials(moto_server, monkeypatch):
    key_id, secret = "AKIAIOSFODNN7EXAMPLE", "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", key_id)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
    storage = open_storage("s3://no-such-bucket-ckptlib/run")
    with pytest.raises(StorageError) as info:
        storage.write("x", b"1")
    text = str(info.value)
    assert text.startswith("S3 put failed for s3://no-such-bucket-ckptlib/run/x: NoSuchBucket")
    assert "the bucket does not exist" in text
    for err in (info.value, info.value.__cause__):
        assert key_id not in str(err) and secret not in str(err) and key_id not in repr(err)
        assert "Credential=" not in str(err)
    with pytest.raises(StorageError, match="S3 list failed for s3://no-such-bucket-ckptlib/run: NoSuchBucket"):
        storage.list()
    with pytest.raises(StorageError, match="NoSuchBucket"):
        storage.read("x")  # not FileNotFoundError: the bucket, not the key, is missing
    with pytest.raises(CheckpointError, match="no-such-bucket-ckptlib"):
        ckptlib.save("s3://no-such-bucket-ckptlib/run", {"w": torch.ones(2)})


def test_invalid_key_id_and_access_denied_messages(store, client):
    def deny(op, request, n):
        if op == "ListObjectsV2":
            return _fake_response(
                request,
                403,
                _error_body("InvalidAccessKeyId", "The AWS Access Key Id you provided does not exist in our records."),
            )
        if op == "GetObject":
            return _fake_response(request, 403, _error_body("AccessDenied", "Access Denied"))
        return None

    with Wire(client) as wire:
        wire.rules.append(deny)
        with pytest.raises(
            StorageError,
            match=r"S3 list failed for s3://.*/run: InvalidAccessKeyId \(HTTP 403\).*access key id is not valid",
        ):
            store.list()
        with pytest.raises(
            StorageError, match=r"S3 get failed for s3://.*/run/x: AccessDenied \(HTTP 403\).*lack permission"
        ):
            store.read("x")
        assert wire.count("GetObject") == 1  # permanent: not retried


def test_password_in_the_endpoint_url_is_never_shown(moto_server, monkeypatch, caplog):
    """AWS_ENDPOINT_URL=http://user:password@host:port: the password appears in no error
    message, no chained exception and no log line (it did verbatim in botocore's connection
    errors: "Could not connect to the endpoint URL: http://user:password@...")."""
    import logging
    import socket

    password = "s3cret-Passw0rd-in-the-url"
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        closed = sock.getsockname()[1]  # nothing listens there once the socket is closed
    for name in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"):
        monkeypatch.setenv(name, f"http://ckpt-user:{password}@127.0.0.1:{closed}")
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "2")
    storage = S3Storage.from_uri("s3://some-bucket/run")
    with caplog.at_level(logging.DEBUG, logger="ckptlib"):
        with pytest.raises(StorageError) as info:
            storage.write("x", b"1")
    message = str(info.value)
    assert message.startswith("S3 put failed for s3://some-bucket/run/x: EndpointConnectionError: ")
    assert f"ckpt-user:<redacted>@127.0.0.1:{closed}" in message
    chain, exc = [], info.value
    while exc is not None:
        chain.append(exc)
        exc = exc.__cause__ or exc.__context__
    assert len(chain) >= 2
    for exc in chain:
        assert password not in str(exc) and password not in repr(exc)
    assert caplog.records and all(password not in record.getMessage() for record in caplog.records)
