"""s3://, gs:// and az:// end to end, on moto, fake-gcs-server and Azurite started by the tests:
save/load, CheckpointManager retention and `latest`, save-at-N/load-at-M, the CLI, and faults
(503 bursts, the server stopping mid-upload) injected by a proxy between ckptlib and the
emulator, or a permanent error on one object injected at the client (helpers.storage.Faults).
S3's save-at-N/load-at-M and `ckpt validate` cases are in tests/elastic/test_s3_elastic.py and
tests/cli/.
"""

from __future__ import annotations

import functools
import json

import pytest
import torch
from helpers.storage import LABELS, Faults, permanent_error

import ckptlib
from ckptlib._torch import parallel
from ckptlib.errors import CheckpointError, StorageError
from ckptlib.storage import is_remote, open_storage
from ckptlib.testing.fakes import emulators as em
from ckptlib.testing.fakes.faultproxy import FaultProxy
from ckptlib.testing.fakes.s3_server import s3_env
from ckptlib.testing.matrices import matrix as mx

MiB = 1 << 20
GCS_AZURE = [
    pytest.param("gcs", id="gcs", marks=pytest.mark.gcs),
    pytest.param("azure", id="azure", marks=pytest.mark.azure),
]
CLOUDS = [pytest.param("s3", id="s3", marks=pytest.mark.s3), *GCS_AZURE]
_SERVERS = {"s3": "moto_server", "gcs": "gcs_server", "azure": "azurite_server"}
_ROOTS = {"s3": "s3_root", "gcs": "gcs_root", "azure": "azure_root"}


@pytest.fixture(params=CLOUDS)
def cloud(request) -> str:
    return request.param


@pytest.fixture
def server(cloud, request) -> str:
    return request.getfixturevalue(_SERVERS[cloud])


@pytest.fixture
def root(cloud, request) -> str:
    return request.getfixturevalue(_ROOTS[cloud])


def env_for(cloud: str, endpoint: str) -> dict[str, str | None]:
    return {"s3": s3_env, "gcs": em.gcs_env, "azure": em.azure_env}[cloud](endpoint)


def scheme(cloud: str) -> str:
    return {"s3": "S3", "gcs": "GS", "azure": "AZ"}[cloud]


def part_size(cloud: str) -> int:
    """The smallest part the tests use: 1 MiB, or S3's smallest allowed (5 MiB)."""
    return 5 * MiB if cloud == "s3" else MiB


def keys(root: str) -> set[str]:
    """Every object below the bucket/container holding `root`, as 'prefix/...' keys (ckptlib's view)."""
    container = root.split("/")[2]
    base = root.split("://")[0] + "://" + container
    return set(open_storage(base).list())


def tensors(seed: int, n: int = 1000) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(n, generator=g), "b": torch.randint(0, 1 << 30, (17,), generator=g)}


def assert_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_uris(cloud):
    assert is_remote("s3://b/x") and is_remote("gs://b/x") and is_remote("az://c/x") and not is_remote("/tmp/x")
    good = {"s3": "s3://my-bucket/a/b/", "gcs": "gs://my-bucket/a/b/", "azure": "az://my-container/a/b/"}[cloud]
    storage = open_storage(good)
    assert storage.uri == good.rstrip("/") and storage.prefix == "a/b"
    assert storage.child("step_1").uri == good + "step_1"
    assert storage.local_path() is None and storage.local_path("x") is None
    bad = {"s3": "s3://Bad_Bucket!/x", "gcs": "gs://Bad_Bucket!/x", "azure": "az://Bad--Container/x"}[cloud]
    with pytest.raises(StorageError, match="invalid"):
        open_storage(bad)
    with pytest.raises(StorageError, match="escapes"):
        open_storage(good + "../up")
    with pytest.raises(StorageError, match=r"unsupported URI scheme .*gs://.*az://"):
        open_storage("hdfs://x/y")


def test_save_load_round_trip_bit_exact(root):
    state = tensors(0)
    result = ckptlib.save(root, state, step=7, metadata={"cloud": root[:2]})
    assert result.uri == root and result.step == 7
    prefix = root.split("/", 3)[3]
    assert keys(root) == {f"{prefix}/ckptlib.json", f"{prefix}/.metadata", f"{prefix}/__0_0.distcp"}
    out = {k: torch.zeros_like(v) for k, v in state.items()}
    loaded = ckptlib.load(root, out)
    assert (loaded.step, loaded.world_size, loaded.metadata) == (7, 1, {"cloud": root[:2]})
    assert_equal(out, state)


def test_multipart_shard_round_trips(root, cloud, monkeypatch):
    part = part_size(cloud)
    monkeypatch.setenv(f"CKPTLIB_{scheme(cloud)}_MULTIPART_THRESHOLD", str(part))
    monkeypatch.setenv(f"CKPTLIB_{scheme(cloud)}_PART_SIZE", str(part))
    monkeypatch.setenv(f"CKPTLIB_{scheme(cloud)}_READ_CHUNK_SIZE", str(part // 2))
    state = tensors(1, n=3 * part // 4 + 5)  # a shard of 3 parts and a bit: 4 parts
    faults = Faults.install(monkeypatch, open_storage(root))
    ckptlib.save(root, state)
    assert faults.count("start_upload") == 1 and faults.count("put_part") == 4 and faults.count("complete") == 1
    out = {k: torch.zeros_like(v) for k, v in state.items()}
    ckptlib.load(root, out)
    assert_equal(out, state)
    assert not any(".ckptlib-part-" in k for k in keys(root))  # no temporary parts left behind


@pytest.mark.gcs
def test_gcs_composes_in_rounds_beyond_32_parts(gcs_root):
    """70 parts: composed 32 at a time into intermediates, then once more; no part is left."""
    storage = open_storage(gcs_root)
    storage.multipart_threshold = storage.part_size = 256 << 10
    data = bytes(range(256)) * (70 * 1024 - 3)
    with storage.open_writer("many-parts") as stream:
        stream.write(data)
        assert stream.parts_uploaded >= 60
    assert storage.list() == {"many-parts": len(data)}
    assert bytes(storage.read("many-parts")) == data
    assert keys(gcs_root) == {"run/many-parts"}


def test_manager_retention_and_latest(root):
    manager = ckptlib.CheckpointManager(root, keep_last=2)
    assert manager.latest() is None
    for step in range(1, 5):
        manager.save(step, tensors(step))
    prefix = root.split("/", 3)[3]
    assert keys(root) == {f"{prefix}/latest"} | {
        f"{prefix}/step_{s:010d}/{name}" for s in (3, 4) for name in ("ckptlib.json", ".metadata", "__0_0.distcp")
    }
    assert manager.storage.read_pointer("latest") == "step_0000000004"
    assert manager.steps() == [3, 4] and manager.latest() == 4
    out = {k: torch.zeros_like(v) for k, v in tensors(0).items()}
    assert manager.load(out) == 4
    assert_equal(out, tensors(4))


def test_cli_commands_take_cloud_uris(root, capsys):
    from ckptlib.cli import main

    manager = ckptlib.CheckpointManager(root, keep_last=3)
    for step in (1, 2):
        manager.save(step, tensors(step))
    del manager
    assert main(["ls", "--json", root]) == 0
    listing = json.loads(capsys.readouterr().out)
    assert "step_0000000001" in json.dumps(listing) and "step_0000000002" in json.dumps(listing)
    step_uri = f"{root}/step_0000000002"
    assert main(["verify", step_uri]) == 0
    capsys.readouterr()
    assert main(["inspect", "--json", step_uri]) == 0
    described = json.loads(capsys.readouterr().out)
    assert described["step"] == 2 and described["world_size"] == 1
    assert main(["gc", "--keep", "1", root]) == 0
    assert ckptlib.CheckpointManager(root).steps() == [2]


@pytest.mark.parametrize("cloud", GCS_AZURE)
def test_ckpt_validate_root_on_the_cloud(root, capsys):
    """`ckpt validate --root gs://... / az://...`: every pair passes and the run's checkpoints are removed."""
    from ckptlib.cli import main

    rc = main(["validate", "--world-sizes", "1,2", "--root", root, "--json", "--no-progress"])
    doc = json.loads(capsys.readouterr().out)
    assert rc == 0 and doc["ok"] and doc["root"] == root
    assert len(doc["cells"]) == 4 and all(c["ok"] for c in doc["cells"])
    assert keys(root) == set()


# -- elastic: save at N ranks, load at M --------------------------------------------------------

ELASTIC = [
    pytest.param(2, 3, "fsdp2", "adamw", False, id="save2-fsdp2-load3-fsdp2-adamw"),
    pytest.param(3, 2, "fsdp2", "sgd", True, id="save3-fsdp2-load2-fsdp2-sgd-manager"),
    pytest.param(1, 4, "ddp", "adam", False, id="save1-ddp-load4-ddp-adam"),
]


@pytest.mark.elastic
@pytest.mark.parametrize("cloud", GCS_AZURE)
@pytest.mark.parametrize("save_ws,load_ws,wrap,optim,manager", ELASTIC)
def test_elastic_save_n_load_m(cloud, server, root, dist_run, save_ws, load_ws, wrap, optim, manager):
    if wrap == "fsdp2" and parallel.fsdp2_cpu_reason():
        pytest.skip(parallel.fsdp2_cpu_reason())
    env = env_for(cloud, server)
    expected = dist_run(save_ws, mx.save_side, root, wrap, optim, manager=manager, env=env)[0]
    prefix = root.split("/", 3)[3] + ("/step_0000000002" if manager else "")
    shards = {k for k in keys(root) if k.endswith(".distcp")}
    assert shards == {f"{prefix}/__{r}_0.distcp" for r in range(save_ws)}
    problems = dist_run(load_ws, mx.load_side, root, wrap, optim, expected, manager=manager, env=env)
    assert problems == [[]] * load_ws


# -- faults ------------------------------------------------------------------------------------


@pytest.fixture
def proxy(cloud, server, monkeypatch):
    """A FaultProxy in front of the emulator, with this process's client pointed at it and
    small parts, so an upload is many requests."""
    port = int(server.rsplit(":", 1)[1])
    with FaultProxy(port) as p:
        for name, value in env_for(cloud, p.endpoint).items():
            if value is None:
                monkeypatch.delenv(name, raising=False)
            else:
                monkeypatch.setenv(name, value)
        for option in ("MULTIPART_THRESHOLD", "PART_SIZE"):
            monkeypatch.setenv(f"CKPTLIB_{scheme(cloud)}_{option}", str(part_size(cloud)))
        yield p


def test_503_burst_is_retried(cloud, root, proxy):
    state = tensors(2, n=MiB)  # a 4 MiB shard: parts
    proxy.fail_next(4)
    ckptlib.save(root, state, step=1)
    assert proxy.injected == 4
    proxy.fail_next(3)
    out = {k: torch.zeros_like(v) for k, v in state.items()}
    assert ckptlib.load(root, out).step == 1
    assert proxy.injected == 7
    assert_equal(out, state)


def test_brief_outage_mid_upload_is_retried(cloud, root, proxy):
    state = tensors(3, n=MiB)
    proxy.cut_after(2 * MiB, restore_after=0.5)
    ckptlib.CheckpointManager(root).save(1, state)
    assert proxy.outages == 1 and proxy.refused + proxy.requests > 0
    out = {k: torch.zeros_like(v) for k, v in state.items()}
    assert ckptlib.CheckpointManager(root).load(out) == 1
    assert_equal(out, state)


@pytest.mark.parametrize("fault", ["server-stopped-mid-upload", "endless-503s"])
def test_permanent_failure_keeps_latest(cloud, root, proxy, monkeypatch, fault):
    monkeypatch.setenv(f"CKPTLIB_{scheme(cloud)}_MAX_ATTEMPTS", "3")
    manager = ckptlib.CheckpointManager(root, keep_last=3)
    manager.save(1, tensors(1, n=MiB))
    if fault == "server-stopped-mid-upload":
        proxy.cut_after(2 * MiB)
    else:
        proxy.fail_next(10_000)
    with pytest.raises(CheckpointError) as info:
        manager.save(2, tensors(2, n=MiB))
    proxy.restore()
    assert proxy.outages == 1 if fault == "server-stopped-mid-upload" else proxy.injected >= 3
    err = info.value
    assert isinstance(err, StorageError)
    assert root in str(err) and "gave up after 3 attempts" in str(err)
    assert em.AZURITE_KEY not in str(err) and "AccountKey" not in str(err)
    assert manager.storage.read_pointer("latest") == "step_0000000001"
    reopened = ckptlib.CheckpointManager(root, keep_last=3)
    assert reopened.latest() == 1
    out = {k: torch.zeros_like(v) for k, v in tensors(0, n=MiB).items()}
    assert reopened.load(out) == 1
    assert_equal(out, tensors(1, n=MiB))
    reopened.save(3, tensors(3, n=MiB))
    assert reopened.steps() == [1, 3]
    assert not any("step_0000000002" in k or ".ckptlib-part-" in k for k in keys(root))


def test_permanent_error_on_the_manifest_keeps_latest(cloud, root, monkeypatch):
    """A 403 on the manifest's upload is not retried; the save fails naming that object, the
    previous step stays `latest` and loads, and the next save's retention removes the debris."""
    manager = ckptlib.CheckpointManager(root, keep_last=2)
    manager.save(1, tensors(1))
    faults = Faults.install(monkeypatch, manager.storage)
    faults.fail("put", lambda: permanent_error(cloud), when=lambda key, n: key.endswith("/ckptlib.json"))
    with pytest.raises(CheckpointError) as info:
        manager.save(2, tensors(2))
    assert isinstance(info.value, StorageError)
    assert str(info.value).startswith(f"{LABELS[cloud]} put failed for {root}/step_0000000002/ckptlib.json: ")
    assert len(faults.injected) == 1 and faults.count("put") >= 3  # the shard and .metadata went up first
    assert manager.storage.read_pointer("latest") == "step_0000000001"
    assert manager.latest() == 1 and manager.steps() == [1]
    out = {k: torch.zeros_like(v) for k, v in tensors(0).items()}
    assert manager.load(out) == 1
    assert_equal(out, tensors(1))
    faults.rules.clear()
    manager.save(3, tensors(3))
    prefix = root.split("/", 3)[3]
    assert {k.split("/")[1] for k in keys(root)} == {"latest", "step_0000000001", "step_0000000003"}
    assert all(k.startswith(prefix + "/") for k in keys(root))


# -- credentials and missing containers ----------------------------------------------------------


def test_missing_bucket_or_container_is_a_storage_error(cloud, server):
    uri = "gs://no-such-bucket-ckptlib/run" if cloud == "gcs" else "az://no-such-container-ckptlib/run"
    with pytest.raises(StorageError) as info:
        ckptlib.save(uri, tensors(0))
    assert "no-such-" in str(info.value)


@pytest.mark.azure
def test_azure_wrong_key_is_a_storage_error_without_the_key(azurite_server, azure_root, monkeypatch):
    wrong = "A" * 43 + "Q==" + "B" * 40
    monkeypatch.setenv(
        "AZURE_STORAGE_CONNECTION_STRING", em.azure_connection_string(azurite_server).replace(em.AZURITE_KEY, wrong)
    )
    with pytest.raises(StorageError) as info:
        open_storage(azure_root).write("x", b"1")
    message = str(info.value)
    assert message.startswith(f"Azure Blob put failed for {azure_root}/x: ")
    assert "AuthorizationFailure" in message or "AuthenticationFailed" in message or "HTTP 403" in message
    assert wrong not in message and em.AZURITE_KEY not in message


@pytest.mark.azure
def test_azure_account_name_and_key_from_the_environment(azurite_server, azure_root, monkeypatch):
    monkeypatch.delenv("AZURE_STORAGE_CONNECTION_STRING")
    monkeypatch.setenv("AZURE_STORAGE_ACCOUNT_NAME", em.AZURITE_ACCOUNT)
    monkeypatch.setenv("AZURE_STORAGE_ACCOUNT_KEY", em.AZURITE_KEY)
    monkeypatch.setenv("AZURE_STORAGE_BLOB_ENDPOINT", f"{azurite_server}/{em.AZURITE_ACCOUNT}")
    storage = open_storage(azure_root)
    storage.write("k", b"via account key")
    assert bytes(storage.read("k")) == b"via account key"


def test_no_account_configured_says_what_to_set(monkeypatch):
    for name in ("AZURE_STORAGE_CONNECTION_STRING", "AZURE_STORAGE_ACCOUNT_NAME", "AZURE_STORAGE_ACCOUNT"):
        monkeypatch.delenv(name, raising=False)
    pytest.importorskip("azure.storage.blob")
    with pytest.raises(StorageError, match="AZURE_STORAGE_CONNECTION_STRING"):
        open_storage("az://some-container/run").exists()


@pytest.mark.parametrize("chunks", [1, 12], ids=["one-get", "12-chunk-gets"])
def test_a_download_that_breaks_off_is_read_again(cloud, root, proxy, monkeypatch, chunks):
    """A large ranged read lands in one buffer (the SDK writes each answer into place); an
    answer whose body breaks off part-way is sent again and the bytes come back whole, also
    when the read is split into parallel chunk GETs (1 MiB chunks here)."""
    data = bytes(range(256)) * (12 * MiB // 256) + b"tail"
    if chunks > 1:
        monkeypatch.setenv(f"CKPTLIB_{scheme(cloud)}_READ_CHUNK_SIZE", str(MiB))
    store = open_storage(root)
    store.write("x.bin", data)
    before = proxy.requests
    proxy.break_downloads(1, after=MiB // 2 if chunks == 1 else 5 * MiB // 2)
    got = store.read("x.bin", 4, 12 * MiB)
    assert proxy.broken == 1
    assert proxy.requests - before == chunks + 1  # the broken answer's GET, sent again
    assert bytes(got) == data[4 : 4 + 12 * MiB]


def test_downloads_that_keep_breaking_off_are_a_storage_error(cloud, root, proxy, monkeypatch):
    """Every try's answer breaks off: the read is retried as transient, then gives up naming the
    object. Azure's downloader tries a broken body three times itself (azure-storage-blob
    does that whatever its retry policy), so there each of ckptlib's tries is three GETs."""
    monkeypatch.setenv(f"CKPTLIB_{scheme(cloud)}_MAX_ATTEMPTS", "3")
    data = bytes(range(256)) * (4 * MiB // 256)
    store = open_storage(root)
    store.write("x.bin", data)
    before = proxy.requests
    proxy.break_downloads(100, after=MiB // 2)
    with pytest.raises(StorageError) as info:
        store.read("x.bin", 0, 4 * MiB)
    assert proxy.requests - before == 3 * (3 if cloud == "azure" else 1)
    assert f"{root}/x.bin" in str(info.value)
    assert str(info.value).endswith("(gave up after 3 attempts)")


@pytest.mark.parametrize("chunks", [1, 4], ids=["one-get", "4-chunk-gets"])
def test_a_large_read_past_the_end_is_an_eof_naming_the_size(cloud, root, monkeypatch, chunks):
    """A large read (into one buffer) that runs past the object's end, or starts beyond it, is
    an EOFError giving the object's size, as a short small read is."""
    if chunks > 1:
        monkeypatch.setenv(f"CKPTLIB_{scheme(cloud)}_READ_CHUNK_SIZE", str(MiB))
    store = open_storage(root)
    size = 3 * MiB + 7
    store.write("x.bin", bytes(size))
    for offset, length in ((MiB, chunks * MiB + 3 * MiB), (size + 5, 2 * MiB)):
        with pytest.raises(EOFError) as info:
            store.read("x.bin", offset, length)
        assert str(info.value) == f"{root}/x.bin: wanted {length} bytes at offset {offset}, object holds {size}"


def test_large_reads_hand_the_sdk_one_buffer_where_it_writes_in_place(cloud, root, monkeypatch):
    """On GCS (in one read of the body, `single_shot_download`) and Azure a read of 1 MiB or
    more hands the SDK one buffer to write the answer into, and that buffer is what `read`
    returns; a smaller read, and any read on S3 (botocore reads into bytes whatever it is
    asked), takes the SDK's own bytes."""
    from google.cloud.storage import Blob

    from ckptlib.storage import azure, gcs, s3_client

    client = {"s3": s3_client.S3Client, "gcs": gcs.GCSClient, "azure": azure.AzureClient}[cloud]
    seen, downloads = [], []
    real_get, real_download = client.get, Blob.download_to_file

    def get(self, key, start, end, into=None):
        seen.append((end - start + 1, into is not None))
        return real_get(self, key, start, end, into=into)

    @functools.wraps(real_download)  # its signature: the option is looked up there
    def download_to_file(self, file_obj, *args, **kwargs):
        downloads.append(kwargs.get("single_shot_download"))
        return real_download(self, file_obj, *args, **kwargs)

    monkeypatch.setattr(client, "get", get)
    monkeypatch.setattr(Blob, "download_to_file", download_to_file)
    store = open_storage(root)
    data = bytes(range(256)) * (2 * MiB // 256) + b"tail"
    store.write("x.bin", data)
    big, small = store.read("x.bin", 3, 2 * MiB), store.read("x.bin", 3, 1000)
    assert bytes(big) == data[3 : 3 + 2 * MiB] and bytes(small) == data[3:1003]
    in_place = cloud != "s3"
    assert seen == [(2 * MiB, in_place), (1000, False)]
    assert isinstance(big, bytearray if in_place else bytes)
    assert downloads == ([True] if cloud == "gcs" else [])
