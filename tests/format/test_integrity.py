"""Integrity and safe loading: every damaged or crafted checkpoint is refused by `ckptlib.load`
(exact error type, the file named) and by `ckpt verify` (exit status, the file named), and
no wrong value ever reaches the caller's state."""

from __future__ import annotations

import json
import os
import pickle
import re
import warnings
import zlib

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

import ckptlib
from ckptlib import cli
from ckptlib.errors import CheckpointCorruptError, CheckpointNotFoundError, NotACheckpointError, UnsafeCheckpointError
from ckptlib.format import classify
from ckptlib.format.verify import Problem, structure_problems, verify
from ckptlib.storage import open_storage

SENTINEL = -7.0


def _saved_values():
    g = torch.Generator().manual_seed(5)
    return {"a": torch.randn(1000, generator=g), "b": torch.randn(4, 5, generator=g)}


def _save(path, **extra):
    state = {**_saved_values(), "n": 3, **extra}
    ckptlib.save(path, state, step=7)
    return path


def _target():
    return {"a": torch.full((1000,), SENTINEL), "b": torch.full((4, 5), SENTINEL), "n": -1}


def _assert_no_wrong_values(target):
    """After a failed load each element is either untouched or the saved value, never anything else."""
    saved = _saved_values()
    for key in ("a", "b"):
        got = target[key]
        ok = (got == SENTINEL) | (got == saved[key])
        assert bool(ok.all()), f"{key} holds values that were never saved"


def _ckpt_cli(capsys, *argv):
    rc = cli.main(list(argv))
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    return rc, out, err


def _rewrite_manifest(path, edit):
    """Apply `edit(doc)` to the manifest JSON, the way an attacker (or a careless tool) would.

    The result has no self-checksum, which is accepted: manifests written before it existed
    have none. (An attacker can recompute it anyway; it guards against damage, not malice.)
    """
    where = os.path.join(path, "ckptlib.json")
    doc = json.loads(open(where, "rb").read())
    doc.pop("checksum", None)
    edit(doc)
    with open(where, "w") as f:
        json.dump(doc, f)


def _replace_metadata(path, blob):
    """Write `blob` as .metadata and make the manifest (if any) agree with it."""
    with open(os.path.join(path, ".metadata"), "wb") as f:
        f.write(blob)
    if os.path.exists(os.path.join(path, "ckptlib.json")):
        crc = zlib.crc32(blob)

        def edit(doc):
            doc["files"][".metadata"] = {"size": len(blob), "crc32": crc, "items": [[0, len(blob), crc]]}

        _rewrite_manifest(path, edit)


def _edit_metadata(path, edit):
    with open(os.path.join(path, ".metadata"), "rb") as f:
        md = pickle.load(f)  # our own file, written just above: plain pickle is fine here
    edit(md)
    _replace_metadata(path, pickle.dumps(md))


# ---------------------------------------------------------------- corruption, one process


def _flip_bit(path):
    shard = os.path.join(path, "__0_0.distcp")
    data = bytearray(open(shard, "rb").read())
    data[len(data) // 2] ^= 0x10
    open(shard, "wb").write(bytes(data))


def _truncate(path):
    shard = os.path.join(path, "__0_0.distcp")
    size = os.path.getsize(shard)
    with open(shard, "r+b") as f:
        f.truncate(size - 100)


def _delete_shard(path):
    os.unlink(os.path.join(path, "__0_0.distcp"))


def _delete_manifest(path):
    os.unlink(os.path.join(path, "ckptlib.json"))


def _garbage_metadata(path):
    where = os.path.join(path, ".metadata")
    garbage = os.urandom(os.path.getsize(where))  # same size: only the checksum can tell
    open(where, "wb").write(garbage)


def _garbage_metadata_no_manifest(path):
    _delete_manifest(path)
    _garbage_metadata(path)


def _damage_manifest(path):
    where = os.path.join(path, "ckptlib.json")
    text = open(where).read().replace('"step": 7', '"step": 8')
    open(where, "w").write(text)


CORRUPTIONS = [
    pytest.param(
        _flip_bit,
        CheckpointCorruptError,
        r"__0_0\.distcp: checksum mismatch in tensor '[^']+'( \(chunk at [^)]*\))? at offset \d+ "
        r"\(length \d+\) \(rank 0's shard\)",
        r"__0_0\.distcp \(rank 0's shard\): checksum mismatch in (tensor|object) '[^']+'.* at offset \d+",
        id="bit-flip-in-shard",
    ),
    pytest.param(
        _truncate,
        CheckpointCorruptError,
        r"__0_0\.distcp \(rank 0's shard\) has \d+ bytes, the manifest says \d+",
        r"__0_0\.distcp \(rank 0's shard\): has \d+ bytes, the manifest says \d+",
        id="truncated-shard",
    ),
    pytest.param(
        _delete_shard,
        CheckpointCorruptError,
        r"__0_0\.distcp \(rank 0's shard\) is missing",
        r"__0_0\.distcp \(rank 0's shard\): is missing",
        id="deleted-shard",
    ),
    pytest.param(
        _delete_manifest,
        CheckpointCorruptError,
        r"ckptlib\.json is missing: \.metadata says ckptlib wrote this checkpoint.*refusing to load it as plain DCP",
        r"ckptlib\.json: is missing: \.metadata says ckptlib wrote this checkpoint",
        id="deleted-manifest",
    ),
    pytest.param(
        _garbage_metadata,
        CheckpointCorruptError,
        r"/\.metadata: checksum mismatch",
        r"/\.metadata: checksum mismatch",
        id="garbage-metadata",
    ),
    pytest.param(
        _garbage_metadata_no_manifest,
        CheckpointCorruptError,
        r"/\.metadata: cannot read DCP metadata",
        r"/\.metadata: cannot read DCP metadata",
        id="garbage-metadata-no-manifest",
    ),
    pytest.param(
        _damage_manifest,
        CheckpointCorruptError,
        r"ckptlib\.json: manifest checksum mismatch",
        r"ckptlib\.json: manifest checksum mismatch",
        id="edited-manifest",
    ),
]


@pytest.mark.parametrize("corrupt, error, load_message, verify_line", CORRUPTIONS)
def test_corruption_detected_by_load_and_verify(tmp_path, capsys, corrupt, error, load_message, verify_line):
    path = _save(str(tmp_path / "c"))
    rc, out, _ = _ckpt_cli(capsys, "verify", path)
    assert rc == 0 and out.strip() == f"{path}: OK"
    corrupt(path)

    target = _target()
    with pytest.raises(error, match=load_message) as info:
        ckptlib.load(path, target)
    assert path in str(info.value)
    _assert_no_wrong_values(target)

    rc, out, _ = _ckpt_cli(capsys, "verify", path)
    assert rc == 1, out
    lines = out.strip().splitlines()
    errors = [line for line in lines[:-1] if not line.startswith("note: ")]
    assert lines[-1] == f"{path}: DAMAGED, {len(errors)} problem{'s' if len(errors) > 1 else ''}", out
    assert all(line.startswith(f"{path}/") for line in errors), out
    assert any(re.search(verify_line, line) for line in errors), out


def test_verify_reports_every_problem_with_its_file(tmp_path):
    path = _save(str(tmp_path / "c"))
    _flip_bit(path)
    with open(os.path.join(path, "stray.txt"), "w") as f:
        f.write("x")
    problems = verify(path)
    assert [p.kind for p in problems if p.is_error] == ["corrupt"]
    assert [p.file for p in problems if p.is_error] == ["__0_0.distcp"]
    assert Problem("stray.txt", "is not listed in the manifest (not part of the checkpoint)", "note") in problems


def test_empty_directory(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    with pytest.raises(NotACheckpointError, match="is not a checkpoint"):
        ckptlib.load(tmp_path / "empty", _target())
    rc, out, err = _ckpt_cli(capsys, "verify", str(tmp_path / "empty"))
    assert rc == 2 and out == ""
    assert (
        err.strip()
        == f"ckpt verify: error: {tmp_path / 'empty'} is not a checkpoint: no ckptlib.json and no DCP .metadata in it"
    )
    rc, _, err = _ckpt_cli(capsys, "verify", str(tmp_path / "absent"))
    assert rc == 2 and "the path does not exist" in err and len(err.strip().splitlines()) == 1
    with pytest.raises(CheckpointNotFoundError):
        verify(tmp_path / "absent")


def test_plain_dcp_still_reads_marked_metadata_and_verify_notes_no_checksums(tmp_path, capsys):
    path = _save(str(tmp_path / "c"))
    md = pickle.load(open(os.path.join(path, ".metadata"), "rb"))
    assert "ckptlib" in md.storage_meta.modules
    target = {"a": torch.zeros(1000), "b": torch.zeros(4, 5)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(target, checkpoint_id=path)  # the marker does not disturb plain DCP
    assert torch.equal(target["a"], _saved_values()["a"])

    plain = str(tmp_path / "plain")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(_saved_values(), checkpoint_id=plain)
    assert classify(open_storage(plain)) == "dcp"
    rc, out, _ = _ckpt_cli(capsys, "verify", plain)
    assert rc == 0
    assert out.splitlines() == [
        f"note: {plain}: plain DCP checkpoint (no ckptlib.json): it carries no checksums to verify; "
        "only its structure was checked",
        f"{plain}: OK",
    ]
    os.unlink(os.path.join(plain, "__0_0.distcp"))
    with pytest.raises(CheckpointCorruptError, match=r"__0_0\.distcp \(rank 0's shard\): is missing"):
        ckptlib.load(plain, {"a": torch.zeros(1000)})
    rc, out, _ = _ckpt_cli(capsys, "verify", plain)
    assert rc == 1 and f"{plain}/__0_0.distcp (rank 0's shard): is missing (.metadata stores data in it)" in out


def test_ckptlib_checkpoint_without_manifest_is_debris_for_the_manager(tmp_path):
    root = tmp_path / "run"
    mgr = ckptlib.CheckpointManager(root)
    mgr.save(1, {"w": torch.ones(2)})
    mgr.save(2, {"w": torch.full((2,), 2.0)})
    os.unlink(root / "step_0000000002" / "ckptlib.json")
    assert classify(open_storage(str(root / "step_0000000002"))) == "incomplete"
    with pytest.warns(ckptlib.StalePointerWarning):
        assert mgr.latest() == 1
    mgr.save(3, {"w": torch.full((2,), 3.0)})
    assert sorted(os.listdir(root)) == ["latest", "step_0000000001", "step_0000000003"]


# ---------------------------------------------------------------- structure of .metadata


def _two_chunk_tensor(path):
    """Rewrite tensor 'b' (4x5) as two chunks of 2 rows pointing at the same stored item."""

    def edit(md):
        old = MetadataIndex("b", (0, 0))
        info = md.storage_data[old]
        meta = md.state_dict_metadata["b"]
        meta.chunks = [
            ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([2, 5])),
            ChunkStorageMetadata(torch.Size([2, 0]), torch.Size([2, 5])),
        ]
        md.storage_data[MetadataIndex("b", (2, 0))] = info

    _edit_metadata(path, edit)


def test_gap_in_chunks_is_refused(tmp_path, capsys):
    path = _save(str(tmp_path / "c"))

    def edit(md):
        md.state_dict_metadata["b"].chunks[0].sizes = torch.Size([3, 5])

    _edit_metadata(path, edit)
    problems = [p for p in verify(path) if p.is_error]
    assert [p.text() for p in problems] == [
        ".metadata: tensor 'b' of shape [4, 5]: the saved chunks cover 15 of its 20 elements "
        "(a gap: part of the tensor was never saved)"
    ]
    target = _target()
    with pytest.raises(
        CheckpointCorruptError, match=r"tensor 'b' of shape \[4, 5\]: the saved chunks cover 15 of its 20"
    ):
        ckptlib.load(path, target)
    _assert_no_wrong_values(target)


def test_overlapping_chunks_are_refused(tmp_path):
    path = _save(str(tmp_path / "c"))

    def edit(md):
        md.state_dict_metadata["b"].chunks.append(ChunkStorageMetadata(torch.Size([2, 1]), torch.Size([2, 2])))
        md.storage_data[MetadataIndex("b", (2, 1))] = md.storage_data[MetadataIndex("b", (0, 0))]

    _edit_metadata(path, edit)
    problems = [p.text() for p in verify(path) if p.is_error]
    assert problems == [
        ".metadata: tensor 'b' of shape [4, 5]: chunks at offsets [0, 0] (sizes [4, 5]) "
        "and [2, 1] (sizes [2, 2]) overlap"
    ]
    with pytest.raises(
        CheckpointCorruptError, match=r"tensor 'b' of shape \[4, 5\]: the saved chunks hold 24 elements for 20"
    ):
        ckptlib.load(path, _target())


def test_storage_record_past_end_of_file(tmp_path):
    path = _save(str(tmp_path / "c"))

    def edit(md):
        info = md.storage_data[MetadataIndex("a", (0,))]
        info.length += 10**6

    _edit_metadata(path, edit)
    texts = [p.text() for p in verify(path) if p.is_error]
    assert len(texts) == 2
    assert texts[0].startswith("__0_0.distcp (rank 0's shard): the storage record of 'a' at offset")
    assert "matches no item record of the manifest" in texts[0]
    assert "runs past the end of the file" in texts[1]
    with pytest.raises(CheckpointCorruptError, match=r"matches no item record of the manifest"):
        ckptlib.load(path, _target())


def _meta(size, chunks):
    md = TensorStorageMetadata(
        TensorProperties(dtype=torch.float32),
        torch.Size(size),
        [ChunkStorageMetadata(torch.Size(o), torch.Size(s)) for o, s in chunks],
    )
    # Each record holds 1 KiB (what the file below holds): enough bytes for every chunk here.
    storage = {
        MetadataIndex("t", o): type("Info", (), {"relative_path": "__0_0.distcp", "offset": 0, "length": 1024})()
        for o, _ in chunks
    }
    return Metadata(state_dict_metadata={"t": md}, storage_data=storage)


@pytest.mark.parametrize(
    "size, chunks, expected",
    [
        pytest.param(
            (3, 65),
            [((0, 0), (1, 65)), ((1, 0), (1, 65)), ((2, 0), (1, 65)), ((3, 0), (0, 65))],
            None,
            id="zero-size-chunk-on-4-ranks",
        ),
        pytest.param((6, 5), [((0, 0), (6, 2)), ((0, 2), (6, 3))], None, id="column-sharded"),
        pytest.param((4, 4), [((0, 0), (2, 2)), ((0, 2), (2, 2)), ((2, 0), (2, 2)), ((2, 2), (2, 2))], None, id="grid"),
        pytest.param((), [((), ())], None, id="scalar"),
        pytest.param((0,), [((0,), (0,))], None, id="empty-tensor"),
        pytest.param((), [((), ()), ((), ())], "overlap", id="scalar-twice"),
        pytest.param((4, 4), [((0, 0), (2, 4)), ((1, 3), (3, 1))], "overlap", id="overlap-in-corner"),
        pytest.param((6,), [((0,), (3,)), ((4,), (2,))], "cover 5 of its 6", id="gap"),
        pytest.param((6,), [((0,), (3,)), ((3,), (4,))], "lies outside the tensor", id="past-the-end"),
    ],
)
def test_chunk_coverage(size, chunks, expected):
    problems = structure_problems(_meta(size, chunks), None, {"__0_0.distcp": 1024})
    if expected is None:
        assert problems == []
    else:
        assert len(problems) == 1 and expected in problems[0].message and problems[0].file == ".metadata"


# ---------------------------------------------------------------- safe loading


class _CreatesFile:
    """Unpickling this runs open(path, 'w'): it creates a file (a stand-in for any code)."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


@pytest.mark.parametrize("with_manifest", [True, False], ids=["manifest-agrees", "no-manifest"])
def test_malicious_metadata_never_runs(tmp_path, capsys, with_manifest):
    payload = pickle.dumps(_CreatesFile(str(tmp_path / "proof")))
    pickle.loads(payload)  # the payload is real: plain unpickling creates the file
    assert (tmp_path / "proof").exists()

    victim = str(tmp_path / "pwned")
    path = _save(str(tmp_path / "c"))
    if not with_manifest:
        _delete_manifest(path)
    _replace_metadata(path, pickle.dumps(_CreatesFile(victim)))

    with pytest.raises(UnsafeCheckpointError, match=r"/\.metadata: refusing to unpickle global io\.open"):
        ckptlib.load(path, _target())
    rc, out, _ = _ckpt_cli(capsys, "verify", path)
    assert rc == 1 and f"{path}/.metadata: refusing to unpickle global io.open" in out
    rc, out, err = _ckpt_cli(capsys, "inspect", path)
    assert rc == 1 and out == "" and "refusing to unpickle global io.open" in err
    assert not os.path.exists(victim)


class Opaque:
    """A plain value that weights_only unpickling refuses (it is not an allowlisted type)."""

    def __init__(self, value):
        self.value = value

    def __eq__(self, other):
        return isinstance(other, Opaque) and other.value == self.value


def test_opaque_object_needs_trusted(tmp_path):
    path = str(tmp_path / "c")
    ckptlib.save(path, {"w": torch.ones(3), "obj": Opaque(5)})
    state = {"w": torch.zeros(3), "obj": None}
    with pytest.raises(UnsafeCheckpointError) as info:
        ckptlib.load(path, state)
    message = str(info.value)
    assert message.startswith(f"rank 0: {path}/__0_0.distcp (rank 0's shard): object 'obj' needs arbitrary unpickling")
    assert "Opaque" in message and "pass trusted=True only if you trust this checkpoint's author" in message
    assert "\n" not in message
    assert state["obj"] is None
    ckptlib.load(path, state, trusted=True)
    assert state["obj"] == Opaque(5) and torch.equal(state["w"], torch.ones(3))


def _save_opaque_then_load(path, trusted):
    ckptlib.save(path, {"w": torch.ones(3), "obj": Opaque(dist.get_rank())})
    state = {"w": torch.zeros(3), "obj": None}
    ckptlib.load(path, state, trusted=trusted)
    return state["obj"].value


def test_opaque_object_refused_on_every_rank(tmp_path, dist_run):
    results = dist_run(2, _save_opaque_then_load, str(tmp_path / "c"), False, return_exceptions=True)
    assert [type(r) for r in results] == [UnsafeCheckpointError] * 2
    assert len({str(r) for r in results}) == 1
    assert "object 'obj' needs arbitrary unpickling" in str(results[0]) and str(results[0]).startswith("rank ")


def test_path_traversal_in_manifest(tmp_path, capsys):
    path = _save(str(tmp_path / "c"))
    (tmp_path / "secret").write_bytes(b"x" * 10)

    def edit(doc):
        doc["files"]["../secret"] = {"size": 10, "crc32": zlib.crc32(b"x" * 10), "items": []}

    _rewrite_manifest(path, edit)
    with pytest.raises(
        UnsafeCheckpointError, match=r"ckptlib\.json: manifest file name '\.\./secret' escapes the checkpoint directory"
    ):
        ckptlib.load(path, _target())
    rc, out, _ = _ckpt_cli(capsys, "verify", path)
    assert rc == 1 and f"{path}/ckptlib.json: manifest file name '../secret' escapes the checkpoint directory" in out


@pytest.mark.parametrize("escape", ["../other/__0_0.distcp", "/etc/passwd"], ids=["dotdot", "absolute"])
def test_path_traversal_in_metadata(tmp_path, capsys, escape):
    other = _save(str(tmp_path / "other"), a=torch.zeros(1000))  # a foreign file load must never read
    path = _save(str(tmp_path / "c"))

    def edit(md):
        for info in md.storage_data.values():
            info.relative_path = escape

    _edit_metadata(path, edit)
    target = _target()
    with pytest.raises(UnsafeCheckpointError, match=f"names file '{escape}', which escapes the checkpoint directory"):
        ckptlib.load(path, target)
    _assert_no_wrong_values(target)
    rc, out, _ = _ckpt_cli(capsys, "verify", path)
    assert rc == 1 and f"{path}/.metadata: the storage record of 'a' names file '{escape}', which escapes" in out
    assert os.path.exists(other)


# ---------------------------------------------------------------- across ranks


def _save_sharded(uri):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    full = torch.arange(36, dtype=torch.float32).reshape(9, 4)
    ckptlib.save(uri, {"w": distribute_tensor(full, mesh, [Shard(0)])})


def _load_sharded(uri):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    target = distribute_tensor(torch.full((9, 4), SENTINEL), mesh, [Shard(0)])
    try:
        ckptlib.load(uri, {"w": target})
    except CheckpointCorruptError as exc:
        local = target.to_local()
        full = torch.arange(36, dtype=torch.float32).reshape(9, 4)
        rows = full[5 * dist.get_rank() : 5 * dist.get_rank() + local.shape[0]]
        exc.values_ok = bool(((local == SENTINEL) | (local == rows)).all())
        raise
    return "loaded"


def test_corrupt_shard_of_rank1_saved_at_3_loaded_at_2(tmp_path, dist_run, capsys):
    uri = str(tmp_path / "c")
    dist_run(3, _save_sharded, uri)
    shard = os.path.join(uri, "__1_0.distcp")
    data = bytearray(open(shard, "rb").read())
    data[-20] ^= 0x01  # inside the tensor bytes of rank 1's rows (3..5), which both loading ranks need
    open(shard, "wb").write(bytes(data))

    results = dist_run(2, _load_sharded, uri, return_exceptions=True)
    assert [type(r) for r in results] == [CheckpointCorruptError] * 2
    for r in results:
        assert f"{uri}/__1_0.distcp: checksum mismatch in tensor 'w' (chunk at (3, 0)) at offset" in str(r)
        assert "(rank 1's shard)" in str(r) and str(r).startswith("rank ")
        assert r.values_ok
    rc, out, _ = _ckpt_cli(capsys, "verify", uri)
    assert rc == 1 and re.search(
        re.escape(f"{uri}/__1_0.distcp (rank 1's shard): checksum mismatch in ") + r"(tensor|object) '", out
    )


# ---------------------------------------------------------------- through the Storage protocol: S3


@pytest.mark.s3
def test_verify_inspect_and_lock_on_s3(s3_root, capsys):
    """verify/inspect/the lock use only the Storage protocol, so they work on S3 (moto) too."""
    path = s3_root + "/c"
    _save(path)
    rc, out, _ = _ckpt_cli(capsys, "verify", path)
    assert (rc, out) == (0, f"{path}: OK\n")
    rc, out, _ = _ckpt_cli(capsys, "inspect", "--json", path)
    assert rc == 0 and json.loads(out)["step"] == 7

    storage = open_storage(path)
    data = bytearray(storage.read("__0_0.distcp"))
    data[len(data) // 2] ^= 0x10
    storage.write("__0_0.distcp", bytes(data))
    rc, out, _ = _ckpt_cli(capsys, "verify", path)
    assert rc == 1 and re.search(
        re.escape(f"{path}/__0_0.distcp (rank 0's shard): checksum mismatch in ") + r"(tensor|object) '", out
    )
    target = _target()
    with pytest.raises(CheckpointCorruptError, match=r"__0_0\.distcp: checksum mismatch"):
        ckptlib.load(path, target)
    _assert_no_wrong_values(target)

    root = s3_root + "/run"
    with ckptlib.CheckpointManager(root, hold_lock=True) as owner:
        owner.save(1, {"w": torch.ones(2)})
        with pytest.raises(ckptlib.LockedError, match=f"{root} is locked by another writer"):
            ckptlib.CheckpointManager(root).save(2, {"w": torch.ones(2)})
    ckptlib.CheckpointManager(root).save(2, {"w": torch.ones(2)})
    assert sorted(open_storage(root).list()) == [
        "latest",
        *(f"step_000000000{s}/{n}" for s in (1, 2) for n in (".metadata", "__0_0.distcp", "ckptlib.json")),
    ]


@pytest.mark.parametrize("damaged", [20, 21, 30], ids=lambda n: f"{n}-damaged-items")
def test_verify_shows_twenty_findings_of_a_kind_per_file_then_counts_the_rest(tmp_path, damaged):
    """A file with many damaged items: verify lists the first 20 findings of each kind for it
    and then one line counting the rest, so a wrecked file does not bury the other findings."""
    d = tmp_path / "c"
    ckptlib.save(d, {f"t{i}": torch.full((64,), float(i)) for i in range(30)})
    items = json.loads((d / "ckptlib.json").read_text())["files"]["__0_0.distcp"]["items"]
    data = bytearray((d / "__0_0.distcp").read_bytes())
    for offset, length, _ in items[:damaged]:
        data[offset + length - 1] ^= 0xFF  # the last byte of each item: tensor bytes
    (d / "__0_0.distcp").write_bytes(bytes(data))
    found = [(p.file, p.kind, p.message) for p in verify(d) if p.file == "__0_0.distcp"]
    shown = [f for f in found if re.match(r"checksum mismatch in (tensor|object) '", f[2])]
    assert len(shown) == 20 and all(kind == "corrupt" for _, kind, _ in shown)
    rest = [f for f in found if f not in shown]
    assert rest == (
        [("__0_0.distcp", "corrupt", f"... and {damaged - 20} more problems like these")] if damaged > 20 else []
    )


def test_an_object_of_more_than_a_mebibyte_loads_exactly(tmp_path):
    """A non-tensor value whose pickle is over 1 MiB (a tokenizer's vocabulary, a long list of
    sample ids) is read whole like any object, not through the tensor path large items take."""
    ids = list(range(300_000))
    ckptlib.save(tmp_path / "c", {"data": {"ids": ids, "epoch": 3}, "w": torch.arange(4.0)})
    state = {"data": {"ids": [], "epoch": 0}, "w": torch.zeros(4)}
    ckptlib.load(tmp_path / "c", state)
    assert state["data"] == {"ids": ids, "epoch": 3} and torch.equal(state["w"], torch.arange(4.0))


def test_verify_names_the_damaged_tensor(tmp_path):
    """`ckpt verify` names the tensor a checksum mismatch is in, as a load does."""
    from ckptlib.cli import main as cli_main

    path = str(tmp_path / "c")
    ckptlib.save(path, {"model": {"w": torch.arange(100000.0)}, "step": 1})
    shard = os.path.join(path, "__0_0.distcp")
    with open(shard, "r+b") as f:
        f.seek(os.path.getsize(shard) // 2)
        f.write(b"\xff\xff\xff\xff")
    from ckptlib.format.verify import verify

    problems = [p for p in verify(path) if "checksum" in p.message]
    assert [p.message.split(" at offset ")[0] for p in problems] == ["checksum mismatch in tensor 'model.w'"]
    assert cli_main(["verify", path, "--no-progress"]) == 1
