"""One conformance suite for the `Storage` interface, run by every backend: local disk, S3
(moto), GCS (fake-gcs-server) and Azure Blob (Azurite), each on a real server on 127.0.0.1.
The second half is what every object store does the same way (they share one implementation,
`ckptlib.storage.objects`): its requests, retries and back-off, transfer settings and errors,
observed and failed at the client seam each backend provides (helpers.storage.Faults).

Remote backends run with small transfer sizes (5 MiB parts, 1 MiB read chunks) so multipart
uploads and parallel ranged reads happen at test sizes.
"""

from __future__ import annotations

import importlib
import os
import pickle
import random
import threading

import pytest
import torch
from helpers.storage import JITTER, LABELS, Faults, permanent_error, record_sleeps, transient_error

import ckptlib
from ckptlib.errors import StorageError
from ckptlib.storage import LocalStorage, open_storage
from ckptlib.storage.base import Storage, SupportsCreateExclusive
from ckptlib.storage.objects import Exists

MiB = 1 << 20
REMOTE = [
    pytest.param("s3", id="s3", marks=pytest.mark.s3),
    pytest.param("gcs", id="gcs", marks=pytest.mark.gcs),
    pytest.param("azure", id="azure", marks=pytest.mark.azure),
]
BACKENDS = [pytest.param("local", id="local"), *REMOTE]
_ROOT_FIXTURES = {"s3": "s3_root", "gcs": "gcs_root", "azure": "azure_root"}
_CLASSES = {
    "s3": ("ckptlib.storage.s3", "S3Storage"),
    "gcs": ("ckptlib.storage.gcs", "GCSStorage"),
    "azure": ("ckptlib.storage.azure", "AzureStorage"),
}


def small_transfers(storage):
    """The same storage with 5 MiB parts and 1 MiB read chunks (multipart at test sizes)."""
    if not isinstance(storage, LocalStorage):
        storage.multipart_threshold = 5 * MiB
        storage.part_size = 5 * MiB
        storage.read_chunk_size = 1 * MiB
    return storage


@pytest.fixture(params=BACKENDS)
def backend(request) -> str:
    return request.param


@pytest.fixture
def root(backend, request, tmp_path) -> str:
    if backend == "local":
        return str(tmp_path / "run")
    return request.getfixturevalue(_ROOT_FIXTURES[backend])


@pytest.fixture
def store(root) -> Storage:
    return small_transfers(open_storage(root))


@pytest.fixture(params=REMOTE)
def cloud(request) -> str:
    return request.param


@pytest.fixture
def cloud_root(cloud, request) -> str:
    return request.getfixturevalue(_ROOT_FIXTURES[cloud])


@pytest.fixture
def cloud_store(cloud_root):
    return small_transfers(open_storage(cloud_root))


@pytest.fixture
def faults(cloud_store, monkeypatch) -> Faults:
    """Every request of `cloud_store` (and of any storage of its class made from now on)."""
    return Faults.install(monkeypatch, cloud_store)


def storage_class(cloud: str):
    module, name = _CLASSES[cloud]
    return getattr(importlib.import_module(module), name)


def payload(n: int, seed: int = 0) -> bytes:
    return random.Random(seed).randbytes(n)


def noun(store) -> str:
    return "file" if isinstance(store, LocalStorage) else "object"


def test_is_a_storage_with_exclusive_create(store):
    assert isinstance(store, Storage) and isinstance(store, SupportsCreateExclusive)


def test_write_then_read_whole_and_ranges(store):
    data = payload(100_000)
    store.write("d/obj.bin", data)
    assert bytes(store.read("d/obj.bin")) == data
    assert bytes(store.read("d/obj.bin", 0, 1)) == data[:1]
    assert bytes(store.read("d/obj.bin", 12_345, 678)) == data[12_345:13_023]
    assert bytes(store.read("d/obj.bin", 99_999, 1)) == data[-1:]
    assert bytes(store.read("d/obj.bin", 50_000)) == data[50_000:]
    assert bytes(store.read("d/obj.bin", 100_000)) == b""
    assert bytes(store.read("d/obj.bin", 0, 100_000)) == data
    assert store.read("d/obj.bin", 7, 0) == b""
    with pytest.raises(EOFError) as info:
        store.read("d/obj.bin", 99_000, 2000)
    assert str(info.value) == f"{store.uri}/d/obj.bin: wanted 2000 bytes at offset 99000, {noun(store)} holds 100000"


def test_overwrite_replaces_the_whole_object(store):
    store.write("o", payload(5000, 1))
    store.write("o", b"short")
    assert bytes(store.read("o")) == b"short"
    assert store.list() == {"o": 5}


def test_empty_object(store):
    store.write("empty", b"")
    assert bytes(store.read("empty")) == b""
    assert store.read("empty", 0, 0) == b""
    assert store.list() == {"empty": 0}
    with pytest.raises(EOFError):
        store.read("empty", 0, 1)


def test_missing_object_is_file_not_found(store):
    store.write("present", b"x")
    for call in (
        lambda: store.read("absent"),
        lambda: store.read("absent", 0, 4),
        lambda: store.read("absent", 0, 0),
        lambda: store.read("dir/absent", 3),
    ):
        with pytest.raises(FileNotFoundError):
            call()


def test_read_past_the_end_is_eof(store):
    store.write("five", b"01234")
    with pytest.raises(EOFError, match="five"):
        store.read("five", 3, 10)
    with pytest.raises(EOFError):
        store.read("five", 5, 1)
    assert bytes(store.read("five", 5)) == b""


def test_exists_list_and_sizes(store, root):
    assert not store.exists()
    assert store.list() == {}
    assert store.list_children() == []
    store.write("a/x.bin", b"1")
    store.write("a/y/z.bin", b"22")
    store.write("top", b"333")
    assert store.exists()
    assert store.list() == {"a/x.bin": 1, "a/y/z.bin": 2, "top": 3}
    assert store.list("a/") == {"a/x.bin": 1, "a/y/z.bin": 2}
    assert store.list("a/y") == {"a/y/z.bin": 2}
    assert store.list("t") == {"top": 3}
    assert store.list_children() == ["a"]
    assert not open_storage(root + "x").exists()  # a sibling whose name merely starts with ours


def test_prefixes_that_are_substrings_of_other_prefixes(store):
    """step_1 must never see step_10's objects (list, children, delete_tree, exists)."""
    for step in ("step_1", "step_10", "step_1x"):
        store.write(f"{step}/data", step.encode())
    assert store.list("step_1/") == {"step_1/data": 6}
    assert store.list_children() == ["step_1", "step_10", "step_1x"]
    child = store.child("step_1")
    assert child.list() == {"data": 6}
    assert child.list_children() == []
    store.delete_tree("step_1")
    assert store.list() == {"step_10/data": 7, "step_1x/data": 7}
    assert not store.child("step_1").exists() and store.child("step_10").exists()
    assert store.list_children() == ["step_10", "step_1x"]


def test_child_is_rooted_below(store):
    child = store.child("run/step_5")
    child.write("f", b"abc")
    assert store.list() == {"run/step_5/f": 3}
    assert bytes(store.read("run/step_5/f")) == b"abc"
    assert child.uri.rstrip("/").endswith("run/step_5")
    assert store.list_children() == ["run"]


def test_delete_ignores_absent_and_delete_tree_everything(store):
    store.write("a", b"1")
    store.write("b", b"2")
    store.delete(["a", "never-written", "a"])
    assert store.list() == {"b": 1}
    store.write("t/u/v", b"3")
    store.delete_tree("t")
    assert store.list() == {"b": 1}
    store.delete_tree("not-there")
    store.delete_tree()
    assert store.list() == {} and not store.exists()


def test_create_exclusive(store):
    assert store.create_exclusive("lock", b"token-1") is True
    assert store.create_exclusive("lock", b"token-2") is False
    assert bytes(store.read("lock")) == b"token-1"
    store.delete(["lock"])
    assert store.create_exclusive("lock", b"token-3") is True
    assert bytes(store.read("lock")) == b"token-3"


def test_create_exclusive_has_one_winner_among_concurrent_callers(store):
    results: dict[int, bool] = {}
    barrier = threading.Barrier(6)

    def contend(i: int) -> None:
        barrier.wait()
        results[i] = store.create_exclusive("race", f"token-{i}".encode())

    threads = [threading.Thread(target=contend, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    winners = [i for i, won in results.items() if won]
    assert len(results) == 6 and len(winners) == 1
    assert bytes(store.read("race")) == f"token-{winners[0]}".encode()


def test_pointer(store):
    assert store.read_pointer("latest") is None
    store.write("step_1/x", b"1")
    store.set_pointer("latest", "step_1")
    assert store.read_pointer("latest") == "step_1"
    store.set_pointer("latest", "step_10")
    assert store.read_pointer("latest") == "step_10"
    for bad in ("../elsewhere", "/abs", ""):
        with pytest.raises(StorageError):
            store.set_pointer("latest", bad)
    assert store.read_pointer("latest") == "step_10"
    assert store.list_children() == ["step_1"]  # a pointer is not a child
    if not isinstance(store, LocalStorage):  # an object holding the name (local: a symlink)
        assert bytes(store.read("latest")) == b"step_10"


def test_pointer_that_is_not_utf8_is_a_storage_error(store):
    """A `latest` holding bytes that are not UTF-8 (written by something else) is a StorageError
    naming it, not a UnicodeDecodeError."""
    store.write("latest", b"step_\xff\xfe")
    with pytest.raises(StorageError) as info:
        store.read_pointer("latest")
    assert str(info.value) == f"{store.uri}/latest: pointer {noun(store)} is not UTF-8 text"
    assert isinstance(info.value.__cause__, UnicodeDecodeError)


@pytest.mark.parametrize("size", [0, 1000, 5 * MiB, 13 * MiB + 7], ids=["empty", "small", "one-part", "3-parts"])
def test_stream_writer_round_trips_byte_exact(store, size):
    data = payload(size, 2)
    rng = random.Random(3)
    with store.open_writer("s/stream.bin") as stream:
        pos = 0
        while pos < size:
            n = rng.randint(1, 3 * MiB)
            stream.write(memoryview(data)[pos : pos + n])
            pos += n
    store.sync([], names_only=["s/stream.bin"])
    assert store.list("s/") == {"s/stream.bin": size}
    assert bytes(store.read("s/stream.bin")) == data


def test_large_ranged_read_across_many_chunks(store):
    data = payload(11 * MiB + 3, 4)
    store.write("big", data)
    assert bytes(store.read("big", 3, 11 * MiB)) == data[3 : 11 * MiB + 3]
    assert bytes(store.read("big", 0, len(data))) == data
    with pytest.raises(EOFError):
        store.read("big", MiB, 11 * MiB)


@pytest.mark.parametrize("written", [1000, 11 * MiB], ids=["before-threshold", "after-parts"])
def test_exception_in_stream_writer_leaves_no_object(store, written):
    store.write("keep", b"k")
    with pytest.raises(RuntimeError, match="boom"):
        with store.open_writer("doomed") as stream:
            stream.write(payload(written, 5))
            raise RuntimeError("boom")
    assert store.list() == {"keep": 1}
    with pytest.raises(FileNotFoundError):
        store.read("doomed")


@pytest.mark.parametrize("path", ["../x", "/abs", "a//b", "a/./b", "a/../../b", "", "..\\win"])
def test_paths_that_escape_the_root_are_rejected(store, path):
    for call in (
        lambda: store.write(path, b"x"),
        lambda: store.read(path),
        lambda: store.child(path),
        lambda: store.set_pointer(path, "t"),
        lambda: store.read_pointer(path),
        lambda: store.delete([path]),
        lambda: store.open_writer(path).__enter__(),
        lambda: store.create_exclusive(path, b"x"),
    ):
        with pytest.raises(StorageError):
            call()


@pytest.mark.parametrize(
    "call",
    [
        lambda s: s.write("../outside", b"x"),
        lambda s: s.write("a/../../outside", b"x"),
        lambda s: s.read("../outside"),
        lambda s: s.list("../"),
        lambda s: s.list("a/../"),
        lambda s: s.delete(["ok", "../outside"]),
        lambda s: s.delete_tree(".."),
        lambda s: s.set_pointer("../latest", "x"),
        lambda s: s.read_pointer("../latest"),
        lambda s: s.create_exclusive("../lock", b"x"),
    ],
    ids=[
        "write",
        "write-climbing",
        "read",
        "list",
        "list-climbing",
        "delete",
        "delete-tree",
        "set-pointer",
        "read-pointer",
        "create-exclusive",
    ],
)
def test_nothing_outside_the_root_is_touched(store, root, call):
    """A call naming a path outside the root is refused before anything is done: the root's
    objects and the one beside it are as they were."""
    outside = open_storage(root.rsplit("/", 1)[0])
    outside.write("outside", b"theirs")
    store.write("ok", b"keep")
    with pytest.raises(StorageError, match="escapes|invalid"):
        call(store)
    assert outside.list() == {"outside": 6, "run/ok": 4}


def test_names_with_spaces_and_unicode(store):
    name = "dir with space/tensor+1 ü.bin"
    store.write(name, b"odd")
    assert store.list() == {name: 3}
    assert bytes(store.read(name, 1, 2)) == b"dd"
    assert store.list_children() == ["dir with space"]


def test_pickled_storage_reaches_the_same_objects(store):
    store.write("p", b"pickled")  # a storage that has made its client still pickles: without it
    clone = pickle.loads(pickle.dumps(store))
    assert clone.uri == store.uri
    assert bytes(clone.read("p")) == b"pickled"
    if not isinstance(store, LocalStorage):
        assert clone._options() == store._options()


def test_uri_names_the_root(store, root, backend):
    expected = os.path.abspath(root) if backend == "local" else root
    assert store.uri == expected


# -- what every object store does the same way: requests, retries, settings, errors ----------


def test_transfer_settings_come_from_the_backends_table_within_its_ranges(cloud):
    """Unset settings are the backend's table's; the ends of each range are accepted; one step
    outside, each setting alone, is refused with a message naming it and its range."""
    cls = storage_class(cloud)
    table = cls.DEFAULTS

    def make(**options):
        return cls("bucket-name", "run", **options)

    assert make()._options() == {**table.defaults(), "backoff_base": 0.1, "backoff_cap": 8.0}
    lowest = {
        "multipart_threshold": 1,
        "part_size": table.min_part_size,
        "max_concurrency": 1,
        "read_chunk_size": 1,
        "max_attempts": 1,
    }
    assert {k: v for k, v in make(**lowest)._options().items() if k in lowest} == lowest
    highest = {"multipart_threshold": table.max_put_size, "part_size": table.max_part_size}
    for option, value in highest.items():
        if value is not None:
            assert getattr(make(**{option: value}), option) == value
    part_range = f"[{table.min_part_size}, {table.max_part_size}]" if table.max_part_size else None
    put_range = f"[1, {table.max_put_size}]" if table.max_put_size else None
    refused = [
        ("multipart_threshold", 0, f"within {put_range}" if put_range else ">= 1"),
        ("part_size", table.min_part_size - 1, f"within {part_range} bytes" if part_range else ">= 1 bytes"),
        ("max_concurrency", 0, ">= 1"),
        ("read_chunk_size", 0, ">= 1"),
        ("max_attempts", 0, ">= 1"),
    ]
    if put_range:
        refused.append(("multipart_threshold", table.max_put_size + 1, f"within {put_range}"))
    if part_range:
        refused.append(("part_size", table.max_part_size + 1, f"within {part_range} bytes"))
    for option, value, allowed in refused:
        with pytest.raises(ValueError) as info:
            make(**{option: value})
        assert str(info.value) == f"{option} must be {allowed}, got {value}"


def test_the_smallest_settings_work(cloud, cloud_root):
    storage = storage_class(cloud).from_uri(
        cloud_root,
        multipart_threshold=1,
        max_concurrency=1,
        read_chunk_size=1,
        max_attempts=1,
        part_size=storage_class(cloud).DEFAULTS.min_part_size,
    )
    storage.write("x", b"abc")
    assert bytes(storage.read("x")) == b"abc" and bytes(storage.read("x", 0, 3)) == b"abc"
    with storage.open_writer("y") as stream:
        stream.write(b"defg")
    assert bytes(storage.read("y", 1, 3)) == b"efg"


def test_transfer_settings_from_the_environment(cloud, monkeypatch):
    """CKPTLIB_<S3|GS|AZ>_<SETTING> set what from_uri does not; keyword arguments win."""
    scheme = {"s3": "S3", "gcs": "GS", "azure": "AZ"}[cloud]
    uri = {"s3": "s3://bucket-name/run", "gcs": "gs://bucket-name/run", "azure": "az://bucket-name/run"}[cloud]
    settings = {"MULTIPART_THRESHOLD": 7 * MiB, "PART_SIZE": 6 * MiB, "MAX_CONCURRENCY": 3}
    settings.update({"READ_CHUNK_SIZE": 2 * MiB, "MAX_ATTEMPTS": 5})
    for name, value in settings.items():
        monkeypatch.setenv(f"CKPTLIB_{scheme}_{name}", str(value))
    storage = storage_class(cloud).from_uri(uri, max_concurrency=2)
    expected = {name.lower(): value for name, value in settings.items()}
    assert {k: v for k, v in storage._options().items() if k in expected} == {**expected, "max_concurrency": 2}
    monkeypatch.setenv(f"CKPTLIB_{scheme}_PART_SIZE", "6MiB")
    with pytest.raises(StorageError, match=f"CKPTLIB_{scheme}_PART_SIZE='6MiB' is not an integer"):
        storage_class(cloud).from_uri(uri)


def test_small_writes_and_streams_are_one_put(cloud_store, faults):
    cloud_store.write("w", payload(6 * MiB))  # over the multipart threshold: write is still one request
    with cloud_store.open_writer("small.bin") as stream:
        for _ in range(10):
            stream.write(b"abc" * 1000)
        assert stream.tell() == 30000
    assert faults.names() == ["put", "put"]
    assert bytes(cloud_store.read("small.bin")) == b"abc" * 10000


@pytest.mark.parametrize("size,parts", [(10 * MiB, 2), (12 * MiB + 12345, 3)], ids=["2-whole-parts", "3-parts"])
def test_stream_is_parts_then_one_complete(cloud_store, faults, size, parts):
    data = payload(size, 6)
    with cloud_store.open_writer("big/shard.distcp") as stream:
        pos = 0
        for n in [1, 999_999, 3 * MiB + 7, 17, 6 * MiB] * 3:  # odd write sizes across part edges
            stream.write(memoryview(data)[pos : pos + n])
            pos += n
        stream.write(memoryview(data)[pos:])
    assert (faults.count("put"), faults.count("start_upload"), faults.count("complete")) == (0, 1, 1)
    assert sorted(set(faults.keys("put_part"))) == list(range(1, parts + 1))
    assert cloud_store.list() == {"big/shard.distcp": size}
    assert bytes(cloud_store.read("big/shard.distcp")) == data


def test_exception_in_stream_after_parts_aborts_the_upload(cloud_store, faults):
    with pytest.raises(RuntimeError, match="boom"):
        with cloud_store.open_writer("doomed") as stream:
            stream.write(payload(11 * MiB, 5))
            raise RuntimeError("boom")
    assert faults.count("put_part") >= 1 and faults.count("abort") == 1 and faults.count("complete") == 0
    assert cloud_store.list() == {}


def test_failed_part_aborts_the_upload_with_a_storage_error(cloud, cloud_store, faults):
    faults.fail("put_part", lambda: permanent_error(cloud), when=lambda number, n: number == 2)
    with pytest.raises(StorageError) as info:
        with cloud_store.open_writer("denied.bin") as stream:
            for _ in range(4):
                stream.write(payload(5 * MiB, 7))
    assert str(info.value).startswith(f"{LABELS[cloud]} upload part 2 failed for {cloud_store.uri}/denied.bin: ")
    assert faults.count("abort") == 1 and faults.count("complete") == 0
    assert cloud_store.list() == {}


def test_large_range_is_read_as_parallel_chunks(cloud_store, faults):
    cloud_store.read_chunk_size, cloud_store.max_concurrency = MiB, 3
    data = payload(5 * MiB + 321, 8)
    cloud_store.write("x.bin", data)
    assert bytes(cloud_store.read("x.bin", 1234, 4 * MiB)) == data[1234 : 1234 + 4 * MiB]
    ranges = {(start, end) for _key, start, end in faults.keys("get")}  # a set: a retried GET is one range
    assert ranges == {(1234 + a, 1234 + a + MiB - 1) for a in range(0, 4 * MiB, MiB)}  # four 1 MiB ranges
    with pytest.raises(EOFError) as info:
        cloud_store.read("x.bin", 2 * MiB, 4 * MiB)
    assert (
        str(info.value)
        == f"{cloud_store.uri}/x.bin: wanted {4 * MiB} bytes at offset {2 * MiB}, object holds {len(data)}"
    )


@pytest.mark.parametrize("end", ["low", "high"])
def test_transient_failures_are_retried_with_doubling_back_off(cloud_store, faults, monkeypatch, end):
    """Each retry waits backoff_base (0.1 s) x 2**(try - 1), at most backoff_cap (8 s), times a
    jitter in [0.5, 1.0]; max_attempts tries in all, then the request succeeds or fails."""
    cloud_store.write("x", b"data")
    cloud_store.max_attempts = 10
    sleeps = record_sleeps(monkeypatch, end)
    faults.fail("get", transient_error, times=9)
    assert bytes(cloud_store.read("x")) == b"data"
    assert faults.count("get") == 10
    bases = [0.1, 0.2, 0.4, 0.8, 1.6, 3.2, 6.4, 8.0, 8.0]
    assert sleeps == pytest.approx([JITTER[end] * base for base in bases])


def test_retries_exhausted_is_a_storage_error(cloud, cloud_store, faults, monkeypatch):
    cloud_store.max_attempts = 2
    sleeps = record_sleeps(monkeypatch)
    faults.fail("put", transient_error)
    with pytest.raises(StorageError) as info:
        cloud_store.write("x", b"1")
    message = str(info.value)
    assert message.startswith(f"{LABELS[cloud]} put failed for {cloud_store.uri}/x: ")
    assert message.endswith("connection reset by peer (injected) (gave up after 2 attempts)")
    assert faults.count("put") == 2 and len(sleeps) == 1


@pytest.mark.parametrize(
    "request_,op,call",
    [
        ("get", "get", lambda s: s.read("x")),
        ("put", "conditional put", lambda s: s.create_exclusive("lock", b"mine")),
        ("size", "head", lambda s: s.read("x", 0, 0)),
        ("list", "list", lambda s: s.list()),
        ("delete", "delete", lambda s: s.delete(["x"])),
        ("put", "put pointer", lambda s: s.set_pointer("latest", "x")),
    ],
    ids=["read", "create-exclusive", "read-nothing", "list", "delete", "set-pointer"],
)
@pytest.mark.parametrize("fault", ["permanent", "transient-on-the-last-try"])
def test_a_failure_that_is_not_retried_is_a_storage_error_at_once(
    cloud, cloud_store, faults, monkeypatch, request_, op, call, fault
):
    """A permanent error, or a transient one with no try left (max_attempts=1), is a
    StorageError after one request, without a wait, naming the operation and the object."""
    cloud_store.write("x", b"1")
    faults.calls.clear()
    sleeps = record_sleeps(monkeypatch)
    if fault == "permanent":
        faults.fail(request_, lambda: permanent_error(cloud))
    else:
        cloud_store.max_attempts = 1
        faults.fail(request_, transient_error)
    with pytest.raises(StorageError) as info:
        call(cloud_store)
    where = cloud_store.uri if op == "list" else f"{cloud_store.uri}/{'lock' if 'conditional' in op else 'x'}"
    if op == "put pointer":
        where = f"{cloud_store.uri}/latest"
    assert str(info.value).startswith(f"{LABELS[cloud]} {op} failed for {where}: ")
    assert "gave up" not in str(info.value)
    assert faults.count(request_) == 1 and sleeps == []


def test_create_exclusive_sends_again_when_the_taken_object_vanished(cloud_store, faults):
    """'Taken' whose object is gone by the time it is read (deleted meanwhile) is no answer:
    the conditional put is sent again and creates the object."""
    faults.fail("put", Exists, times=1)
    assert cloud_store.create_exclusive("lock", b"mine") is True
    assert faults.names() == ["put", "get", "put"]
    assert bytes(cloud_store.read("lock")) == b"mine"


def test_create_exclusive_of_the_same_bytes_is_ours(cloud_store):
    """A conditional put retried after its first answer was lost finds its own object: the
    bytes (a lock token) are the caller's, so the call succeeded."""
    assert cloud_store.create_exclusive("lock", b"token-3") is True
    assert cloud_store.create_exclusive("lock", b"token-3") is True
    assert cloud_store.create_exclusive("lock", b"token-4") is False


def test_delete_tree_removes_what_looks_committed_first(cloud_store, faults):
    names = ["step_1/ckptlib.json", "step_1/.metadata", "step_1/__0_0.distcp", "step_1/__1_0.distcp"]
    for name in [*names, "step_10/ckptlib.json", "keep.txt"]:
        cloud_store.write(name, b"data")
    faults.calls.clear()
    cloud_store.delete_tree("step_1")
    deleted = faults.keys("delete")
    assert deleted[:2] == [["run/step_1/ckptlib.json"], ["run/step_1/.metadata"]]
    assert sorted(k for keys in deleted[2:] for k in keys) == ["run/step_1/__0_0.distcp", "run/step_1/__1_0.distcp"]
    assert faults.keys("abort_uploads") == ["run/step_1/"]
    assert cloud_store.list() == {"step_10/ckptlib.json": 4, "keep.txt": 4}


def test_list_children_skips_names_a_key_cannot_make(cloud, cloud_store):
    """Keys other tools may write below the root with an empty, '.' or '..' segment make no
    child of that name (Azure normalizes '.' and '..' segments away: no such blob exists)."""
    odd = ("run//x",) if cloud == "azure" else ("run//x", "run/./x", "run/../x")
    for key in (*odd, "run/a/b"):
        cloud_store.api.put(key, b"1")
    assert cloud_store.list_children() == ["a"]


def test_every_request_of_a_save_and_load_may_fail_once(cloud_store, faults, monkeypatch):
    """A save and a load, once for each of their requests (counted in a first run): that request
    fails transiently once, is retried, and the state comes back bit-exact."""
    record_sleeps(monkeypatch)
    state = {"w": torch.arange(1000, dtype=torch.float32), "n": torch.tensor([7, 9])}

    def save_and_load(uri_storage) -> None:
        ckptlib.save(uri_storage, state, step=3)
        out = {k: torch.zeros_like(v) for k, v in state.items()}
        assert ckptlib.load(uri_storage, out).step == 3
        for k in state:
            assert torch.equal(out[k], state[k]), k

    save_and_load(cloud_store.child("dry-run"))
    requests = len(faults.names())  # the tries of a request the emulator made us retry count once
    assert requests >= 10
    for k in range(1, requests + 1):
        faults.calls.clear()
        faults.rules.clear()
        faults.injected.clear()
        faults.fail("*", transient_error, when=lambda key, n, k=k: n == k, times=1)
        save_and_load(cloud_store.child(f"k{k}"))
        assert len(faults.injected) == 1, k
