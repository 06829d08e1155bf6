"""Per-rank uploads of the cluster tier on simulated nodes (`dist_run(nodes=2)`: torchrun's
GROUP_RANK per rank, each node its own local root):

- every rank uploads exactly its own shard file (rank 0 also `.metadata`), never another's;
- one rank's upload failing (the remote down for it alone) leaves the step local on every rank
  (`remote_lag`, a RemoteUnavailableWarning naming that rank and the object, nothing raised);
  the remote `latest` stays where it was, the step stays committed in every node's root, and
  the next save uploads and moves `latest`.
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch

from ckptlib import Cluster

NODES = 2


def _state(step: int) -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    full = torch.randn(48, 16, generator=torch.Generator().manual_seed(step))
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    return {"w": distribute_tensor(full, mesh, [Shard(0)]), "step": step}


def _one_rank_cannot_upload(base: str, remote: str) -> dict:
    import torch.distributed as dist

    import ckptlib
    import ckptlib.manager.cluster.remote_tier as remote_tier
    from ckptlib.format import classify
    from ckptlib.storage import open_storage

    rank = dist.get_rank()
    root = os.path.join(base, f"node{os.environ['GROUP_RANK']}")
    copied: dict[str, list[str]] = {}
    down: list[int] = []
    real = remote_tier.copy_file

    def copy(src, dst, name, size, crc):
        if down and rank == 3:
            raise ckptlib.StorageError(f"{dst.uri}/{name}: injected: connection reset by peer")
        real(src, dst, name, size, crc)
        copied.setdefault(os.path.basename(dst.uri.rstrip("/")), []).append(name)

    remote_tier.copy_file = copy
    lag = ckptlib.RemoteLag(retry_after=0)
    mgr = ckptlib.CheckpointManager(root, cluster=Cluster(remote=remote, remote_lag=lag))
    mgr.save(1, _state(1))
    out: dict = {"first": mgr.wait().step}
    down.append(1)
    mgr.save(2, _state(2))  # the local save does not need the remote
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out["second"] = mgr.wait()  # the step stays local: warned, not raised
    out["warnings"] = [(w.category.__name__, str(w.message)) for w in caught]
    out["lag"] = mgr.remote_lag.steps, mgr.remote_lag.error
    out["latest_after_failure"] = open_storage(remote).read_pointer("latest")
    out["step2_here"] = classify(mgr.storage.child("step_0000000002"))
    down.clear()
    mgr.save(3, _state(3))
    out["third"] = mgr.wait().step
    out["latest"] = open_storage(remote).read_pointer("latest")
    out["copied"] = copied
    mgr.close()
    return out


def test_one_rank_failing_to_upload_leaves_the_step_local_naming_it_on_every_rank(tmp_path, dist_run):
    remote = str(tmp_path / "remote")
    results = dist_run(4, _one_rank_cannot_upload, str(tmp_path), remote, nodes=NODES)
    where = f"{remote}/step_0000000002/__3_0.distcp"
    for rank, res in enumerate(results):
        assert res["first"] == 1 and res["second"] is None and res["third"] == 3, res
        steps, error = res["lag"]
        assert steps == (2,), res
        assert error.startswith(f"rank 3: {where}: upload failed: StorageError: "), error
        assert error.endswith("injected: connection reset by peer"), error
        assert [kind for kind, _ in res["warnings"]] == ["RemoteUnavailableWarning"], res["warnings"]
        assert res["warnings"][0][1].endswith(f"1 step(s) not uploaded yet (2); last failure: {error}"), res
        assert res["latest_after_failure"] == "step_0000000001", res
        assert res["step2_here"] == "committed", res  # nothing committed is lost
        assert res["latest"] == "step_0000000003", res
        own = [f"__{rank}_0.distcp"] + ([".metadata"] if rank == 0 else [])
        uploaded = {"step_0000000001": own, "step_0000000003": own}
        if rank != 3:
            uploaded["step_0000000002"] = own
        assert {step: sorted(names) for step, names in res["copied"].items()} == {
            step: sorted(names) for step, names in uploaded.items()
        }, f"rank {rank} uploads exactly its own files"


def _copy_cases(tmp_path):
    """(source storage, the file's bytes, its CRC) for copy_file's tests."""
    import zlib

    from ckptlib.storage import open_storage

    data = os.urandom(3 * (8 << 20) + 12345)  # more than one chunk, not a multiple of one
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "__0_0.distcp").write_bytes(data)
    return open_storage(str(tmp_path / "src")), data, zlib.crc32(data)


def test_copy_file_copies_verified_bytes_in_the_kernel_and_through_a_stream(tmp_path, monkeypatch):
    import contextlib
    import io

    from ckptlib.manager.cluster import remote_tier
    from ckptlib.manager.cluster.remote_tier import copy_file
    from ckptlib.storage import open_storage

    src, data, crc = _copy_cases(tmp_path)
    sent, opened = [], []
    real_sendfile, real_open_regular = os.sendfile, remote_tier.open_regular
    monkeypatch.setattr(os, "sendfile", lambda *args: sent.append(args[3]) or real_sendfile(*args))
    monkeypatch.setattr(remote_tier, "open_regular", lambda p: opened.append(p) or real_open_regular(p))
    dst = open_storage(str(tmp_path / "dst"))
    copy_file(src, dst, "__0_0.distcp", len(data), crc)  # file to file: checksummed, then sendfile
    assert (tmp_path / "dst" / "__0_0.distcp").read_bytes() == data
    assert sent == [1 << 20] * 24 + [12345]  # 1 MiB pieces, each checksummed just before its copy
    assert opened == [str(tmp_path / "src" / "__0_0.distcp")]  # the remote copy is not read back
    sent.clear()
    monkeypatch.setattr(remote_tier, "WINDOW", 5 << 19)  # 2.5 MiB mapped at a time: pieces end at windows
    copy_file(src, dst, "__0_0.distcp", len(data), crc)
    assert (tmp_path / "dst" / "__0_0.distcp").read_bytes() == data
    assert sent[:3] == [1 << 20, 1 << 20, 1 << 19] and sum(sent) == len(data)

    class Stream:  # an object store's writer: no descriptor, bytes only through write()
        def __init__(self):
            self.uri, self.got = "mem://x", io.BytesIO()

        @contextlib.contextmanager
        def open_writer(self, name):
            yield self.got

    stream = Stream()
    sent.clear()
    copy_file(src, stream, "__0_0.distcp", len(data), crc)
    assert stream.got.getvalue() == data and sent == []


def test_copy_file_refuses_a_local_copy_that_does_not_match_and_leaves_nothing(tmp_path):
    from ckptlib import CheckpointCorruptError
    from ckptlib.manager.cluster.remote_tier import copy_file
    from ckptlib.storage import open_storage

    src, data, crc = _copy_cases(tmp_path)
    path = tmp_path / "src" / "__0_0.distcp"
    damaged = bytearray(data)
    damaged[-100] ^= 0xFF
    path.write_bytes(bytes(damaged))
    dst = open_storage(str(tmp_path / "dst"))
    with pytest.raises(CheckpointCorruptError, match=r"__0_0\.distcp: the local copy does not match its manifest"):
        copy_file(src, dst, "__0_0.distcp", len(data), crc)
    path.write_bytes(data[:-10])  # short
    with pytest.raises(CheckpointCorruptError, match=rf"\({len(data) - 10} bytes, crc32 "):
        copy_file(src, dst, "__0_0.distcp", len(data), crc)
    path.write_bytes(b"")  # empty: nothing to map
    with pytest.raises(CheckpointCorruptError, match=r"\(0 bytes, crc32 00000000; the manifest says"):
        copy_file(src, dst, "__0_0.distcp", len(data), crc)
    assert not (tmp_path / "dst" / "__0_0.distcp").exists()


def _close_uploads_what_the_retry_wait_skipped(base: str, remote: str) -> dict:
    import torch.distributed as dist

    import ckptlib
    import ckptlib.manager.cluster.remote_tier as remote_tier
    from ckptlib.storage import open_storage

    root = os.path.join(base, f"node{os.environ['GROUP_RANK']}")
    copied: dict[str, list[str]] = {}
    down: list[int] = []
    real = remote_tier.copy_file

    def copy(src, dst, name, size, crc):
        if down:
            raise ckptlib.StorageError(f"{dst.uri}/{name}: injected: connection reset by peer")
        real(src, dst, name, size, crc)
        copied.setdefault(os.path.basename(dst.uri.rstrip("/")), []).append(name)

    remote_tier.copy_file = copy
    mgr = ckptlib.CheckpointManager(root, cluster=Cluster(remote=remote, remote_lag=ckptlib.RemoteLag()))
    mgr.save(1, _state(1))
    mgr.wait()
    down.append(1)  # a short outage: step 2's upload fails
    mgr.save(2, _state(2))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mgr.wait()
        down.clear()  # the remote answers again, but step 3 falls inside the 30 s retry wait
        mgr.save(3, _state(3))
        mgr.wait()
    out = {"warnings": [str(w.message).split(";")[0] for w in caught], "lag": mgr.remote_lag.steps}
    out["latest_before_close"] = open_storage(remote).read_pointer("latest")
    mgr.close()  # every rank: the newest step left local, each rank its own files
    out["latest"] = open_storage(remote).read_pointer("latest")
    out["copied"] = {step: sorted(names) for step, names in copied.items()}
    out["rank"] = dist.get_rank()
    return out


def test_close_uploads_the_step_the_retry_wait_skipped_each_rank_its_own_files(tmp_path, dist_run):
    remote = str(tmp_path / "remote")
    results = dist_run(4, _close_uploads_what_the_retry_wait_skipped, str(tmp_path), remote, nodes=NODES)
    for rank, res in enumerate(results):
        assert res["warnings"] == [
            f"{remote}: step 2 could not be uploaded",
            f"{remote}: step 3 is not uploaded (the remote failed recently)",
        ], res
        assert res["lag"] == (2, 3) and res["latest_before_close"] == "step_0000000001", res
        assert res["latest"] == "step_0000000003", res
        own = sorted([f"__{rank}_0.distcp"] + ([".metadata"] if rank == 0 else []))
        assert res["copied"] == {"step_0000000001": own, "step_0000000003": own}, res
