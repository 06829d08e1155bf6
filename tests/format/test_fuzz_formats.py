"""Fuzzing the on-disk formats: mutated manifests, `.metadata` pickles (mutated objects re-pickled
with the same allowed classes), safetensors headers and the zip records inside `.distcp` shards.

Every load (verified and not), `verify` and `inspect` (`summarize`) of a mutated checkpoint must
either succeed or raise a `CheckpointError` within a time bound, never another exception type
and never a hang. A verified load of a mutation the manifest does not vouch for ("raw": the
checksums were not recomputed) that succeeds must be bit-exact. A "re-signed" mutation (every
checksum recomputed to match: a consistent lie no checksum can catch) may load other values,
but still only into the shapes and dtypes the state asked for.

Deterministic in CI: derandomized, no example database, a fixed number of examples per format.
Each example has a hypothesis deadline and a SIGALRM watchdog that fails it if it hangs.
"""

from __future__ import annotations

import copy
import dataclasses
import datetime
import json
import os
import pickle
import shutil
import signal
import struct
import tempfile
import zlib

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ckptlib
from ckptlib.format.native.manifest import MANIFEST_NAME, METADATA_NAME
from ckptlib.format.native.safe_pickle import safe_loads
from ckptlib.format.verify import summarize, verify

WATCHDOG_SECONDS = 30

FUZZ = settings(
    max_examples=int(os.environ.get("CKPTLIB_FUZZ_EXAMPLES", "40")),
    deadline=datetime.timedelta(seconds=20),
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large],
)


def _reference() -> dict:
    gen = torch.Generator().manual_seed(11)
    return {
        "w": torch.randn(3, 4, generator=gen),
        "i": torch.arange(5, dtype=torch.int64),
        "big": torch.randn(300, 1000, generator=gen),  # > 1 MiB: the direct-read fast path and blocks
        "h": torch.randn(7, generator=gen).to(torch.bfloat16),
        "extra": {"n": 3, "s": "text"},
    }


def _empty() -> dict:
    return {
        "w": torch.zeros(3, 4),
        "i": torch.zeros(5, dtype=torch.int64),
        "big": torch.zeros(300, 1000),
        "h": torch.zeros(7, dtype=torch.bfloat16),
        "extra": {"n": 0, "s": ""},
    }


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    root = tmp_path_factory.mktemp("fuzz_base")
    ckptlib.save(str(root / "ckpt"), _reference(), step=7)
    st_dir = root / "st"
    st_dir.mkdir()
    from safetensors.torch import save_file

    save_file({k: v for k, v in _reference().items() if k != "extra"}, str(st_dir / "model.safetensors"))
    return root


class _Hang(Exception):
    pass


def _alarm(signum, frame):
    raise _Hang(f"no answer within {WATCHDOG_SECONDS} s")


def _outcome(fn):
    """('ok', value) or ('error', exception), under the SIGALRM watchdog."""
    previous = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(WATCHDOG_SECONDS)
    try:
        return "ok", fn()
    except _Hang:
        raise
    except Exception as exc:  # noqa: BLE001 - classified by the caller
        return "error", exc
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def _assert_checkpoint_error(what: str, outcome, mutation: str) -> None:
    status, value = outcome
    if status == "error" and not isinstance(value, ckptlib.CheckpointError):
        raise AssertionError(f"{what} raised {type(value).__name__}: {value} after mutation {mutation}") from value


def _same_layout(state: dict) -> bool:
    empty = _empty()
    return all(state[k].shape == empty[k].shape and state[k].dtype == empty[k].dtype for k in ("w", "i", "big", "h"))


def _bit_exact(state: dict) -> bool:
    ref = _reference()
    return all(torch.equal(state[k], ref[k]) for k in ("w", "i", "big", "h")) and state["extra"] == ref["extra"]


def _check_everything(path: str, mutation: str, *, vouched: bool) -> None:
    """Load (verified and not), verify and summarize `path`; see the module docstring."""
    for verify_reads in (True, False):
        state = _empty()
        outcome = _outcome(lambda: ckptlib.load(path, state, verify=verify_reads))
        _assert_checkpoint_error(f"load(verify={verify_reads})", outcome, mutation)
        if outcome[0] == "ok":
            assert _same_layout(state), f"load(verify={verify_reads}) changed the state's layout after {mutation}"
            if verify_reads and vouched:
                assert _bit_exact(state), f"a verified load returned other values after {mutation}"
    _assert_checkpoint_error("verify", _outcome(lambda: verify(path)), mutation)
    _assert_checkpoint_error("inspect", _outcome(lambda: summarize(path)), mutation)


def _copy(base, name: str) -> str:
    target = tempfile.mkdtemp(prefix="fuzz_", dir=str(base))
    shutil.copytree(str(base / name), os.path.join(target, name))
    return os.path.join(target, name)


# --------------------------------------------------------------------------- JSON mutations

ODD_VALUES = [
    None,
    True,
    -1,
    0,
    1,
    2**31,
    2**63,
    10**12,
    -(10**12),
    1.5,
    float("nan"),
    "",
    "x",
    "../x",
    "/etc/passwd",
    [],
    [0],
    [0, 0, 0],
    {},
    {"x": 1},
]


def _json_paths(doc, prefix=()):
    yield prefix
    if isinstance(doc, dict):
        for k, v in doc.items():
            yield from _json_paths(v, prefix + (k,))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            yield from _json_paths(v, prefix + (i,))


def _mutate_json(data, doc):
    """A copy of `doc` with one value replaced, deleted, or nudged; and a description."""
    doc = copy.deepcopy(doc)
    paths = [p for p in _json_paths(doc) if p]
    path = data.draw(st.sampled_from(paths), label="json path")
    parent = doc
    for key in path[:-1]:
        parent = parent[key]
    key = path[-1]
    old = parent[key]
    action = data.draw(st.sampled_from(["replace", "delete", "nudge"]), label="action")
    if action == "delete":
        del parent[key]
        return doc, f"delete {list(path)}"
    if action == "nudge" and isinstance(old, int) and not isinstance(old, bool):
        new = old + data.draw(st.sampled_from([-1, 1, -8, 8, 1 << 20, -old]), label="delta")
    else:
        new = data.draw(st.sampled_from(ODD_VALUES), label="value")
    parent[key] = new
    return doc, f"{list(path)}: {old!r} -> {new!r}"


def _manifest_doc(path: str) -> dict:
    with open(os.path.join(path, MANIFEST_NAME), "rb") as f:
        return json.loads(f.read())


def _write_manifest(path: str, doc: dict, *, resign: bool) -> None:
    doc = dict(doc)
    if resign:
        doc.pop("checksum", None)
        doc["checksum"] = zlib.crc32(json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode())
    with open(os.path.join(path, MANIFEST_NAME), "w") as f:
        json.dump(doc, f)


def _resign_file(path: str, name: str) -> None:
    """Make the manifest vouch for file `name` as it is now (sizes, file, item and block CRCs)."""
    doc = _manifest_doc(path)
    record = doc["files"].get(name)
    with open(os.path.join(path, name), "rb") as f:
        data = f.read()
    if record is None or not isinstance(record, dict):
        return
    record["size"] = len(data)
    record["crc32"] = zlib.crc32(data)
    items = []
    for item in record.get("items", []):
        off, length = item[0], item[1]
        items.append([off, length, zlib.crc32(data[off : off + length])])
    record["items"] = items
    blocks = record.get("blocks")
    if isinstance(blocks, dict) and blocks.get("size"):
        size = blocks["size"]
        blocks["crc32"] = [zlib.crc32(data[i : i + size]) for i in range(0, len(data), size)]
    _write_manifest(path, doc, resign=True)


@FUZZ
@given(data=st.data())
def test_fuzz_manifest(base, data):
    path = _copy(base, "ckpt")
    doc, mutation = _mutate_json(data, _manifest_doc(path))
    resign = data.draw(st.booleans(), label="resign")
    _write_manifest(path, doc, resign=resign)
    # a re-signed manifest may lie about anything except the bytes of the files it lists
    _check_everything(path, f"manifest {mutation} (resigned={resign})", vouched=not resign)


# --------------------------------------------------------------------------- .metadata mutations


def _mutate_metadata(data, metadata):
    metadata = copy.deepcopy(metadata)
    sdm, storage = metadata.state_dict_metadata, metadata.storage_data
    target = data.draw(
        st.sampled_from(["size", "chunk", "dtype", "drop-entry", "storage", "drop-storage", "swap"]),
        label="metadata target",
    )
    tensors = sorted(k for k, v in sdm.items() if hasattr(v, "chunks"))
    number = st.sampled_from([0, 1, 2, 3, 5, 299, 300, 301, 1000, 10**7, -1])
    if target in ("size", "chunk", "dtype"):
        fqn = data.draw(st.sampled_from(tensors), label="tensor")
        md = sdm[fqn]
        if target == "size":
            dims = list(md.size)
            dims = dims + [1] if not dims or data.draw(st.booleans()) else dims
            dims[data.draw(st.integers(0, len(dims) - 1))] = data.draw(number)
            md.size = torch.Size([max(d, 0) for d in dims]) if all(d >= 0 for d in dims) else dims
            return metadata, f"{fqn} size -> {md.size}"
        if target == "dtype":
            md.properties.dtype = data.draw(st.sampled_from([torch.float16, torch.int64, torch.uint8, torch.float64]))
            return metadata, f"{fqn} dtype -> {md.properties.dtype}"
        chunk = md.chunks[0]
        field = data.draw(st.sampled_from(["offsets", "sizes", "drop", "duplicate"]))
        if field == "drop":
            md.chunks = md.chunks[1:]
        elif field == "duplicate":
            md.chunks = md.chunks + [chunk]
        else:
            values = list(getattr(chunk, field))
            if values:
                values[data.draw(st.integers(0, len(values) - 1))] = data.draw(number)
            md.chunks = [dataclasses.replace(chunk, **{field: torch.Size([max(v, 0) for v in values])})] + md.chunks[1:]
        return metadata, f"{fqn} chunk {field}"
    if target == "drop-entry":
        fqn = data.draw(st.sampled_from(sorted(sdm)))
        del sdm[fqn]
        return metadata, f"drop {fqn}"
    keys = sorted(storage, key=repr)
    index = data.draw(st.sampled_from(keys), label="storage key")
    if target == "drop-storage":
        del storage[index]
        return metadata, f"drop storage of {index}"
    if target == "swap":
        other = data.draw(st.sampled_from(keys), label="other key")
        storage[index], storage[other] = storage[other], storage[index]
        return metadata, f"swap storage of {index.fqn} and {other.fqn}"
    info = storage[index]
    field = data.draw(st.sampled_from(["offset", "length", "relative_path"]))
    if field == "relative_path":
        value = data.draw(st.sampled_from(["__1_0.distcp", "../__0_0.distcp", ".metadata", "ckptlib.json", ""]))
    else:
        value = getattr(info, field) + data.draw(st.sampled_from([-1, 1, -100, 100, 10**9, -getattr(info, field)]))
    storage[index] = dataclasses.replace(info, **{field: value})
    return metadata, f"{index.fqn} storage {field} -> {value!r}"


@FUZZ
@given(data=st.data())
def test_fuzz_metadata_pickle(base, data):
    path = _copy(base, "ckpt")
    with open(os.path.join(path, METADATA_NAME), "rb") as f:
        metadata = safe_loads(f.read(), "fuzz")
    metadata, mutation = _mutate_metadata(data, metadata)
    with open(os.path.join(path, METADATA_NAME), "wb") as f:
        pickle.dump(metadata, f)
    resign = data.draw(st.booleans(), label="resign")
    if resign:
        _resign_file(path, METADATA_NAME)
    _check_everything(path, f".metadata {mutation} (resigned={resign})", vouched=not resign)


# --------------------------------------------------------------------------- zip records in .distcp


def _positions(blob: bytes, magic: bytes) -> list[int]:
    found, start = [], 0
    while (at := blob.find(magic, start)) >= 0:
        found.append(at)
        start = at + 1
    return found


ZIP_RECORDS = {
    "local-header": (b"PK\x03\x04", 30),
    "central-directory": (b"PK\x01\x02", 46),
    "end-of-central-directory": (b"PK\x05\x06", 22),
    "zip64-end": (b"PK\x06\x06", 56),
}


@FUZZ
@given(data=st.data())
def test_fuzz_distcp_zip_records(base, data):
    path = _copy(base, "ckpt")
    name = "__0_0.distcp"
    with open(os.path.join(path, name), "rb") as f:
        blob = bytearray(f.read())
    region = data.draw(st.sampled_from(sorted(ZIP_RECORDS) + ["data"]), label="region")
    if region == "data":
        at = data.draw(st.integers(0, len(blob) - 1), label="offset")
    else:
        magic, length = ZIP_RECORDS[region]
        starts = _positions(bytes(blob), magic)
        if not starts:
            return
        at = data.draw(st.sampled_from(starts)) + data.draw(st.integers(0, length - 1), label="field byte")
        at = min(at, len(blob) - 1)
    flip = data.draw(st.integers(1, 255), label="xor")
    blob[at] ^= flip
    with open(os.path.join(path, name), "wb") as f:
        f.write(blob)
    resign = data.draw(st.booleans(), label="resign")
    if resign:
        _resign_file(path, name)
    _check_everything(path, f"{name} {region} byte {at} ^= {flip:#x} (resigned={resign})", vouched=not resign)


# --------------------------------------------------------------------------- safetensors headers


def _st_parts(path: str) -> tuple[dict, bytes]:
    with open(path, "rb") as f:
        blob = f.read()
    (n,) = struct.unpack("<Q", blob[:8])
    return json.loads(blob[8 : 8 + n]), blob[8 + n :]


@FUZZ
@given(data=st.data())
def test_fuzz_safetensors_header(base, data):
    path = _copy(base, "st")
    file = os.path.join(path, "model.safetensors")
    header, body = _st_parts(file)
    header, mutation = _mutate_json(data, header)
    encoded = json.dumps(header).encode()
    if data.draw(st.booleans(), label="lie about the length"):
        length = len(encoded) + data.draw(st.sampled_from([-1, 1, -8, 8, 10**9, 2**63]), label="delta")
        mutation += f", header length {length}"
    else:
        length = len(encoded)
    with open(file, "wb") as f:
        f.write(struct.pack("<Q", max(0, min(length, 2**64 - 1))) + encoded + body)
    state = {"model": {k: v for k, v in _empty().items() if k != "extra"}}
    outcome = _outcome(lambda: ckptlib.load(path, state))
    _assert_checkpoint_error("safetensors load", outcome, mutation)
    if outcome[0] == "ok":
        assert all(state["model"][k].dtype == _empty()[k].dtype for k in state["model"]), mutation
