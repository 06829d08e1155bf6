"""Tests of the distributed test harness: ckptlib.testing.harness.launcher and its pytest plugin.

The rank bodies are module-level functions (they are pickled by reference and imported in
every rank).  No test asserts on timing.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from ckptlib.testing import (
    RankError,
    RankExited,
    RankTimeout,
    RemoteError,
    SkipLaunch,
    forkserver_pid,
    gpu_skip_reason,
    launch,
)

pytest_plugins = ["pytester"]

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# --------------------------------------------------------------------------- helpers


def _rank_processes() -> list[tuple[int, str]]:
    """(pid, state) of every process the forkserver of this process has forked and not reaped."""
    fs = forkserver_pid()
    if fs is None:
        return []
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[1]) == fs:
            found.append((int(entry), fields[0]))
    return found


@pytest.fixture(autouse=True)
def no_leftover_ranks():
    yield
    # a rank is killed *and reaped* before launch returns or raises
    assert multiprocessing.active_children() == []
    assert _rank_processes() == []


def _pid_gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except OSError:
        return True


class _NeedsKeyword(Exception):
    """Pickles, but cannot be unpickled (its __init__ needs a keyword argument)."""

    def __init__(self, message, *, code):
        super().__init__(message)
        self.code = code


class _Unpicklable(Exception):
    def __init__(self, message):
        super().__init__(message)
        self.lock = threading.Lock()


class _TaggedError(Exception):
    def __init__(self, message, rank=None):
        super().__init__(message, rank)
        self.message = message
        self.rank = rank

    def __str__(self):
        return self.message


# --------------------------------------------------------------------------- rank bodies


def _allreduce_rank():
    import torch
    import torch.distributed as dist

    t = torch.tensor([dist.get_rank()], dtype=torch.int64)
    dist.all_reduce(t)
    return {
        "rank": dist.get_rank(),
        "world_size": dist.get_world_size(),
        "sum": int(t.item()),
        "backend": dist.get_backend(),
        "env": {
            k: os.environ.get(k)
            for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR")
        },
    }


def _read_env(*names):
    return [os.environ.get(name) for name in names]


def _node_layout():
    return tuple(int(os.environ[k]) for k in ("RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK"))


def _add(a, b, *, scale=1):
    import torch.distributed as dist

    return (a + b) * scale + dist.get_rank()


def _return_tensor():
    import torch
    import torch.distributed as dist

    return torch.full((3,), float(dist.get_rank()))


def _raise_on_rank_1():
    import torch.distributed as dist

    if dist.get_rank() == 1:
        raise ValueError("boom from the second rank")
    dist.barrier()
    return "unreachable"


def _every_rank_raises():
    import torch.distributed as dist

    rank = dist.get_rank()
    raise _TaggedError(f"checkpoint step 7 is missing on rank {rank}", rank=rank)


def _raise_odd_exceptions():
    import torch.distributed as dist

    if dist.get_rank() == 0:
        raise _NeedsKeyword("needs a keyword", code=5)
    raise _Unpicklable("holds a lock")


def _exit_on_rank_1():
    import torch.distributed as dist

    if dist.get_rank() == 1:
        os._exit(3)
    dist.barrier()


def _segfault_here():
    os.kill(os.getpid(), signal.SIGSEGV)


def _segfault_on_rank_0():
    import torch.distributed as dist

    if dist.get_rank() == 0:
        _segfault_here()
    dist.barrier()


def _hang_in_rank_1_forever():
    while True:
        time.sleep(1)


def _hang_on_rank_1():
    import torch.distributed as dist

    if dist.get_rank() == 1:
        _hang_in_rank_1_forever()
    dist.barrier()


def _slow_sleeper_on_rank_0():
    time.sleep(120)


def _raise_while_rank_0_sleeps():
    import torch.distributed as dist

    if dist.get_rank() == 0:
        _slow_sleeper_on_rank_0()
    raise RuntimeError("rank 1 gave up")


def _exit_while_rank_0_sleeps():
    import torch.distributed as dist

    if dist.get_rank() == 0:
        _slow_sleeper_on_rank_0()
    os._exit(7)


def _return_late_on_rank_0_after_rank_1_exits():
    import torch.distributed as dist

    if dist.get_rank() == 0:
        time.sleep(3.0)  # longer than the grace below, however fast the machine
        return "late result"
    os._exit(7)


def _print_rank():
    import torch.distributed as dist

    print(f"hello from rank {dist.get_rank()}", flush=True)
    return dist.get_rank()


def _unpicklable_result():
    return threading.Lock()


def _sleep(seconds):
    time.sleep(seconds)


# --------------------------------------------------------------------------- launch: results


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_results_in_rank_order(world_size):
    results = launch(world_size, _allreduce_rank)
    assert [r["rank"] for r in results] == list(range(world_size))
    for rank, r in enumerate(results):
        assert r["world_size"] == world_size
        assert r["sum"] == world_size * (world_size - 1) // 2
        assert r["backend"] == "gloo"
        assert r["env"] == {
            "RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(world_size),
            "GROUP_RANK": "0",
            "MASTER_ADDR": "127.0.0.1",
        }


def test_args_and_kwargs_reach_every_rank():
    assert launch(3, _add, 2, 3, scale=10) == [50, 51, 52]
    # fn_kwargs carries names that collide with launch's own parameters
    assert launch(2, _read_env, "RANK", fn_kwargs={}) == [["0"], ["1"]]


def test_tensor_results():
    results = launch(2, _return_tensor)
    assert [t.tolist() for t in results] == [[0.0] * 3, [1.0] * 3]


def test_file_rendezvous():
    results = launch(3, _allreduce_rank, rendezvous="file")
    assert [r["sum"] for r in results] == [3, 3, 3]


def test_simulated_nodes():
    assert launch(4, _node_layout, nodes=2) == [(0, 0, 2, 0), (1, 1, 2, 0), (2, 0, 2, 1), (3, 1, 2, 1)]


def test_env_reaches_every_rank(monkeypatch):
    monkeypatch.setenv("CKPT_HARNESS_PARENT", "from-parent")  # set after the forkserver started
    monkeypatch.setenv("CKPT_HARNESS_DROPPED", "x")
    results = launch(
        3,
        _read_env,
        "CKPT_HARNESS_VAR",
        "CKPT_HARNESS_PARENT",
        "CKPT_HARNESS_DROPPED",
        env={"CKPT_HARNESS_VAR": "http://127.0.0.1:5000", "CKPT_HARNESS_DROPPED": None},
    )
    assert results == [["http://127.0.0.1:5000", "from-parent", None]] * 3


def test_rank_output_reaches_the_test(capfd):
    assert launch(2, _print_rank) == [0, 1]
    out = capfd.readouterr().out
    assert "hello from rank 0" in out and "hello from rank 1" in out


def test_unpicklable_function_fails_before_starting():
    with pytest.raises(TypeError, match="module level"):
        launch(2, lambda: 1)


def test_unpicklable_result_is_a_rank_error():
    with pytest.raises(RankError, match="rank 0") as info:
        launch(1, _unpicklable_result)
    assert "pickling the result" in str(info.value)


@pytest.mark.parametrize("bad", [0, -1, 2.0])
def test_bad_world_size(bad):
    with pytest.raises(ValueError):
        launch(bad, _allreduce_rank)


# --------------------------------------------------------------------------- launch: failures


def test_exception_on_rank_1():
    with pytest.raises(RankError) as info:
        launch(3, _raise_on_rank_1)
    err = info.value
    assert not isinstance(err, RankTimeout)
    message = str(err)
    assert "rank 1" in message
    assert "ValueError: boom from the second rank" in message
    assert "first failure: rank 1" in message
    assert "_raise_on_rank_1" in message  # the rank's traceback
    failure = err.failures[1]
    assert failure.kind == "error" and failure.first
    assert isinstance(failure.exception, ValueError)
    assert str(failure.exception) == "boom from the second rank"
    assert "raise ValueError" in failure.traceback


def test_return_exceptions_gives_every_ranks_exception():
    results = launch(3, _every_rank_raises, return_exceptions=True)
    assert [type(e) for e in results] == [_TaggedError] * 3
    assert [e.rank for e in results] == [0, 1, 2]
    assert [str(e) for e in results] == [f"checkpoint step 7 is missing on rank {r}" for r in range(3)]


def test_exceptions_that_do_not_round_trip_become_remote_errors():
    results = launch(2, _raise_odd_exceptions, return_exceptions=True)
    for rank, exc in enumerate(results):
        assert isinstance(exc, RemoteError)
        assert exc.rank == rank
    assert "_NeedsKeyword" in results[0].type_name and results[0].message == "needs a keyword"
    assert "_Unpicklable" in results[1].type_name and "holds a lock" in results[1].traceback_text
    pickle.loads(pickle.dumps(results[0]))


def test_rank_exit_code():
    with pytest.raises(RankError) as info:
        launch(3, _exit_on_rank_1, timeout=60)
    err = info.value
    assert not isinstance(err, RankTimeout)
    assert "rank 1" in str(err) and "exit code 3" in str(err)
    assert err.failures[1].kind == "exited" and err.failures[1].exitcode == 3
    assert err.failures[1].first
    assert isinstance(err.failures[1].exception, RankExited)
    # the others noticed on their own (gloo) or were killed after the grace period
    assert set(err.failures) == {0, 1, 2}


def test_return_exceptions_with_a_dead_rank():
    results = launch(2, _exit_on_rank_1, timeout=60, return_exceptions=True)
    assert isinstance(results[1], RankExited) and results[1].exitcode == 3


def test_fatal_signal_shows_the_faulthandler_traceback():
    with pytest.raises(RankError) as info:
        launch(2, _segfault_on_rank_0, timeout=60)
    message = str(info.value)
    assert "rank 0" in message and "SIGSEGV" in message
    assert "_segfault_here" in info.value.failures[0].stack_dump


def test_hang_times_out_with_stack_dumps():
    with pytest.raises(RankTimeout) as info:
        launch(3, _hang_on_rank_1, timeout=5)
    err = info.value
    message = str(err)
    assert "timed out" in message
    assert "_hang_in_rank_1_forever" in message  # where rank 1 hangs
    assert "barrier" in message  # where the others wait
    assert set(err.failures) == {0, 1, 2}
    assert "_hang_in_rank_1_forever" in err.failures[1].stack_dump
    assert all(f.kind == "timeout" for f in err.failures.values())


def test_grace_period_then_kill():
    with pytest.raises(RankError) as info:
        launch(2, _raise_while_rank_0_sleeps, grace=1.0, timeout=60)
    err = info.value
    assert not isinstance(err, RankTimeout)
    assert err.failures[1].kind == "error" and err.failures[1].first
    assert err.failures[0].kind == "killed"
    assert "_slow_sleeper_on_rank_0" in err.failures[0].stack_dump


def test_dead_rank_reports_the_stacks_of_the_others():
    with pytest.raises(RankError) as info:
        launch(2, _exit_while_rank_0_sleeps, grace=1.0, timeout=60)
    err = info.value
    assert "rank 1" in str(err) and "exit code 7" in str(err)
    assert err.failures[1].first and err.failures[0].kind == "killed"
    assert "_slow_sleeper_on_rank_0" in err.failures[0].stack_dump
    assert "_slow_sleeper_on_rank_0" in str(err)


def test_with_return_exceptions_a_survivor_is_waited_for_past_the_grace():
    """A survivor's result is what the caller asked for: collected when it returns, not cut
    at `grace` after a peer died (a loaded machine takes longer)."""
    results = launch(2, _return_late_on_rank_0_after_rank_1_exits, grace=0.5, timeout=120, return_exceptions=True)
    assert results[0] == "late result"
    assert isinstance(results[1], RankExited) and results[1].exitcode == 7


def test_with_return_exceptions_a_hung_survivor_runs_to_the_timeout_and_says_where_it_was():
    with pytest.raises(RankTimeout) as info:  # a timeout raises, return_exceptions or not
        launch(2, _exit_while_rank_0_sleeps, grace=0.5, timeout=8, return_exceptions=True)
    hung = info.value.results[0]
    assert isinstance(hung, RankExited) and hung.reason == "was still running at the 8.0 s timeout; killed"
    text = str(hung)
    assert text.startswith("rank 0 was still running at the 8.0 s timeout; killed; where it was (last ")
    assert "_slow_sleeper_on_rank_0" in text
    assert pickle.loads(pickle.dumps(hung)).stack_dump == hung.stack_dump


def test_rank_error_pickles():
    with pytest.raises(RankError) as info:
        launch(2, _raise_on_rank_1)
    copy = pickle.loads(pickle.dumps(info.value))
    assert str(copy) == str(info.value)
    assert isinstance(copy.failures[1].exception, ValueError)


def test_a_failed_launch_does_not_poison_the_next():
    with pytest.raises(RankError):
        launch(2, _exit_on_rank_1, timeout=60)
    assert [r["sum"] for r in launch(2, _allreduce_rank)] == [1, 1]


def test_keyboard_interrupt_kills_the_ranks():
    if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        pytest.skip("SIGINT is not delivered as KeyboardInterrupt in this process")
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("not on the main thread")
    timer = threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGINT))
    timer.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            launch(2, _sleep, 60, timeout=120)
    finally:
        timer.cancel()
    # no_leftover_ranks checks the ranks are gone


def test_ranks_die_with_the_launching_process(tmp_path):
    script = tmp_path / "launcher_script.py"
    script.write_text(
        textwrap.dedent(f"""
        import os, sys, time
        sys.path.insert(0, {REPO!r})
        from ckptlib.testing import launch
        from ckptlib.testing.harness import launcher
        launcher._preload[:] = ["torch", "torch.distributed"]  # a lighter forkserver

        def body(out):
            with open(os.path.join(out, f"rank{{os.environ['RANK']}}"), "w") as f:
                f.write(f"{{os.getpid()}} {{os.getppid()}}")
            time.sleep(120)

        if __name__ == "__main__":
            launch(2, body, {str(tmp_path)!r}, timeout=120, rendezvous="file")
    """)
    )
    proc = subprocess.Popen([sys.executable, str(script)], cwd=str(tmp_path))
    try:
        deadline = time.monotonic() + 60
        while len(list(tmp_path.glob("rank*"))) < 2 or any(not p.read_text() for p in tmp_path.glob("rank*")):
            assert proc.poll() is None, "launcher script ended early"
            assert time.monotonic() < deadline, "ranks did not start"
            time.sleep(0.1)
        pids = set()
        for p in tmp_path.glob("rank*"):
            pids.update(int(x) for x in p.read_text().split())  # rank and its forkserver
    finally:
        proc.kill()
        proc.wait()
    deadline = time.monotonic() + 30
    while not all(_pid_gone(pid) for pid in pids):
        assert time.monotonic() < deadline, f"orphans left: {[p for p in pids if not _pid_gone(p)]}"
        time.sleep(0.1)


# --------------------------------------------------------------------------- nccl


def test_nccl_without_enough_gpus_skips():
    reason = gpu_skip_reason(2, "nccl")
    if reason is None:
        pytest.skip("this machine has 2 GPUs with NCCL: nothing to check")
    with pytest.raises(SkipLaunch, match="nccl"):
        launch(2, _allreduce_rank, backend="nccl")
    assert multiprocessing.active_children() == []


# --------------------------------------------------------------------------- plugin


def test_dist_run_fixture(dist_run):
    results = dist_run(2, _allreduce_rank)
    assert [r["sum"] for r in results] == [1, 1]
    assert results[0]["backend"] == "gloo"


def test_dist_run_passes_launch_options(dist_run):
    assert dist_run(2, _read_env, "CKPT_X", env={"CKPT_X": "1"}) == [["1"], ["1"]]
    with pytest.raises(RankTimeout):
        dist_run(1, _sleep, 60, timeout=1)


@pytest.mark.world_size(3)
def test_world_size_marker(tmp_path):
    import torch
    import torch.distributed as dist

    assert dist.is_initialized()
    assert dist.get_world_size() == 3
    rank = dist.get_rank()
    assert os.environ["RANK"] == str(rank)
    (tmp_path / f"rank{rank}").write_text(str(rank))
    dist.barrier()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank0", "rank1", "rank2"]
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == 3


@pytest.mark.world_size(2)
@pytest.mark.parametrize("value", [10, 20])
def test_world_size_marker_with_parameters(value):
    import torch.distributed as dist

    out = [None, None]
    dist.all_gather_object(out, value + dist.get_rank())
    assert out == [value, value + 1]


@pytest.mark.world_size(4, nodes=2)
def test_world_size_marker_nodes():
    assert int(os.environ["LOCAL_WORLD_SIZE"]) == 2
    assert int(os.environ["GROUP_RANK"]) == int(os.environ["RANK"]) // 2


class TestWorldSizeInClass:
    @pytest.mark.world_size(2)
    def test_method(self):
        import torch.distributed as dist

        assert dist.get_world_size() == 2


def test_plugin_reports_rank_failures(pytester):
    pytester.makeconftest('pytest_plugins = ["ckptlib.testing.plugin"]\n')
    pytester.makepyfile(
        test_inner_fail="""
        import pytest, torch.distributed as dist

        @pytest.mark.world_size(2)
        def test_fails_on_rank_1():
            assert dist.get_rank() == 0

        @pytest.mark.world_size(2)
        def test_unpicklable_argument(request):
            pass
    """
    )
    result = pytester.runpytest("-p", "no:cacheprovider")
    result.assert_outcomes(failed=2)
    out = result.stdout.str()
    assert "rank 1" in out
    assert "assert 1 == 0" in out  # the assert was rewritten in the rank
    assert "argument 'request'" in out


def test_plugin_nccl_backend_skips_without_gpus(pytester):
    if gpu_skip_reason(2, "nccl") is None:
        pytest.skip("this machine has GPUs: the skip path cannot be checked")
    pytester.makeconftest('pytest_plugins = ["ckptlib.testing.plugin"]\n')
    pytester.makepyfile(
        test_inner_nccl="""
        import pytest

        def _body():
            return 1

        @pytest.mark.world_size(2)
        def test_marker():
            pass

        def test_fixture(dist_run):
            dist_run(2, _body)

        @pytest.mark.gpu
        def test_gpu_marker():
            pass

        def test_plain():
            pass
    """
    )
    result = pytester.runpytest("-p", "no:cacheprovider", "--backend", "nccl", "-rs")
    result.assert_outcomes(passed=1, skipped=3)
    assert "CUDA" in result.stdout.str()


def test_plugin_registers_markers_and_timeout(pytester):
    pytester.makeconftest('pytest_plugins = ["ckptlib.testing.plugin"]\n')
    pytester.makepyfile(
        test_inner_timeout="""
        import pytest
        from ckptlib.testing.plugin import launch_timeout

        @pytest.mark.world_size(1)
        @pytest.mark.elastic
        @pytest.mark.s3
        @pytest.mark.legacy
        @pytest.mark.slow
        def test_markers_known():
            pass

        @pytest.mark.timeout(50)
        def test_timeout_leaves_margin(request):
            t = launch_timeout(request.node)
            assert 40 <= t <= 45

        def test_default_timeout(request):
            assert launch_timeout(request.node) == 120

        @pytest.mark.timeout(50)
        def test_dist_timeout_caps(request):
            request.config.option.ckptlib_dist_timeout = 7.5
            assert launch_timeout(request.node) == 7.5
    """
    )
    result = pytester.runpytest("-p", "no:cacheprovider", "--strict-markers")
    result.assert_outcomes(passed=4)


def _exit_barriers(skip_rank: int | None) -> str:
    import torch.distributed as dist

    import ckptlib

    if dist.get_rank() == skip_rank:
        return "skipped"
    try:
        ckptlib.exit_barrier(timeout_s=1.0)
        ckptlib.exit_barrier(timeout_s=1.0)  # a second one uses its own store key
        return "passed"
    except ckptlib.CheckpointError as exc:
        return str(exc)


def test_public_exit_barrier(dist_run):
    assert dist_run(3, _exit_barriers, None) == ["passed"] * 3
    assert dist_run(3, _exit_barriers, 1) == [
        "exit barrier: only 2 of 3 ranks arrived in 1s",
        "skipped",
        "exit barrier: only 2 of 3 ranks arrived in 1s",
    ]


def test_exit_barrier_without_a_group_is_a_no_op():
    import ckptlib

    ckptlib.exit_barrier(timeout_s=0.1)
