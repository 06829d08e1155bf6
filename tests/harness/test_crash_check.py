"""The crash harness for any checkpointer (`ckptlib.testing.crash_check`, issue 48 item 4):
the probe's boundaries in one process (every interposed call, exactly), the judge of a load's
outcome (every violation's message), and crash_check on 2 ranks against test-local
checkpointers: one that moves `latest` before its files are complete (a violation naming the
boundary), ckptlib's manager (crash consistent), plain DCP as its tutorials show it (raises
after a crash mid-save: no violation, but no resume either), and one that writes below Python
(its files reported unseen). The full sweeps are in the extended suite."""

from __future__ import annotations

import io
import os
import shutil

import pytest
import torch
import torch.distributed as dist

from ckptlib.testing.checkpointers.crash_check import CrashReport, _sample, _select, crash_check, judge
from ckptlib.testing.checkpointers.crash_probe import Boundary, Plan, RankProbe, normalize, read_trace, unseen
from ckptlib.testing.checkpointers.crash_ranks import one_line
from ckptlib.testing.checkpointers.protocol import CheckpointerError

# ---------------------------------------------------------------- test-local checkpointers


class PointerFirst:
    """A homegrown wrapper that moves `latest` before its files are written, and whose load
    treats a missing optimizer file as optional (a fresh optimizer): the bug issue 48 names."""

    def save(self, root, step, state):
        rank = dist.get_rank()
        folder = os.path.join(root, f"step_{step}")
        if rank == 0:
            os.makedirs(folder, exist_ok=True)
            with open(os.path.join(root, "latest"), "w") as f:
                f.write(str(step))
        dist.barrier()
        torch.save(state["model"].state_dict(), os.path.join(folder, f"model{rank}.pt"))
        torch.save(state["optim"].state_dict(), os.path.join(folder, f"optim{rank}.pt"))
        dist.barrier()

    def load(self, root, state):
        pointer = os.path.join(root, "latest")
        if not os.path.exists(pointer):
            return None
        with open(pointer) as f:
            step = int(f.read())
        rank = dist.get_rank()
        folder = os.path.join(root, f"step_{step}")
        state["model"].load_state_dict(torch.load(os.path.join(folder, f"model{rank}.pt")))
        optim = os.path.join(folder, f"optim{rank}.pt")
        if os.path.exists(optim):
            state["optim"].load_state_dict(torch.load(optim))
        return step


class ManagerCheckpointer:
    """Correct: ckptlib's public CheckpointManager (commit, then `latest`)."""

    def save(self, root, step, state):
        import ckptlib

        ckptlib.CheckpointManager(root).save(step, state)

    def load(self, root, state):
        import ckptlib

        return ckptlib.CheckpointManager(root).load(state)


class TutorialDCP:
    """Plain DCP as its tutorials show it: dcp.save to step_N, the newest step_N by listing."""

    def save(self, root, step, state):
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(state["model"], state["optim"])
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=os.path.join(root, f"step_{step}"))

    def load(self, root, state):
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        names = os.listdir(root) if os.path.isdir(root) else []
        steps = sorted(int(name[len("step_") :]) for name in names if name.startswith("step_"))
        if not steps:
            return None
        model_sd, optim_sd = get_state_dict(state["model"], state["optim"])
        loaded = {"model": model_sd, "optim": optim_sd}
        dcp.load(loaded, checkpoint_id=os.path.join(root, f"step_{steps[-1]}"))
        set_state_dict(
            state["model"], state["optim"], model_state_dict=loaded["model"], optim_state_dict=loaded["optim"]
        )
        return steps[-1]


class RustWriter:
    """Writes its tensors with safetensors' Rust writer (below Python) and `latest` with open."""

    carries = ("model",)

    def save(self, root, step, state):
        from safetensors.torch import save_file

        rank = dist.get_rank()
        if rank == 0:
            os.makedirs(os.path.join(root, f"step_{step}"), exist_ok=True)
        dist.barrier()
        save_file(state["model"].state_dict(), os.path.join(root, f"step_{step}", f"model{rank}.safetensors"))
        dist.barrier()
        if rank == 0:
            with open(os.path.join(root, "latest"), "w") as f:
                f.write(str(step))
        dist.barrier()

    def load(self, root, state):
        from safetensors.torch import load_file

        pointer = os.path.join(root, "latest")
        if not os.path.exists(pointer):
            return None
        with open(pointer) as f:
            step = int(f.read())
        path = os.path.join(root, f"step_{step}", f"model{dist.get_rank()}.safetensors")
        state["model"].load_state_dict(load_file(path))
        return step


REF = __name__  # the test module, as the ranks import it


# ---------------------------------------------------------------- the probe, in this process


def _probed(tmp_path, action, **roots):
    plan = Plan(0, str(tmp_path / "rank0.jsonl"))
    probe = RankProbe(plan, **roots)
    probe.install()
    try:
        action()
    finally:
        probe.uninstall()
    return probe


def test_the_probe_makes_every_write_call_below_the_root_a_boundary(tmp_path):
    root = tmp_path / "root"
    root.mkdir()
    (root / "old").mkdir()
    (root / "old" / "f").write_bytes(b"x")
    (root / "gone").write_bytes(b"x")
    outside = tmp_path / "outside.txt"

    def act():
        os.makedirs(root / "step_2" / "sub")
        with open(root / "step_2" / "a.bin", "wb") as f:
            for chunk in (b"1", b"2", b"3"):
                f.write(chunk)
            f.flush()
            os.fsync(f.fileno())
        (root / "step_2" / "b.txt").write_text("hi")  # pathlib: io.open
        fd = os.open(root / "tmp-latest", os.O_WRONLY | os.O_CREAT, 0o644)
        os.write(fd, b"2")
        os.close(fd)
        os.replace(root / "tmp-latest", root / "latest")
        os.symlink("step_2", root / "link")
        torch.save({"w": torch.ones(2)}, str(root / "step_2" / "t.pt"))
        with io.BytesIO() as buffer:  # a buffer is no file: no boundary
            torch.save({"w": torch.ones(2)}, buffer)
        outside.write_text("not below the root")
        shutil.copyfile(outside, root / "copy")  # open, then the kernel copies (sendfile)
        os.truncate(root / "copy", 4)
        with open(root / "latest", "rb") as f:  # a read: no boundary
            f.read()
        os.unlink(root / "gone")
        shutil.rmtree(root / "old")  # one boundary; its own unlinks are part of it
        os.rmdir(root / "step_2" / "sub")

    probe = _probed(tmp_path, act, local=str(root))
    got = [(b.kind, b.path) for b in probe.seen]
    assert got == [
        ("mkdir", "step_2"),
        ("mkdir", "step_2/sub"),
        ("open-write", "step_2/a.bin"),
        ("write", "step_2/a.bin"),
        ("write", "step_2/a.bin"),
        ("flush", "step_2/a.bin"),
        ("fsync", "step_2/a.bin"),
        ("close", "step_2/a.bin"),
        ("open-write", "step_2/b.txt"),
        ("write", "step_2/b.txt"),
        ("close", "step_2/b.txt"),
        ("open-write", "tmp-latest"),
        ("write", "tmp-latest"),
        ("close", "tmp-latest"),
        ("rename", "tmp-latest -> latest"),
        ("symlink", "link"),
        ("torch-save-open", "step_2/t.pt"),
        ("torch-save-close", "step_2/t.pt"),
        ("open-write", "copy"),
        ("write", "copy"),
        ("close", "copy"),
        ("truncate", "copy"),
        ("unlink", "gone"),
        ("rmtree", "old"),
        ("rmdir", "step_2/sub"),
    ]
    # the trace file holds the same sequence, and everything is undone
    assert read_trace(str(tmp_path / "rank0.jsonl"))[0] == probe.seen
    assert open is io.open and os.replace.__module__ == "posix" and shutil.rmtree.__module__ == "shutil"
    assert torch.load(str(root / "step_2" / "t.pt"))["w"].tolist() == [1.0, 1.0]


def _victim(root: str, trace: str, victims: str, peer: int) -> None:
    probe = RankProbe(Plan(0, trace, kill_at=2, victims=victims, pids=(peer, os.getpid())), local=root)
    probe.install()
    os.makedirs(os.path.join(root, "a"))  # boundary 0
    os.makedirs(os.path.join(root, "b"))  # boundary 1: killed before it runs
    os._exit(0)


@pytest.mark.parametrize("victims", ["one", "all"])
def test_the_victim_dies_at_its_boundary_and_with_all_its_peers_first(tmp_path, victims):
    import multiprocessing
    import signal
    import time

    ctx = multiprocessing.get_context("fork")
    peer = ctx.Process(target=time.sleep, args=(60,), daemon=True)
    peer.start()
    root, trace = str(tmp_path / "root"), str(tmp_path / "rank0.jsonl")
    victim = ctx.Process(target=_victim, args=(root, trace, victims, peer.pid), daemon=True)
    victim.start()
    victim.join(30)
    peer.join(1)
    try:
        assert victim.exitcode == -signal.SIGKILL
        assert peer.exitcode == (-signal.SIGKILL if victims == "all" else None)  # "one": the peer lives on
    finally:
        peer.kill()
        peer.join(10)
    seen, killed, how = read_trace(trace)
    assert [(b.kind, b.path) for b in seen] == [("mkdir", "."), ("mkdir", "a"), ("mkdir", "b")]
    assert (killed, how) == (2, victims)
    assert os.listdir(root) == ["a"]


class _MemoryClient:
    """An in-memory object store behind ckptlib's ObjectStorage (S3's surface)."""

    scheme, label, sdk, delete_batch, writes_into = "s3", "S3", None, 1000, False

    def __init__(self):
        self.objects: dict[str, bytes] = {}

    def put(self, key, data, *, if_absent=False, content_type=None):
        self.objects[key] = bytes(data)

    def delete(self, keys):
        for key in keys:
            self.objects.pop(key, None)
        return []

    def list(self, key_prefix):
        return [(k, len(v)) for k, v in sorted(self.objects.items()) if k.startswith(key_prefix)]

    def abort_uploads(self, key_prefix):
        pass

    def secrets(self):
        return []


def _object_storage(scheme: str):
    if scheme == "s3":
        from ckptlib.storage.s3 import S3Storage as cls
    elif scheme == "gs":
        from ckptlib.storage.gcs import GCSStorage as cls
    else:
        from ckptlib.storage.azure import AzureStorage as cls
    return cls


@pytest.mark.parametrize("scheme", ["s3", "gs", "az"])
def test_the_probe_makes_every_mutating_object_store_request_a_boundary(tmp_path, scheme):
    cls = _object_storage(scheme)
    store = cls("bucket", "run/root")
    store._api = _MemoryClient()
    other = cls("bucket", "run/other")  # beside the root: no boundary
    other._api = store._api

    def act():
        store.write("step_1/a", b"1")
        store.write("step_2/a", b"2")
        store.set_pointer("latest", "step_2")
        other.write("x", b"x")
        store.delete(["step_2/a"])
        store.delete_tree("step_1")

    probe = _probed(tmp_path, act, objects=f"{scheme}://bucket/run/root")
    assert [(b.kind, b.path) for b in probe.seen] == [
        ("put", "step_1/a"),
        ("put", "step_2/a"),
        ("put-pointer", "latest"),
        ("delete", "step_2/a"),
        ("delete", "step_1/a"),
    ]


def test_normalize_hides_random_temporary_names():
    assert normalize("step_2/.metadata.tmp") == "step_2/.metadata.tmp"
    assert normalize("latest.tmp-1a2b3c4d") == "latest.tmp-~"
    assert normalize("tmpk3j_9x2a/file") == "~/file"
    assert normalize("x.0123456789abcdef01") == "x.~"
    assert normalize("step_0000000002/__0_0.distcp") == "step_0000000002/__0_0.distcp"


def test_unseen_names_files_no_boundary_names():
    seen = [
        Boundary(0, 0, "open-write", "step_2/a.tmp"),
        Boundary(0, 1, "rename", "step_2/a.tmp -> step_2/a"),
        Boundary(1, 0, "rmtree", "step_0"),
        Boundary(1, 1, "torch-save-open", "step_2/t.pt"),
    ]
    before = {"step_0/x": [1, 1, 1], "step_1/y": [1, 1, 2], "latest": [1, 1, 3]}
    after = {
        "step_2/a": [2, 2, 4],
        "step_2/t.pt": [2, 2, 5],
        "step_2/rust.safetensors": [9, 9, 6],
        "latest": [1, 5, 3],
        "step_1/y": [1, 1, 2],
    }
    assert unseen(before, after, seen) == ["wrote latest", "wrote step_2/rust.safetensors"]
    after.pop("step_1/y")
    assert unseen(before, after, seen)[-1] == "removed step_1/y"


# ---------------------------------------------------------------- the judge


def _loaded(step, holds, differs=None):
    return {"step": step, "holds": holds, "differs": differs or {}}


@pytest.mark.parametrize(
    "results, hung, expected",
    [
        pytest.param([_loaded(1, 1), _loaded(1, 1)], False, ("resumed-1", "", ""), id="resumed-committed"),
        pytest.param([_loaded(2, 2), _loaded(2, 2)], False, ("resumed-2", "", ""), id="resumed-killed"),
        pytest.param(
            [{"error": "FileNotFoundError: x"}, _loaded(1, 1)],
            False,
            ("raised", "rank 0: FileNotFoundError: x", ""),
            id="raised",
        ),
        pytest.param(
            [_loaded(None, None), _loaded(None, None)],
            False,
            ("lost", "", "the load found no step: step 1, committed before the crash, is lost"),
            id="lost",
        ),
        pytest.param(
            [_loaded(2, 2), _loaded(1, 1)],
            False,
            ("mixed", "", "the ranks resumed different steps: {0: 2, 1: 1}"),
            id="mixed",
        ),
        pytest.param(
            [_loaded(0, None), _loaded(0, None)],
            False,
            ("wrong", "", "the load resumed step 0, neither 1 (committed) nor 2 (killed)"),
            id="wrong-step",
        ),
        pytest.param(
            [_loaded(2, 2), _loaded(2, 1)],
            False,
            ("wrong", "", "the load resumed step 2, but rank 1 holds step 1's state"),
            id="wrong-state",
        ),
        pytest.param(
            [_loaded(2, 2), _loaded(2, None, {1: "model.w: values differ", 2: "optim.state.0.step: values differ"})],
            False,
            (
                "half-written",
                "",
                "the load resumed step 2, which is not step 2's state bit-exactly (a half-written step): "
                "rank 1: optim.state.0.step: values differ",
            ),
            id="half-written",
        ),
        pytest.param([_loaded(1, 1), None], True, ("hung", "", "the load hung (rank 1 did not return)"), id="hung"),
        pytest.param(
            [RuntimeError("gloo: Connection closed by peer\nmore"), _loaded(1, 1)],
            False,
            ("crashed", "", "the load crashed (rank 0: gloo: Connection closed by peer)"),
            id="crashed",
        ),
    ],
)
def test_judge_names_every_outcome(results, hung, expected):
    assert judge(results, hung) == expected


def test_sample_spreads_over_every_rank_and_keeps_first_and_last():
    points = [Boundary(r, i, "write", f"f{r}") for r in (0, 1) for i in range(5)]
    assert [b.point for b in _sample(points, 4)] == ["0#0", "0#3", "1#1", "1#4"]
    assert _sample(points, None) == points and _sample(points, 1) == points[-1:]


def test_select_names_points_by_index_or_by_call():
    points = [Boundary(0, 0, "mkdir", "step_2"), Boundary(1, 0, "open-write", "step_2/a")]
    assert _select(points, ["1:open-write:step_2/a", "0#0"]) == [points[1], points[0]]
    with pytest.raises(CheckpointerError, match=r"crash point '1#5': no such boundary \(found \['0#0', '1#0'\]\)"):
        _select(points, ["1#5"])


def test_unknown_victims_are_refused():
    with pytest.raises(CheckpointerError, match=r"victims \('some',\): expected some of \('one', 'all'\)"):
        crash_check(ManagerCheckpointer(), victims=("some",))


# ---------------------------------------------------------------- crash_check on 2 ranks


def test_a_checkpointer_that_moves_latest_before_its_files_is_reported_at_that_boundary():
    report = crash_check(f"{REF}:PointerFirst", points=["1:torch-save-open:step_2/optim1.pt"], victims=("one",))
    assert [(b.kind, b.path) for b in report.boundaries[1]] == [
        ("torch-save-open", "step_2/model1.pt"),
        ("torch-save-close", "step_2/model1.pt"),
        ("torch-save-open", "step_2/optim1.pt"),
        ("torch-save-close", "step_2/optim1.pt"),
    ]
    assert [(b.kind, b.path) for b in report.boundaries[0]][:4] == [
        ("mkdir", "step_2"),
        ("open-write", "latest"),
        ("write", "latest"),
        ("close", "latest"),
    ]
    assert report.baseline == "" and report.unseen == [] and not report.ok
    [case] = report.violations
    assert case.message == (
        "rank 1 killed at #2 torch-save-open step_2/optim1.pt: the load resumed step 2, which is not step 2's "
        "state bit-exactly (a half-written step): rank 1: optim.state.0.step: values differ"
    )
    assert [b.point for b in case.calls[1]] == ["1#0", "1#1", "1#2"]
    assert f"crash_check('{REF}:PointerFirst', world_size=2, wrap='plain', optim='adamw', points=['1#2'], " in (
        case.reproduction
    )
    assert "VIOLATION rank 1 killed at #2" in report.text() and report.text().endswith("NOT CRASH CONSISTENT")


def test_ckptlib_manager_is_crash_consistent_at_sampled_boundaries():
    report = crash_check(ManagerCheckpointer(), max_points=1)
    assert report.ok, report.text()
    assert report.unseen == [] and report.baseline == ""
    assert len(report.cases) == 2 and {c.outcome for c in report.cases} <= {"resumed-1", "resumed-2"}
    assert report.skipped == sum(len(b) for b in report.boundaries.values()) - 1
    kinds = [(b.kind, b.path) for b in report.boundaries[0]]
    assert ("symlink", "latest.tmp-~") in kinds or ("rename", "latest.tmp-~ -> latest") in kinds, kinds
    assert [(c.boundary, c.victims) for c in report.cases] == [(report.boundaries[1][-1], v) for v in ("one", "all")]


def test_tutorial_dcp_raises_after_a_crash_mid_save_instead_of_resuming():
    """What the harness finds for DCP as its tutorials use it: killed after step_2 exists but
    before its .metadata, the newest step by listing is step_2 and dcp.load raises. No
    violation (nothing half-written is resumed), but the run cannot resume by itself."""
    report = crash_check(TutorialDCP(), points=["1:open-write:step_2/__1_0.distcp"])
    assert report.ok, report.text()
    assert [c.outcome for c in report.cases] == ["raised", "raised"]
    assert all(".metadata" in c.detail for c in report.cases), [c.detail for c in report.cases]
    assert "2 cases raised on load: no violation, but that run cannot resume" in report.text()


def test_writes_below_python_are_reported_unseen():
    report = crash_check(RustWriter(), points=[])
    assert report.unseen == ["wrote step_2/model0.safetensors", "wrote step_2/model1.safetensors"]
    assert [(b.kind, b.path) for b in report.boundaries[0]] == [
        ("mkdir", "step_2"),
        ("open-write", "latest"),
        ("write", "latest"),
        ("close", "latest"),
    ]
    assert report.ok and report.cases == [] and isinstance(report, CrashReport)
    assert "unseen (written below Python, no boundary names them): wrote step_2/model0.safetensors" in report.text()


def test_a_load_error_is_reported_on_one_line_without_embedded_tracebacks():
    message = (
        "CheckpointException ranks:dict_keys([0, 1])\n"
        "Traceback (most recent call last): (RANK 0)\n"
        '  File "x.py", line 1, in f\n'
        "    result = func()\n"
        "             ^^^^^^\n"
        "AssertionError: metadata is None; global metadata read failed: step_2/.metadata\n"
    )
    assert one_line(message) == (
        "CheckpointException ranks:dict_keys([0, 1]) | AssertionError: metadata is None; global metadata read "
        "failed: step_2/.metadata"
    )
    assert len(one_line("x" * 1000)) == 400


@pytest.mark.s3
def test_object_store_requests_are_the_boundaries_on_s3(s3_root):
    report = crash_check(ManagerCheckpointer(), root=s3_root, points=["0:put-pointer:latest"], victims=("one",))
    assert report.ok and report.unseen == [], report.text()
    step = "step_0000000002"
    assert [(b.kind, b.path) for b in report.boundaries[0]] == [
        ("conditional-put", "ckptlib.lock"),
        ("put", f"{step}/ckptlib.pending"),
        ("put", f"{step}/__0_0.distcp"),
        ("put", f"{step}/.metadata"),
        ("put", f"{step}/ckptlib.json"),
        ("delete", f"{step}/ckptlib.pending"),
        ("put-pointer", "latest"),
        ("delete", "ckptlib.lock"),
    ]
    assert [(b.kind, b.path) for b in report.boundaries[1]] == [("put", f"{step}/__1_0.distcp")]
    [case] = report.cases
    assert case.outcome in ("resumed-1", "resumed-2") and case.boundary.point == "0#6"


# ---------------------------------------------------------------- the full sweeps (extended suite)


@pytest.mark.timeout(1800)
@pytest.mark.parametrize("wrap, points", [("plain", 10), ("fsdp2", 4)])
def test_ckptlib_managers_save_is_crash_consistent_at_many_boundaries(wrap, points):
    """Sampled (a manager save crosses about 50 boundaries on 2 ranks; every one of them is
    killed and failed by ckptlib's own harness, tests/manager/test_crash_boundaries.py)."""
    report = crash_check(ManagerCheckpointer(), wrap=wrap, max_points=points)
    assert report.ok, report.text()
    assert len(report.cases) == 2 * points and report.unseen == []
    assert {c.outcome for c in report.cases} <= {"resumed-1", "resumed-2"}, report.text()


@pytest.mark.timeout(1800)
def test_every_boundary_of_tutorial_dcp_raises_or_resumes():
    """The full sweep of DCP as its tutorials use it: no violation, and most kills leave a
    step_2 without .metadata that the newest-by-listing load picks and dcp.load refuses."""
    report = crash_check(TutorialDCP())
    assert report.ok, report.text()
    outcomes = {c.outcome for c in report.cases}
    assert outcomes <= {"resumed-1", "resumed-2", "raised", "not-reached"} and "raised" in outcomes, outcomes
    assert all(".metadata" in c.detail for c in report.raised), [c.detail for c in report.raised]
    assert report.skipped == 0 and len(report.cases) == 2 * sum(len(b) for b in report.boundaries.values())
