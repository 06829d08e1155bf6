"""The scene of one crash case (`crash_points`): a fresh checkpoint root on one backend with a
user's files planted in it, the states each step holds, and the checks every operation's
invariants are built from (bit-exact loads, exact trees, errors that name a path)."""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Any

import torch

from ckptlib.testing.harness.crash_points import Outcome, Watch

#: A DCP checkpoint of one rank, as ckptlib commits it.
CHECKPOINT_FILES = frozenset({".metadata", "__0_0.distcp", "ckptlib.json"})
#: The files a user keeps beside ckptlib's: in the root, and inside a checkpoint directory.
USER_NOTE = b"the user's own notes: ckptlib must never touch this file\n"
#: Transfer settings for S3 cases: streams above 4 KiB are multipart uploads (one part),
#: `.metadata` and the manifest single puts, one request at a time (a deterministic order).
S3_CASE_ENV = (("CKPTLIB_S3_MULTIPART_THRESHOLD", "4096"), ("CKPTLIB_S3_MAX_CONCURRENCY", "1"))


def state(step: int) -> dict[str, Any]:
    """What step `step` saves: two tensors (the shard is over the S3 cases' multipart threshold)."""
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(48, 32, generator=g), "b": torch.randn(7, generator=g), "step": step}


def template() -> dict[str, Any]:
    return {"w": torch.zeros(48, 32), "b": torch.zeros(7), "step": -1}


def assert_state(got: dict[str, Any], step: int, where: str) -> None:
    want = state(step)
    assert got["step"] == step, f"{where}: holds step {got['step']}, expected {step}"
    for key in ("w", "b"):
        assert torch.equal(got[key], want[key]), f"{where}: {key} is not bit-exactly step {step}'s"


def load_exact(uri: str, step: int) -> None:
    """The checkpoint at `uri` loads step `step`'s state bit-exactly."""
    import ckptlib

    got = template()
    ckptlib.load(uri, got)
    assert_state(got, step, uri)


@dataclasses.dataclass
class Scene:
    """One case's world: `local` a fresh directory (always), `root` the checkpoint root on
    `backend` (local: `local/root`; s3: a fresh prefix), `base` what boundary paths are
    relative to on that backend."""

    backend: str
    local: str
    root: str
    bucket: str | None = None
    prefix: str = ""
    data: dict[str, Any] = dataclasses.field(default_factory=dict)

    @classmethod
    def make(cls, backend: str, local: str, s3_base: str | None = None) -> "Scene":
        os.makedirs(local, exist_ok=True)
        if backend == "local":
            return cls("local", local, os.path.join(local, "root"))
        assert s3_base is not None and s3_base.startswith("s3://"), "an s3 case needs an s3:// base"
        bucket, _, base = s3_base[len("s3://") :].partition("/")
        prefix = "/".join(p for p in (base.strip("/"), os.path.basename(local)) if p)
        return cls("s3", local, f"s3://{bucket}/{prefix}", bucket=bucket, prefix=prefix)

    def uri(self, *parts: str) -> str:
        return "/".join([self.root.rstrip("/"), *parts])

    def storage(self, *parts: str):
        from ckptlib.storage import open_storage

        return open_storage(self.uri(*parts))

    def watch(self) -> Watch:
        if self.backend == "local":
            return Watch(local=self.local)
        return Watch(local=self.local, s3_bucket=self.bucket, s3_prefix=self.prefix, env=S3_CASE_ENV)

    def boundary_uri(self, backend: str, rel: str) -> str:
        base = self.local if backend == "local" else f"s3://{self.bucket}/{self.prefix}"
        return f"{base}/{rel}" if rel not in ("", ".") else base

    def plant(self, *rel: str) -> None:
        """A user's file at each of `rel` (below the root)."""
        for path in rel:
            self.storage().write(path, USER_NOTE)
        self.data.setdefault("planted", []).extend(rel)

    def tree(self, *parts: str, contents: bool = True) -> dict[str, bytes]:
        """Every file below root/parts with its bytes (b"" unless `contents`); a local
        symlink as b'-> target'."""
        if self.backend == "local":
            top = os.path.join(self.root, *parts)
            out: dict[str, bytes] = {}
            for dirpath, dirnames, filenames in os.walk(top):
                for name in dirnames + filenames:
                    full = os.path.join(dirpath, name)
                    rel = os.path.relpath(full, top)
                    if os.path.islink(full):
                        out[rel] = b"-> " + os.readlink(full).encode()
                    elif name in filenames:
                        with open(full, "rb") as f:
                            out[rel] = f.read()
            return out
        store = self.storage(*parts)
        return {name: bytes(store.read(name)) if contents else b"" for name in store.list()}

    def assert_user_files(self) -> None:
        store = self.storage()
        for rel in self.data.get("planted", []):
            try:
                data = bytes(store.read(rel))
            except FileNotFoundError:
                data = None
            assert data == USER_NOTE, f"the user's file {self.uri(rel)} was changed or removed"


# ---------------------------------------------------------------- checks shared by operations

_OWN_DEBRIS = re.compile(
    r"(^|/)(ckptlib\.json|ckptlib\.pending|\.metadata|__\d+_\d+\.distcp|latest|ckptlib\.lock)(\.tmp-[0-9a-f]{8})?$"
    r"|(^|/)step_\d+(\.deleting-[0-9a-f]{8})?(/|$)"
)


def assert_tree(scene: Scene, expected: set[str], *parts: str) -> None:
    """The files below root/parts are exactly `expected` (the user's files included)."""
    got = set(scene.tree(*parts, contents=False))
    where = scene.uri(*parts)
    assert got == expected, (
        f"{where}: unexpected files {sorted(got - expected)}, missing {sorted(expected - got)}"
        if got - expected or expected - got
        else where
    )


def assert_named_error(scene: Scene, outcome: Outcome, at: int) -> None:
    """A failed operation raised a CheckpointError subclass naming the failing file or a
    directory above it (never the bare OSError or botocore error)."""
    mro = outcome.error_mro
    assert "ckptlib.errors.CheckpointError" in mro, (
        f"raised {outcome.error_type}, not a CheckpointError: {outcome.error_message}\n{outcome.error_traceback}"
    )
    boundary = outcome.boundaries[at]
    rel = re.sub(r"\.(tmp|deleting)-~$", "", boundary.path)
    rel = re.sub(r"\.tmp$", "", rel)
    names = []
    while rel not in ("", "."):
        names.append(scene.boundary_uri(boundary.backend, rel))
        rel = os.path.dirname(rel)
    message = outcome.error_message or ""
    assert any(name in message for name in names), (
        f"the {outcome.error_type} names none of {names}: {message!r}\n{outcome.error_traceback}"
    )


def assert_committed_or_absent(scene: Scene, rel: str, step: int) -> bool:
    """root/rel is committed and loads step `step` exactly (True), or is no committed
    checkpoint and loading it fails with a CheckpointError (False)."""
    import ckptlib
    from ckptlib.format.native.layout import classify

    where = scene.storage(rel)
    if classify(where) == "committed":
        load_exact(scene.uri(rel), step)
        return True
    try:
        ckptlib.load(scene.uri(rel), template())
    except ckptlib.CheckpointError:
        return False
    raise AssertionError(f"{scene.uri(rel)} is not committed, yet it loads")


def debris(scene: Scene, clean: set[str]) -> list[str]:
    """Files beyond `clean`: each must be one of ckptlib's own names (its temporary files,
    a directory being deleted), never a user's; returned for the caller to judge."""
    extra = sorted(set(scene.tree(contents=False)) - clean)
    foreign = [name for name in extra if not _OWN_DEBRIS.search(name)]
    assert not foreign, f"{scene.root}: files neither ckptlib's nor the user's appeared: {foreign}"
    return extra


__all__ = [
    "CHECKPOINT_FILES",
    "S3_CASE_ENV",
    "Scene",
    "USER_NOTE",
    "assert_committed_or_absent",
    "assert_named_error",
    "assert_state",
    "assert_tree",
    "debris",
    "load_exact",
    "state",
    "template",
]
