"""S3Storage against a real moto server on 127.0.0.1: the storage protocol, multipart
streaming, error mapping, fault injection, and ckptlib.save/load + CheckpointManager on s3://."""

from __future__ import annotations

import io
import itertools
import os
import pickle
import threading
import types
import uuid

import pytest
import torch
from torch import nn

import ckptlib
from ckptlib.errors import CheckpointError, StorageError
from ckptlib.storage import open_storage
from ckptlib.storage import s3 as s3mod
from ckptlib.storage.s3 import MAX_PART_SIZE, MAX_PUT_SIZE, MIN_PART_SIZE, S3Storage, make_client, parse_uri
from ckptlib.testing.fakes.s3_server import s3_client

pytestmark = pytest.mark.s3

MiB = 1 << 20


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


class _JitterEnds:
    """Stands in for `random` in s3mod: uniform() returns the low (or the high) end of its
    range, so back-off delays are exact and a test sees the range's ends."""

    def __init__(self, end: str):
        self.end = end

    def uniform(self, a: float, b: float) -> float:
        return min(a, b) if self.end == "low" else max(a, b)


def _record_sleeps(monkeypatch, end: str) -> list[float]:
    """Back-off sleeps in s3mod are recorded instead of slept, with the jitter at `end`."""
    sleeps: list[float] = []
    monkeypatch.setattr(s3mod, "time", types.SimpleNamespace(sleep=sleeps.append))
    monkeypatch.setattr(s3mod, "random", _JitterEnds(end))
    return sleeps


_JITTER = {"low": 0.5, "high": 1.0}  # the back-off's jitter range: [0.5, 1.0] x the base delay


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
# URIs
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


def test_pickles_without_its_client(store):
    clone = pickle.loads(pickle.dumps(store))
    assert clone.uri == store.uri and clone._client is None
    assert (clone.part_size, clone.multipart_threshold) == (store.part_size, store.multipart_threshold)


def test_transfer_options_accept_the_ends_of_their_ranges(s3_root, client):
    """The smallest allowed values (threshold 1 byte, one thread, 1-byte chunks, no read
    retries) and the largest sizes are accepted, and a storage built with the smallest works."""
    storage = S3Storage.from_uri(
        s3_root,
        client=client,
        multipart_threshold=1,
        max_concurrency=1,
        read_chunk_size=1,
        read_retries=0,
        part_size=MIN_PART_SIZE,
    )
    assert storage._options() == {
        "multipart_threshold": 1,
        "part_size": MIN_PART_SIZE,
        "max_concurrency": 1,
        "read_chunk_size": 1,
        "read_retries": 0,
    }
    storage.write("x", b"abc")
    assert storage.read("x") == b"abc" and storage.read("x", 0, 3) == b"abc"
    with storage.open_writer("y") as stream:
        stream.write(b"defg")
    assert storage.read("y", 1, 3) == b"efg"
    largest = S3Storage("bucket-name", "run", multipart_threshold=MAX_PUT_SIZE, part_size=MAX_PART_SIZE)
    assert (largest.multipart_threshold, largest.part_size) == (MAX_PUT_SIZE, MAX_PART_SIZE)


_COUNTS_MESSAGE = "max_concurrency and read_chunk_size must be >= 1, read_retries >= 0"


@pytest.mark.parametrize(
    "option,value,message",
    [
        ("multipart_threshold", 0, f"multipart_threshold must be within [1, {MAX_PUT_SIZE}], got 0"),
        (
            "multipart_threshold",
            MAX_PUT_SIZE + 1,
            f"multipart_threshold must be within [1, {MAX_PUT_SIZE}], got {MAX_PUT_SIZE + 1}",
        ),
        (
            "part_size",
            MIN_PART_SIZE - 1,
            f"part_size must be within [{MIN_PART_SIZE}, {MAX_PART_SIZE}] bytes, got {MIN_PART_SIZE - 1}",
        ),
        (
            "part_size",
            MAX_PART_SIZE + 1,
            f"part_size must be within [{MIN_PART_SIZE}, {MAX_PART_SIZE}] bytes, got {MAX_PART_SIZE + 1}",
        ),
        ("max_concurrency", 0, _COUNTS_MESSAGE),
        ("read_chunk_size", 0, _COUNTS_MESSAGE),
        ("read_retries", -1, _COUNTS_MESSAGE),
    ],
    ids=[
        "threshold-0",
        "threshold-over-max-put",
        "part-under-min",
        "part-over-max",
        "concurrency-0",
        "chunk-0",
        "retries-negative",
    ],
)
def test_transfer_option_out_of_range_is_refused(option, value, message):
    """Each option alone, one step outside its range, is refused with a message naming it."""
    with pytest.raises(ValueError) as info:
        S3Storage("bucket-name", "run", **{option: value})
    assert str(info.value) == message


# --------------------------------------------------------------------------------------
# The storage protocol
# --------------------------------------------------------------------------------------


def test_write_read_ranges(store):
    assert store.exists() is False
    payload = bytes(range(256)) * 4  # 1024 bytes
    store.write("dir/blob.bin", payload)
    assert store.exists() is True
    assert store.read("dir/blob.bin") == payload
    assert store.read("dir/blob.bin", 10, 20) == payload[10:30]
    assert store.read("dir/blob.bin", 1000) == payload[1000:]
    assert store.read("dir/blob.bin", 1024) == b""
    assert store.read("dir/blob.bin", 0, 1024) == payload
    assert store.read("dir/blob.bin", 5, 0) == b""
    with pytest.raises(EOFError, match="wanted 100 bytes at offset 1000, object holds 1024"):
        store.read("dir/blob.bin", 1000, 100)
    with pytest.raises(EOFError, match="object holds 1024"):
        store.read("dir/blob.bin", 5000, 10)
    with pytest.raises(FileNotFoundError):
        store.read("dir/missing.bin")
    with pytest.raises(FileNotFoundError):
        store.read("dir/missing.bin", 0, 10)
    with pytest.raises(FileNotFoundError):
        store.read("dir/missing.bin", 0, 0)
    # overwrite is atomic and complete
    store.write("dir/blob.bin", b"new")
    assert store.read("dir/blob.bin") == b"new"
    # an empty object
    store.write("empty", b"")
    assert store.read("empty") == b""
    assert store.list() == {"dir/blob.bin": 3, "empty": 0}


def test_parallel_ranged_read_is_byte_exact(s3_root, client):
    storage = S3Storage.from_uri(s3_root, client=client, read_chunk_size=1 * MiB, max_concurrency=3)
    data = os.urandom(5 * MiB + 321)
    storage.write("x.bin", data)
    with Wire(client) as wire:
        got = storage.read("x.bin", 1234, 4 * MiB)
        assert bytes(got) == data[1234 : 1234 + 4 * MiB]
        assert wire.count("GetObject") == 4  # four 1 MiB ranges
        with pytest.raises(EOFError, match=f"object holds {len(data)}"):
            storage.read("x.bin", 2 * MiB, 4 * MiB)


def test_list_list_children_and_prefix_isolation(store):
    files = {
        "step_1/a": b"1",
        "step_1/sub/b": b"22",
        "step_10/a": b"333",
        "step_2/c": b"4444",
        "top.txt": b"55555",
    }
    for path, data in files.items():
        store.write(path, data)
    assert store.list() == {p: len(d) for p, d in files.items()}
    assert store.list("step_1") == {"step_1/a": 1, "step_1/sub/b": 2, "step_10/a": 3}
    assert store.list("step_1/") == {"step_1/a": 1, "step_1/sub/b": 2}
    assert store.list_children() == ["step_1", "step_10", "step_2"]
    one = store.child("step_1")
    assert one.list() == {"a": 1, "sub/b": 2}  # never step_10's objects
    assert one.list_children() == ["sub"]
    assert one.exists() and not store.child("step_3").exists()
    assert store.child("step_1/sub").list() == {"b": 2}
    # a sibling prefix that merely starts with our name is not ours
    sibling = S3Storage(store.bucket, store.prefix + "x", client=store.client)
    assert not sibling.exists()


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


def test_list_children_skips_names_a_key_cannot_make(moto_server, store):
    """Keys that other tools may write below the root with an empty, '.' or '..' segment
    ('run//x', 'run/./x') make no child of that name."""
    raw = s3_client(moto_server)
    for key in ("run//x", "run/./x", "run/../x", "run/a/b"):
        raw.put_object(Bucket=store.bucket, Key=key, Body=b"1")
    assert store.list_children() == ["a"]


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


def test_delete_batches_and_ignores_absent(s3_root, client, monkeypatch):
    storage = S3Storage.from_uri(s3_root, client=client)
    for i in range(5):
        storage.write(f"f{i}", b"x")
    monkeypatch.setattr(s3mod, "DELETE_BATCH", 2)
    with Wire(client) as wire:
        storage.delete(["f0", "f1", "f2", "f3", "absent", "f0"])
        assert wire.count("DeleteObjects") == 3  # 5 distinct keys in batches of 2
    assert storage.list() == {"f4": 1}
    storage.delete([])
    assert storage.list() == {"f4": 1}


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


def test_delete_tree_removes_commit_marker_first_and_pending_uploads(moto_server, store, client):
    names = [
        "step_1/ckptlib.json",
        "step_1/.metadata",
        "step_1/__0_0.distcp",
        "step_1/__1_0.distcp",
        "step_10/ckptlib.json",
        "keep.txt",
    ]
    for name in names:
        store.write(name, b"data")
    # debris of a crashed writer: a multipart upload that was never completed
    raw = s3_client(moto_server)
    raw.create_multipart_upload(Bucket=store.bucket, Key="run/step_1/__2_0.distcp")
    raw.create_multipart_upload(Bucket=store.bucket, Key="run/step_10/__2_0.distcp")
    deleted_batches: list[list[str]] = []

    def record(params, **kwargs):
        deleted_batches.append(sorted(o["Key"] for o in params["Delete"]["Objects"]))

    client.meta.events.register("provide-client-params.s3.DeleteObjects", record, unique_id="rec-delete")
    try:
        store.delete_tree("step_1")
    finally:
        client.meta.events.unregister("provide-client-params.s3.DeleteObjects", unique_id="rec-delete")
    assert deleted_batches == [
        ["run/step_1/ckptlib.json"],
        ["run/step_1/.metadata"],
        ["run/step_1/__0_0.distcp", "run/step_1/__1_0.distcp"],
    ]
    assert store.list() == {"step_10/ckptlib.json": 4, "keep.txt": 4}
    assert _pending_uploads(moto_server, store.bucket) == ["run/step_10/__2_0.distcp"]
    store.delete_tree("nothing-here")  # absent: no error
    store.delete_tree()
    assert store.list() == {} and not store.exists()
    assert _pending_uploads(moto_server, store.bucket) == []


def test_pointer_round_trip(store):
    assert store.read_pointer("latest") is None
    store.set_pointer("latest", "step_0000000003")
    assert store.read_pointer("latest") == "step_0000000003"
    store.set_pointer("latest", "step_0000000004")
    assert store.read_pointer("latest") == "step_0000000004"
    assert store.read("latest") == b"step_0000000004"
    assert store.list_children() == []  # a pointer is an object, not a child
    for bad in ("../elsewhere", "/abs", ""):
        with pytest.raises(StorageError):
            store.set_pointer("latest", bad)
    assert store.read_pointer("latest") == "step_0000000004"


def test_pointer_is_read_with_a_plain_get(store, client):
    """read_pointer reads the whole object without a Range header: there is no range to ask
    for, and a server may reject an invalid one (RFC 9110) and lose the pointer."""
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


def test_pointer_that_is_not_utf8_is_a_storage_error(moto_server, store):
    """A `latest` object holding bytes that are not UTF-8 (written by something else) is a
    StorageError naming the object, not a UnicodeDecodeError."""
    s3_client(moto_server).put_object(Bucket=store.bucket, Key="run/latest", Body=b"step_\xff\xfe")
    with pytest.raises(StorageError) as info:
        store.read_pointer("latest")
    assert str(info.value) == f"{store.uri}/latest: pointer object is not UTF-8 text"
    assert isinstance(info.value.__cause__, UnicodeDecodeError)


def test_create_exclusive(store, client):
    from ckptlib.storage.base import SupportsCreateExclusive

    assert isinstance(store, SupportsCreateExclusive)
    assert store.create_exclusive("ckptlib.lock", b"token-1") is True
    assert store.create_exclusive("ckptlib.lock", b"token-2") is False
    assert store.read("ckptlib.lock") == b"token-1"
    store.delete(["ckptlib.lock"])
    # 409 ConditionalRequestConflict (a concurrent conditional write) is retried
    state = {"conflicts": 0}

    def conflict_once(op, request, n):
        if op == "PutObject" and state["conflicts"] == 0:
            state["conflicts"] += 1
            return _fake_response(request, 409, _error_body("ConditionalRequestConflict", "try again"))
        return None

    with Wire(client) as wire:
        wire.rules.append(conflict_once)
        assert store.create_exclusive("ckptlib.lock", b"token-3") is True
    assert store.read("ckptlib.lock") == b"token-3"
    # a retried PUT whose first attempt had succeeded answers 412: still ours (same bytes)
    assert store.create_exclusive("ckptlib.lock", b"token-3") is True
    assert store.create_exclusive("ckptlib.lock", b"token-4") is False


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


def test_create_exclusive_puts_again_when_the_taken_object_vanished(store, client):
    """A 412 whose object is gone by the time it is read (deleted meanwhile) is not an answer:
    the conditional PUT is sent again and creates the object."""

    def taken_once(op, request, n):
        if op == "PutObject" and n == 1:
            return _fake_response(request, 412, _error_body("PreconditionFailed", "taken"))
        return None

    with Wire(client) as wire:
        wire.rules.append(taken_once)
        assert store.create_exclusive("lock", b"mine") is True
        assert [r[0] for r in wire.requests] == ["PutObject", "GetObject", "PutObject"]
    assert store.read("lock") == b"mine"


@pytest.mark.parametrize("answer", ["ConditionalRequestConflict", "OperationAborted", "no-body"])
def test_create_exclusive_retries_any_409(store, client, monkeypatch, answer):
    """A 409 means a concurrent conditional write is in flight (ConditionalRequestConflict, or
    OperationAborted: "a conflicting conditional operation ... try again"): sent again after a
    back-off, whatever the code."""
    sleeps = _record_sleeps(monkeypatch, "high")

    def conflict_once(op, request, n):
        if op == "PutObject" and n == 1:
            return _fake_response(request, 409, b"" if answer == "no-body" else _error_body(answer, "try again"))
        return None

    with Wire(client) as wire:
        wire.rules.append(conflict_once)
        assert store.create_exclusive("lock", b"mine") is True
        assert wire.count("PutObject") == 2
    assert sleeps == [0.05]
    assert store.read("lock") == b"mine"


@pytest.mark.parametrize("end", ["low", "high"])
def test_create_exclusive_conflict_back_off_doubles_then_gives_up(store, client, monkeypatch, end):
    """Conflicts back off 0.05 s x 2**attempt (capped at 2 s) times a jitter in [0.5, 1.0],
    for 6 attempts; then a StorageError says the writes kept conflicting."""
    sleeps = _record_sleeps(monkeypatch, end)
    with Wire(client) as wire:
        wire.rules.append(
            lambda op, req, n: _fake_response(req, 409, _error_body("ConditionalRequestConflict", "again"))
        )
        with pytest.raises(StorageError) as info:
            store.create_exclusive("lock", b"mine")
        assert wire.count("PutObject") == 6
    assert (
        str(info.value) == f"S3 conditional put failed for {store.uri}/lock: kept conflicting with concurrent writers"
    )
    assert sleeps == pytest.approx([_JITTER[end] * base for base in (0.05, 0.1, 0.2, 0.4, 0.8, 1.6)])


def test_create_exclusive_permanent_error_is_raised_at_once(store, client):
    """An error that is neither 'taken' (412) nor 'conflict' (409), such as AccessDenied, is a
    StorageError after one PUT: no ownership check, no retry."""

    def deny(op, request, n):
        if op == "PutObject":
            return _fake_response(request, 403, _error_body("AccessDenied", "Access Denied"))
        return None

    with Wire(client) as wire:
        wire.rules.append(deny)
        with pytest.raises(StorageError) as info:
            store.create_exclusive("lock", b"mine")
        assert [r[0] for r in wire.requests] == ["PutObject"]
    assert str(info.value).startswith(f"S3 conditional put failed for {store.uri}/lock: AccessDenied (HTTP 403)")


@pytest.mark.parametrize(
    "call",
    [
        lambda s: s.write("../outside", b"x"),
        lambda s: s.write("/abs", b"x"),
        lambda s: s.write("a/../../outside", b"x"),
        lambda s: s.read("../outside"),
        lambda s: s.child(".."),
        lambda s: s.child("a//b"),
        lambda s: s.list("../"),
        lambda s: s.list("a/../"),
        lambda s: s.delete(["ok", "../outside"]),
        lambda s: s.delete_tree(".."),
        lambda s: s.set_pointer("../latest", "x"),
        lambda s: s.read_pointer("../latest"),
        lambda s: s.open_writer("..\\win").__enter__(),
        lambda s: s.create_exclusive("../lock", b"x"),
    ],
)
def test_path_traversal_is_rejected(moto_server, store, call):
    store.write("ok", b"keep")
    s3_client(moto_server).put_object(Bucket=store.bucket, Key="outside", Body=b"theirs")
    with pytest.raises(StorageError, match="escapes|invalid"):
        call(store)
    assert _bucket_keys(moto_server, store.bucket) == {"run/ok", "outside"}


# --------------------------------------------------------------------------------------
# Streaming writes
# --------------------------------------------------------------------------------------


def _writer_storage(s3_root, client, **kw) -> S3Storage:
    return S3Storage.from_uri(s3_root, client=client, multipart_threshold=5 * MiB, part_size=5 * MiB, **kw)


def test_write_is_one_put_up_to_the_single_put_limit(monkeypatch, s3_root, client):
    """`write` sends one PUT whatever the multipart threshold, up to the largest single PUT;
    beyond that (5 GiB on S3, made smaller here) it is a multipart upload."""
    storage = _writer_storage(s3_root, client)
    monkeypatch.setattr(s3mod, "MAX_PUT_SIZE", 6 * MiB)
    at_limit, beyond = os.urandom(6 * MiB), os.urandom(6 * MiB + 1)
    with Wire(client) as wire:
        storage.write("at-limit.bin", at_limit)
        assert (wire.count("PutObject"), wire.count("CreateMultipartUpload")) == (1, 0)
        storage.write("beyond.bin", beyond)
        assert (wire.count("PutObject"), wire.count("CreateMultipartUpload"), wire.count("UploadPart")) == (1, 1, 2)
    assert storage.read("at-limit.bin") == at_limit and storage.read("beyond.bin") == beyond


def test_small_stream_is_one_put(s3_root, client):
    storage = _writer_storage(s3_root, client)
    with Wire(client) as wire:
        with storage.open_writer("small.bin") as stream:
            for _ in range(10):
                stream.write(b"abc" * 1000)
            assert stream.tell() == 30000
        assert (wire.count("PutObject"), wire.count("CreateMultipartUpload"), wire.count("UploadPart")) == (1, 0, 0)
    assert storage.read("small.bin") == b"abc" * 10000


def test_multipart_stream_round_trips_byte_exact(moto_server, s3_root, client):
    storage = _writer_storage(s3_root, client, max_concurrency=2)
    data = os.urandom(12 * MiB + 12345)
    sizes = itertools.cycle([1, 999_999, 3 * MiB + 7, 17, 6 * MiB])  # odd write sizes across part edges
    with Wire(client) as wire:
        with storage.open_writer("big/shard.distcp") as stream:
            pos = 0
            while pos < len(data):
                n = next(sizes)
                stream.write(memoryview(data)[pos : pos + n])
                pos += n
        assert wire.count("CreateMultipartUpload") == 1
        assert wire.count("UploadPart") == 3  # 5 + 5 + 2.01 MiB
        assert wire.count("CompleteMultipartUpload") == 1
        assert wire.count("PutObject") == 0
    assert storage.list() == {"big/shard.distcp": len(data)}
    assert storage.read("big/shard.distcp") == data
    assert storage.read("big/shard.distcp", 5 * MiB - 10, 20) == data[5 * MiB - 10 : 5 * MiB + 10]
    assert _pending_uploads(moto_server, storage.bucket) == []


def test_exact_multiple_of_part_size(s3_root, client):
    storage = _writer_storage(s3_root, client)
    data = os.urandom(10 * MiB)
    with Wire(client) as wire:
        with storage.open_writer("even.bin") as stream:
            stream.write(data)
        assert wire.count("UploadPart") == 2
    assert storage.read("even.bin") == data


@pytest.mark.parametrize("written", [1000, 11 * MiB], ids=["before-threshold", "after-parts"])
def test_exception_in_writer_leaves_nothing(moto_server, s3_root, client, written):
    storage = _writer_storage(s3_root, client)
    with Wire(client) as wire:
        with pytest.raises(RuntimeError, match="boom"):
            with storage.open_writer("doomed.bin") as stream:
                stream.write(os.urandom(written))
                raise RuntimeError("boom")
        if written > 5 * MiB:
            assert wire.count("UploadPart") >= 1 and wire.count("AbortMultipartUpload") == 1
    assert storage.list() == {}
    assert _pending_uploads(moto_server, storage.bucket) == []


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


def test_failed_part_aborts_upload_with_storage_error(moto_server, s3_root, client):
    storage = _writer_storage(s3_root, client)

    def deny_second_part(op, request, n):
        if op == "UploadPart" and "partNumber=2" in request.url:
            return _fake_response(request, 403, _error_body("AccessDenied", "Access Denied"))
        return None

    with Wire(client) as wire:
        wire.rules.append(deny_second_part)
        with pytest.raises(StorageError) as info:
            with storage.open_writer("denied.bin") as stream:
                for _ in range(4):
                    stream.write(os.urandom(5 * MiB))
        assert wire.count("AbortMultipartUpload") == 1
    message = str(info.value)
    assert "upload part 2" in message and f"{s3_root}/denied.bin" in message and "AccessDenied" in message
    assert storage.list() == {}
    assert _pending_uploads(moto_server, storage.bucket) == []


# --------------------------------------------------------------------------------------
# Errors: mapping, retries, credentials never shown
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


def test_retries_exhausted_is_a_storage_error(s3_root):
    client = make_client(max_attempts=2)
    storage = S3Storage.from_uri(s3_root, client=client)
    with Wire(client) as wire:
        wire.rules.append(
            lambda op, req, n: _fake_response(req, 503, _error_body("SlowDown", "Please reduce your request rate."))
        )
        with pytest.raises(
            StorageError, match=r"S3 put failed for s3://.*/run/x: SlowDown \(HTTP 503\).*gave up after 2 attempts"
        ):
            storage.write("x", b"1")
        assert wire.count("PutObject") == 2


def test_body_that_breaks_off_is_retried(store, client):
    data = os.urandom(100_000)
    store.write("x.bin", data)
    state = {"broken": 0}

    def truncate_first_get(op, request, n):
        if op == "GetObject" and state["broken"] < 2:
            state["broken"] += 1
            # claims 100,000 bytes, delivers 10: the body read fails after botocore returned
            return _fake_response(
                request, 200, data[:10], {"content-length": str(len(data)), "content-type": "binary/octet-stream"}
            )
        return None

    with Wire(client) as wire:
        wire.rules.append(truncate_first_get)
        assert store.read("x.bin") == data
        assert wire.count("GetObject") == 3
    state["broken"] = -100  # always broken now: give up with a StorageError
    storage = S3Storage.from_uri(store.uri, client=client, read_retries=1)
    with Wire(client) as wire:
        wire.rules.append(truncate_first_get)
        with pytest.raises(StorageError, match=r"S3 get \(reading the body\) failed for s3://.*/run/x.bin"):
            storage.read("x.bin")
        assert wire.count("GetObject") == 2


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


@pytest.mark.parametrize("end", ["low", "high"])
def test_broken_body_back_off_doubles_up_to_8_seconds(store, client, monkeypatch, end):
    """Each retry of a broken-off body waits 0.2 s x 2**retry, capped at 8 s, times a jitter
    in [0.5, 1.0]; read_retries retries are made, then the read succeeds or fails."""
    data = os.urandom(1000)
    store.write("x.bin", data)
    storage = S3Storage.from_uri(store.uri, client=client, read_retries=6)
    sleeps = _record_sleeps(monkeypatch, end)
    with Wire(client) as wire:
        wire.rules.append(_broken_bodies(data, 6))
        assert storage.read("x.bin") == data
        assert wire.count("GetObject") == 7
    assert sleeps == pytest.approx([_JITTER[end] * base for base in (0.4, 0.8, 1.6, 3.2, 6.4, 8.0)])


def test_read_retries_zero_gives_up_on_the_first_broken_body(store, client, monkeypatch):
    """read_retries=0: a body that breaks off is a StorageError at once, without a wait."""
    data = os.urandom(1000)
    store.write("x.bin", data)
    storage = S3Storage.from_uri(store.uri, client=client, read_retries=0)
    sleeps = _record_sleeps(monkeypatch, "high")
    with Wire(client) as wire:
        wire.rules.append(_broken_bodies(data, 1))
        with pytest.raises(StorageError, match=r"S3 get \(reading the body\) failed for s3://.*/run/x.bin"):
            storage.read("x.bin")
        assert wire.count("GetObject") == 1
    assert sleeps == []


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
    EOFError with one."""
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
    held = "1024" if answer == "InvalidRange" else "5000"
    assert str(info.value) == f"{store.uri}/x: wanted 10 bytes at offset 5000, object holds {held}"


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


@pytest.mark.parametrize(
    "op,call,message",
    [
        ("GetObject", lambda s: s.read("x"), "S3 get failed for {uri}/x: ConnectionClosedError: "),
        (
            "PutObject",
            lambda s: s.create_exclusive("lock", b"mine"),
            "S3 conditional put failed for {uri}/lock: ConnectionClosedError: ",
        ),
        ("HeadObject", lambda s: s.read("x", 0, 0), "S3 head failed for {uri}/x: ConnectionClosedError: "),
    ],
    ids=["read", "create-exclusive", "read-nothing"],
)
def test_connection_failure_after_the_last_attempt_is_a_storage_error(s3_root, op, call, message):
    """A connection failure botocore gave up on (here: no retries left) is a StorageError
    naming the operation, the URI and the botocore error."""
    from botocore.exceptions import ConnectionClosedError

    client = make_client(max_attempts=1)
    storage = S3Storage.from_uri(s3_root, client=client)
    storage.write("x", b"1")

    def close(o, request, n):
        if o == op:
            raise ConnectionClosedError(endpoint_url=request.url)
        return None

    with Wire(client) as wire:
        wire.rules.append(close)
        with pytest.raises(StorageError) as info:
            call(storage)
        assert wire.count(op) == 1
    assert str(info.value).startswith(message.format(uri=storage.uri))


# --------------------------------------------------------------------------------------
# ckptlib.save / load and CheckpointManager on s3://
# --------------------------------------------------------------------------------------


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(7, 13)
        self.b = nn.Linear(13, 3, bias=False)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def _trained(seed: int, steps: int = 2):
    torch.manual_seed(seed)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    for i in range(steps):
        model(torch.randn(4, 7, generator=torch.Generator().manual_seed(i))).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def _assert_same(model_a, opt_a, model_b, opt_b):
    sd_a, sd_b = model_a.state_dict(), model_b.state_dict()
    assert sd_a.keys() == sd_b.keys()
    for k in sd_a:
        assert torch.equal(sd_a[k], sd_b[k]), k
    oa, ob = opt_a.state_dict(), opt_b.state_dict()
    assert oa["param_groups"] == ob["param_groups"]
    assert oa["state"].keys() == ob["state"].keys()
    for pid in oa["state"]:
        for name, value in oa["state"][pid].items():
            other = ob["state"][pid][name]
            assert torch.equal(value, other) if isinstance(value, torch.Tensor) else value == other, (pid, name)


def _fresh():
    torch.manual_seed(99)
    model = Net()
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def test_save_load_round_trip_bit_exact(moto_server, s3_root):
    model, opt = _trained(0)
    result = ckptlib.save(s3_root, {"model": model, "optim": opt, "epoch": 3}, step=7, metadata={"run": "s3"})
    assert result.uri == s3_root and result.step == 7
    bucket = s3_root.split("/")[2]
    assert _bucket_keys(moto_server, bucket) == {"run/ckptlib.json", "run/.metadata", "run/__0_0.distcp"}

    model2, opt2 = _fresh()
    state = {"model": model2, "optim": opt2, "epoch": 0}
    loaded = ckptlib.load(s3_root, state)
    assert (loaded.step, loaded.world_size, loaded.metadata, loaded.format) == (7, 1, {"run": "s3"}, "ckptlib")
    assert state["epoch"] == 3
    _assert_same(model, opt, model2, opt2)
    # one more step from both gives the same result: the optimizer state really was restored
    for m, o in ((model, opt), (model2, opt2)):
        m(torch.ones(2, 7)).sum().backward()
        o.step()
    _assert_same(model, opt, model2, opt2)


def test_save_load_with_multipart_shards(s3_root):
    torch.manual_seed(0)
    big = {"w": torch.randn(3 * MiB), "v": torch.randn(17)}  # a 12 MiB shard: 3 parts of 5 MiB
    storage = S3Storage.from_uri(s3_root, multipart_threshold=5 * MiB, part_size=5 * MiB, read_chunk_size=2 * MiB)
    with Wire(storage.client) as wire:
        ckptlib.save(storage, big)
        assert wire.count("UploadPart") == 3
        out = {"w": torch.zeros(3 * MiB), "v": torch.zeros(17)}
        ckptlib.load(storage, out)
    assert torch.equal(out["w"], big["w"]) and torch.equal(out["v"], big["v"])


def test_manager_retention_and_latest(moto_server, s3_root):
    manager = ckptlib.CheckpointManager(s3_root, keep_last=2)
    assert manager.latest() is None
    model, opt = _trained(0, steps=1)
    for step in range(1, 5):
        model.a.bias.data.fill_(float(step))
        manager.save(step, {"model": model, "optim": opt})
    bucket = s3_root.split("/")[2]
    expected = {"run/latest"} | {
        f"run/step_{s:010d}/{name}" for s in (3, 4) for name in ("ckptlib.json", ".metadata", "__0_0.distcp")
    }
    assert _bucket_keys(moto_server, bucket) == expected
    assert manager.storage.read_pointer("latest") == "step_0000000004"
    assert manager.steps() == [3, 4]
    assert manager.latest() == 4
    model2, opt2 = _fresh()
    assert manager.load({"model": model2, "optim": opt2}) == 4
    _assert_same(model, opt, model2, opt2)
    assert _pending_uploads(moto_server, bucket) == []


# A single-process save + load sends 14 requests today (save: list, PUT pending, PUT shard,
# PUT .metadata, list, PUT manifest, delete pending; load: 4 lists, GET manifest, GET .metadata,
# GET shard); the test asserts that the k-th one exists, so a change there shows up.
_FAULTS = ("slowdown", "internal", "reset")


@pytest.mark.parametrize("k,fault", [(k, _FAULTS[k % 3]) for k in range(1, 15)])
def test_transient_faults_are_retried(s3_root, client, k, fault):
    """The k-th request of save + load fails once (503 SlowDown, 500 InternalError or a
    connection reset); save and load both succeed and the state is bit-exact."""
    from botocore.exceptions import ConnectionClosedError

    storage = S3Storage.from_uri(s3_root, client=client)
    model, opt = _trained(1)

    def fail_kth(op, request, n):
        if n != k:
            return None
        if fault == "slowdown":
            return _fake_response(request, 503, _error_body("SlowDown", "Please reduce your request rate."))
        if fault == "internal":
            return _fake_response(request, 500, _error_body("InternalError", "We encountered an internal error."))
        raise ConnectionClosedError(endpoint_url=request.url)

    with Wire(client) as wire:
        wire.rules.append(fail_kth)
        ckptlib.save(storage, {"model": model, "optim": opt}, step=1)
        model2, opt2 = _fresh()
        assert ckptlib.load(storage, {"model": model2, "optim": opt2}).step == 1
        assert len(wire.injected) == 1 and len(wire.requests) > k
    _assert_same(model, opt, model2, opt2)


def test_permanent_403_on_manifest_keeps_previous_latest(moto_server, s3_root):
    manager = ckptlib.CheckpointManager(s3_root, keep_last=2)
    model, opt = _trained(0, steps=1)
    manager.save(1, {"model": model, "optim": opt})
    saved = {k: v.clone() for k, v in model.state_dict().items()}

    def deny_manifest(op, request, n):
        if op == "PutObject" and request.url.endswith("/ckptlib.json"):
            return _fake_response(request, 403, _error_body("AccessDenied", "Access Denied"))
        return None

    model.a.bias.data.fill_(42.0)
    with Wire(manager.storage.client) as wire:
        wire.rules.append(deny_manifest)
        with pytest.raises(CheckpointError) as info:
            manager.save(2, {"model": model, "optim": opt})
        assert wire.count("PutObject") >= 3 and len(wire.injected) == 1  # permanent: not retried
    err = info.value
    assert isinstance(err, StorageError)
    assert str(err).startswith(f"S3 put failed for {s3_root}/step_0000000002/ckptlib.json: AccessDenied (HTTP 403)")
    assert "testing" not in str(err)
    assert manager.storage.read_pointer("latest") == "step_0000000001"
    assert manager.latest() == 1 and manager.steps() == [1]
    model2, opt2 = _fresh()
    assert manager.load({"model": model2, "optim": opt2}) == 1
    for k, v in saved.items():
        assert torch.equal(model2.state_dict()[k], v), k
    # the failed step is debris: the next save's retention removes it
    manager.save(3, {"model": model, "optim": opt})
    bucket = s3_root.split("/")[2]
    assert {k.split("/")[1] for k in _bucket_keys(moto_server, bucket)} == {
        "latest",
        "step_0000000001",
        "step_0000000003",
    }
