"""A warm pytest for mutation runs: a server imports torch and the test dependencies once, then
forks one child per request that imports ckptlib fresh from disk (so it sees the mutant
cosmic-ray just wrote) and runs pytest.main. This takes the ~5-15 s torch import out of every
mutant. The client is the test command cosmic-ray runs; it needs only the standard library.

    python ci/mutation_runner.py serve SOCKET            # the project's venv python
    python3 ci/mutation_runner.py test SOCKET TIMEOUT [--map MAP --pristine DIR --spawning add|none] -- PYTEST_ARGS...
    python ci/mutation_runner.py coverage MAP FILE... -- PYTEST_ARGS...   # the project's venv python

With --map (a coverage map written by `coverage`) the client runs only the tests that cover the
mutated lines (found by comparing the module's files with their pristine copies under DIR);
ci/mutation_select.py says when it falls back to the whole selection.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import socket
import sys
import tempfile
import time

#: Imported once by the server; never ckptlib itself (each child imports the file on disk).
PRELOAD = [
    "numpy",
    "torch",
    "torch.distributed",
    "torch.distributed.checkpoint",
    "torch.distributed.checkpoint.state_dict",
    "torch.distributed.fsdp",
    "torch.distributed.tensor",
    "torch.distributed.tensor.parallel",
    "torch.nn",
    "pytest",
    "_pytest.assertion.rewrite",
    "_pytest.python",
    "hypothesis",
    "xdist",
    "pytest_timeout",
    "tqdm",
    "zlib_ng.zlib_ng",
    "boto3",
    "botocore",
]


def serve(path: str) -> None:
    for name in PRELOAD:
        try:
            __import__(name)
        except ImportError:
            pass
    assert not any(name == "ckptlib" or name.startswith("ckptlib.") for name in sys.modules)
    if os.path.exists(path):
        os.unlink(path)
    server = socket.socket(socket.AF_UNIX)
    server.bind(path)
    server.listen(1)
    print(f"ready: {path}", flush=True)
    while True:
        conn, _ = server.accept()
        with conn:
            request = json.loads(conn.makefile().readline())
            code, output = _run_child(request["args"], request["timeout"], request["cwd"])
            conn.sendall((json.dumps({"code": code, "output": output}) + "\n").encode())


def _run_child(args: list[str], timeout: float, cwd: str) -> tuple[int, str]:
    """pytest.main(args) in a forked child (own session, so a timeout kills what it spawned)."""
    with tempfile.TemporaryFile("w+") as log:
        pid = os.fork()
        if pid == 0:
            try:
                os.setsid()
                os.chdir(cwd)
                sys.dont_write_bytecode = True
                os.dup2(log.fileno(), 1)
                os.dup2(log.fileno(), 2)
                import pytest

                code = int(pytest.main(args))
            except BaseException:  # the child must never return into the server loop
                code = 99
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
            os._exit(code)
        deadline = time.monotonic() + timeout
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                code = os.waitstatus_to_exitcode(status)
                break
            if time.monotonic() > deadline:
                try:
                    os.killpg(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                os.waitpid(pid, 0)
                code = -9
                break
            time.sleep(0.05)
        log.seek(0)
        return code, log.read()[-20000:]


def test(
    path: str,
    timeout: float,
    args: list[str],
    map_path: str | None = None,
    pristine: str | None = None,
    spawning: str = "none",
) -> int:
    if map_path:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from mutation_select import select

        args, why = select(args, map_path, pristine, spawning)
        print(f"[mutation selection] {why}", flush=True)
    started = time.monotonic()
    client = socket.socket(socket.AF_UNIX)
    client.connect(path)
    client.sendall((json.dumps({"args": args, "timeout": timeout, "cwd": os.getcwd()}) + "\n").encode())
    reply = json.loads(client.makefile().readline())
    sys.stdout.write(reply["output"])
    print(f"\n[mutation runner] {time.monotonic() - started:.1f} s", flush=True)
    return 0 if reply["code"] == 0 else 1


OUTSIDE_TESTS = "<between tests>"  # coverage context after the first test began, outside any test
IMPORT_TIME = "<import>"  # lines run before the first test: collection, conftest, imports


def coverage(map_path: str, files: list[str], args: list[str]) -> int:
    """Run pytest in this process under coverage.py with one dynamic context per test (its node
    id) and write {"lines": {file: {line: [node ids or "<import>"]}}, "durations": {node id: s},
    "spawning": [node ids that started a process: ranks, CLI runs, os.fork], "sha256": {file: digest}}."""
    import multiprocessing.process
    import subprocess

    import coverage as coverage_py
    import pytest

    paths = {os.path.abspath(f): f for f in files}
    cov = coverage_py.Coverage(data_file=None, include=list(paths), branch=False, config_file=False)
    durations: dict[str, float] = {}
    spawning: set[str] = set()
    current: list[str] = []

    real_start, real_popen, real_fork = multiprocessing.process.BaseProcess.start, subprocess.Popen.__init__, os.fork

    def start(self, *a, **k):
        spawning.update(current)
        return real_start(self, *a, **k)

    def popen(self, *a, **k):
        spawning.update(current)
        return real_popen(self, *a, **k)

    def fork():  # a child forked by the test itself: its coverage is lost at os._exit
        spawning.update(current)
        return real_fork()

    multiprocessing.process.BaseProcess.start, subprocess.Popen.__init__, os.fork = start, popen, fork

    class Contexts:
        @pytest.hookimpl(hookwrapper=True)
        def pytest_runtest_protocol(self, item, nextitem):
            current[:] = [item.nodeid]
            cov.switch_context(item.nodeid)
            yield
            cov.switch_context(OUTSIDE_TESTS)
            current.clear()

        def pytest_runtest_logreport(self, report):
            durations[report.nodeid] = durations.get(report.nodeid, 0.0) + report.duration

    cov.start()  # before ckptlib is imported: its import-time lines get the empty context
    try:
        code = int(pytest.main(args, plugins=[Contexts()]))
    finally:
        cov.stop()
        multiprocessing.process.BaseProcess.start, subprocess.Popen.__init__, os.fork = (
            real_start,
            real_popen,
            real_fork,
        )
    data = cov.get_data()
    lines: dict[str, dict[str, list[str]]] = {}
    for measured in data.measured_files():
        name = paths.get(os.path.abspath(measured))
        if name is None:
            continue
        by_line = data.contexts_by_lineno(measured)
        lines[name] = {str(n): sorted(IMPORT_TIME if c == "" else c for c in by_line[n]) for n in sorted(by_line)}
    digests = {name: hashlib.sha256(open(abs_path, "rb").read()).hexdigest() for abs_path, name in paths.items()}
    with open(map_path, "w") as f:
        json.dump(
            {
                "lines": lines,
                "durations": durations,
                "spawning": sorted(spawning),
                "sha256": digests,
                "pytest_args": args,
                "exit_code": code,
            },
            f,
            indent=0,
        )
    return code


if __name__ == "__main__":
    if sys.argv[1] == "serve":
        serve(sys.argv[2])
    elif sys.argv[1] == "test":
        separator = sys.argv.index("--")
        options = dict(zip(sys.argv[4:separator:2], sys.argv[5:separator:2]))
        sys.exit(
            test(
                sys.argv[2],
                float(sys.argv[3]),
                sys.argv[separator + 1 :],
                options.get("--map"),
                options.get("--pristine"),
                options.get("--spawning", "none"),
            )
        )
    elif sys.argv[1] == "coverage":
        separator = sys.argv.index("--")
        sys.exit(coverage(sys.argv[2], sys.argv[3:separator], sys.argv[separator + 1 :]))
    else:
        sys.exit(__doc__)
