"""A warm pytest for mutation runs: a server imports torch and the test dependencies once, then
forks one child per request that imports ckptlib fresh from disk (so it sees the mutant
cosmic-ray just wrote) and runs pytest.main. This takes the ~5-15 s torch import out of every
mutant. The client is the test command cosmic-ray runs; it needs only the standard library.

    python ci/mutation_runner.py serve SOCKET            # the project's venv python
    python3 ci/mutation_runner.py test SOCKET TIMEOUT -- PYTEST_ARGS...
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import tempfile
import time

#: Imported once by the server; never ckptlib itself (each child imports the file on disk).
PRELOAD = [
    "numpy", "torch", "torch.distributed", "torch.distributed.checkpoint", "torch.distributed.checkpoint.state_dict",
    "torch.distributed.fsdp", "torch.distributed.tensor", "torch.distributed.tensor.parallel", "torch.nn",
    "pytest", "_pytest.assertion.rewrite", "_pytest.python", "hypothesis", "xdist", "pytest_timeout", "tqdm",
    "zlib_ng.zlib_ng", "boto3", "botocore",
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


def test(path: str, timeout: float, args: list[str]) -> int:
    client = socket.socket(socket.AF_UNIX)
    client.connect(path)
    client.sendall((json.dumps({"args": args, "timeout": timeout, "cwd": os.getcwd()}) + "\n").encode())
    reply = json.loads(client.makefile().readline())
    sys.stdout.write(reply["output"])
    return 0 if reply["code"] == 0 else 1


if __name__ == "__main__":
    if sys.argv[1] == "serve":
        serve(sys.argv[2])
    elif sys.argv[1] == "test":
        separator = sys.argv.index("--")
        sys.exit(test(sys.argv[2], float(sys.argv[3]), sys.argv[separator + 1:]))
    else:
        sys.exit(__doc__)
