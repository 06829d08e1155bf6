"""One conformance suite for the `Storage` interface, run by every backend: local disk, S3
(moto), GCS (fake-gcs-server) and Azure Blob (Azurite), each on a real server on 127.0.0.1.

Remote backends run with small transfer sizes (5 MiB parts, 1 MiB read chunks) so multipart
uploads and parallel ranged reads happen at test sizes.
"""

from __future__ import annotations

import os
import pickle
import random
import threading

import pytest

from ckptlib.errors import StorageError
from ckptlib.storage import LocalStorage, open_storage
from ckptlib.storage.base import Storage, SupportsCreateExclusive

MiB = 1 << 20
BACKENDS = [
    pytest.param("local", id="local"),
    pytest.param("s3", id="s3", marks=pytest.mark.s3),
    pytest.param("gcs", id="gcs", marks=pytest.mark.gcs),
    pytest.param("azure", id="azure", marks=pytest.mark.azure),
]
_ROOT_FIXTURES = {"s3": "s3_root", "gcs": "gcs_root", "azure": "azure_root"}


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


def payload(n: int, seed: int = 0) -> bytes:
    return random.Random(seed).randbytes(n)


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
    assert store.read("d/obj.bin", 7, 0) == b""


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


def test_exists_list_and_sizes(store):
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
    with pytest.raises(StorageError):
        store.set_pointer("latest", "../elsewhere")
    assert store.read_pointer("latest") == "step_10"


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


@pytest.mark.parametrize("path", ["../x", "/abs", "a//b", "a/./b", "a/../../b", ""])
def test_paths_that_escape_the_root_are_rejected(store, path):
    for call in (
        lambda: store.write(path, b"x"),
        lambda: store.read(path),
        lambda: store.child(path),
        lambda: store.set_pointer(path, "t"),
    ):
        with pytest.raises(StorageError):
            call()


def test_names_with_spaces_and_unicode(store):
    name = "dir with space/tensor+1 ü.bin"
    store.write(name, b"odd")
    assert store.list() == {name: 3}
    assert bytes(store.read(name, 1, 2)) == b"dd"
    assert store.list_children() == ["dir with space"]


def test_pickled_storage_reaches_the_same_objects(store):
    store.write("p", b"pickled")
    clone = pickle.loads(pickle.dumps(store))
    assert clone.uri == store.uri
    assert bytes(clone.read("p")) == b"pickled"


def test_uri_names_the_root(store, root, backend):
    expected = os.path.abspath(root) if backend == "local" else root
    assert store.uri == expected
