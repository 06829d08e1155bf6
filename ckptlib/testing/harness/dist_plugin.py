"""pytest plugin: run tests (or parts of them) in the ranks of a fresh process group.

Enable it from a conftest with ``pytest_plugins = ["ckptlib.testing.plugin"]`` (which also
registers the fakes' fixtures, ``ckptlib.testing.fakes.fixtures``).

- ``dist_run`` fixture: ``dist_run(world_size, fn, *args, **kwargs)`` calls
  :func:`ckptlib.testing.launch` with the backend from ``--backend`` and a timeout that
  ends before pytest-timeout's (so the harness, which dumps every rank's stack, fires
  first).  Keyword arguments of ``launch`` (``timeout=``, ``env=``, ``nodes=``,
  ``return_exceptions=``, ``fn_kwargs=``...) may be passed and override those defaults.
- ``@pytest.mark.world_size(n, nodes=1)``: the test body itself runs on ``n`` ranks; its
  arguments (fixture values, parametrize values) are pickled to every rank.  A failure on
  any rank fails the test with that rank's traceback (asserts are rewritten as usual).
- ``@pytest.mark.full_matrix``: a case of a full cross product whose covering subset runs
  by default. A run without ``-m`` leaves these out; ``--full-matrix`` or any ``-m``
  expression that selects them (``pytest -m elastic``) runs them.
- ``--backend {gloo,nccl}`` (default gloo).  Tests marked ``gpu``, and distributed tests
  under ``--backend nccl``, are skipped with the reason when CUDA, NCCL or enough GPUs are
  missing.  Collection never imports torch.
- ini ``dist_preload``: extra modules for the rank forkserver to import once (for
  heavy imports of test modules: each launch otherwise imports them in every rank).
"""

from __future__ import annotations

import inspect
import os
import pickle
import time

import pytest

from ckptlib.testing.harness import launcher as _launcher
from ckptlib.testing.harness.parent_death import die_with_parent

_MARKERS = {
    "elastic": "elastic: the save-at-N / load-at-M matrix (CPU, gloo)",
    "s3": "s3: needs the moto S3 server (started by a session fixture)",
    "gcs": "gcs: needs the fake-gcs-server GCS emulator (started by a session fixture)",
    "azure": "azure: needs the Azurite Azure Blob emulator (started by a session fixture)",
    "legacy": "legacy: legacy and interchange formats, golden fixtures",
    "gpu": "gpu: needs CUDA devices and NCCL; skipped without them",
    "slow": "slow: long-running cases",
    "crash": "crash: the crash harness's full enumeration: kill and fail at every write boundary",
    "full_matrix": "full_matrix: beyond the covering subset; run with -m (e.g. -m elastic) or --full-matrix",
    "world_size": "world_size(n, nodes=1): run the test body in n ranks of a fresh process group",
}

_PROTOCOL_START = pytest.StashKey[float]()
_CALL_START = pytest.StashKey[float]()


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("ckptlib", "ckptlib distributed test harness")
    group.addoption(
        "--backend",
        action="store",
        dest="ckptlib_backend",
        default="gloo",
        choices=("gloo", "nccl"),
        help="torch.distributed backend of dist_run / world_size tests (default: gloo)",
    )
    group.addoption(
        "--dist-timeout",
        action="store",
        dest="ckptlib_dist_timeout",
        type=float,
        default=None,
        help=(
            "seconds one launch of ranks may take (default: derived from pytest-timeout "
            f"with a margin, else {_launcher.DEFAULT_TIMEOUT:g})"
        ),
    )
    group.addoption(
        "--full-matrix",
        action="store_true",
        dest="ckptlib_full_matrix",
        default=False,
        help="also run full_matrix cases without -m (pytest -m elastic runs them anyway)",
    )
    parser.addini(
        "dist_preload",
        type="linelist",
        default=[],
        help="modules the rank forkserver imports once (in addition to torch)",
    )


def _marker_name(line: str) -> str:
    return line.split(":", 1)[0].split("(", 1)[0].strip()


def pytest_configure(config: pytest.Config) -> None:
    existing = {_marker_name(line) for line in config.getini("markers")}
    for name, line in _MARKERS.items():
        if name not in existing:
            config.addinivalue_line("markers", line)
    _launcher.add_preload(["pytest", "_pytest.assertion.rewrite", *config.getini("dist_preload")])
    if os.environ.get("PYTEST_XDIST_WORKER"):  # an xdist worker ends with the pytest that started it
        die_with_parent()


def _uses_dist(item: pytest.Item) -> bool:
    return item.get_closest_marker("world_size") is not None or "dist_run" in getattr(item, "fixturenames", ())


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # Without -m, full-matrix cases stay out (their covering subset runs); with -m the
    # expression alone decides, so `pytest -m elastic` runs the whole cross product.
    if config.getoption("ckptlib_full_matrix") or config.option.markexpr:
        return
    kept = [item for item in items if item.get_closest_marker("full_matrix") is None]
    if len(kept) != len(items):
        config.hook.pytest_deselected(items=[item for item in items if item.get_closest_marker("full_matrix")])
        items[:] = kept


def pytest_collection_finish(session: pytest.Session) -> None:
    # Start the forkserver (it imports torch, a few seconds) while pytest gets going.
    config = session.config
    if config.option.collectonly or config.getoption("ckptlib_backend") != "gloo":
        return
    if any(_uses_dist(item) for item in session.items):
        try:
            _launcher.start_forkserver()
        except Exception:  # pragma: no cover - the first launch reports the problem
            pass


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem):
    item.stash[_PROTOCOL_START] = time.monotonic()
    yield


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_call(item: pytest.Item):
    item.stash[_CALL_START] = time.monotonic()
    yield


def _world_size_args(marker) -> tuple[int, int]:
    if marker.args:
        n = marker.args[0]
    else:
        n = marker.kwargs.get("n", marker.kwargs.get("world_size"))
    nodes = marker.kwargs.get("nodes", 1)
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise pytest.UsageError(f"@pytest.mark.world_size needs a positive int, got {n!r}")
    if not isinstance(nodes, int) or nodes < 1 or n % nodes:
        raise pytest.UsageError(f"@pytest.mark.world_size({n}, nodes={nodes!r}): nodes must divide n")
    return n, nodes


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    marker = item.get_closest_marker("world_size")
    n = _world_size_args(marker)[0] if marker is not None else 1
    backend = item.config.getoption("ckptlib_backend")
    if item.get_closest_marker("gpu") is not None:
        reason = _launcher.gpu_skip_reason(n, "nccl")
        if reason:
            pytest.skip(f"gpu test: {reason}")
    if backend == "nccl" and _uses_dist(item):
        reason = _launcher.gpu_skip_reason(n, "nccl")
        if reason:
            pytest.skip(f"--backend nccl: {reason}")


def _pytest_timeout(item: pytest.Item) -> tuple[float | None, bool]:
    """(seconds, func_only) of pytest-timeout for this item; (None, False) when unset."""
    if not item.config.pluginmanager.hasplugin("timeout"):
        return None, False
    timeout, func_only = None, False
    try:
        import pytest_timeout

        settings = pytest_timeout._get_item_settings(item)
        timeout, func_only = settings.timeout, bool(settings.func_only)
    except Exception:
        marker = item.get_closest_marker("timeout")
        if marker is not None:
            timeout = marker.args[0] if marker.args else marker.kwargs.get("timeout")
        else:
            timeout = getattr(item.config, "_env_timeout", None)
    try:
        timeout = float(timeout) if timeout is not None else None
    except (TypeError, ValueError):
        timeout = None
    if not timeout or timeout <= 0:
        return None, False
    return timeout, func_only


def launch_timeout(item: pytest.Item) -> float:
    """Seconds the next launch in ``item`` may take.

    With pytest-timeout active this is what is left of the test's budget minus a margin
    (10%, between 3 and 30 s), so the harness's own watchdog - which collects every
    rank's stack - fires before pytest-timeout does.  ``--dist-timeout`` caps it.
    """
    explicit = item.config.getoption("ckptlib_dist_timeout")
    limit, func_only = _pytest_timeout(item)
    if limit is None:
        return float(explicit) if explicit else _launcher.DEFAULT_TIMEOUT
    key = _CALL_START if func_only else _PROTOCOL_START
    start = item.stash.get(key, None)
    now = time.monotonic()
    if start is None:
        start = now
    margin = min(30.0, max(3.0, 0.1 * limit))
    remaining = max(1.0, start + limit - margin - now)
    if explicit:
        remaining = min(remaining, float(explicit))
    return remaining


def _launch_for(item: pytest.Item, world_size: int, fn, args, kwargs) -> list:
    __tracebackhide__ = True
    kwargs.setdefault("backend", item.config.getoption("ckptlib_backend"))
    if "timeout" not in kwargs:
        kwargs["timeout"] = launch_timeout(item)
    try:
        return _launcher.launch(world_size, fn, *args, **kwargs)
    except _launcher.SkipLaunch as exc:
        pytest.skip(str(exc))


@pytest.fixture
def dist_run(request: pytest.FixtureRequest):
    """``dist_run(world_size, fn, *args, **kwargs) -> list`` of per-rank results.

    Runs :func:`ckptlib.testing.launch` with ``--backend`` and a timeout that fits in the
    test's pytest-timeout budget; ``launch``'s own keyword arguments are accepted.
    """
    item = request.node

    def run(world_size: int, fn, *args, **kwargs) -> list:
        __tracebackhide__ = True
        return _launch_for(item, world_size, fn, args, kwargs)

    return run


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function):
    marker = pyfuncitem.get_closest_marker("world_size")
    if marker is None:
        return None
    __tracebackhide__ = True
    world_size, nodes = _world_size_args(marker)
    fn = pyfuncitem.obj
    if inspect.iscoroutinefunction(fn) or inspect.isasyncgenfunction(fn):
        pytest.fail("@pytest.mark.world_size does not support async tests", pytrace=False)
    testargs = {name: pyfuncitem.funcargs[name] for name in pyfuncitem._fixtureinfo.argnames}
    for name, value in testargs.items():
        try:
            pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as exc:
            pytest.fail(
                f"@pytest.mark.world_size({world_size}): argument {name!r} ({type(value).__name__}) "
                f"cannot be sent to the ranks: {exc}",
                pytrace=False,
            )
    _launch_for(pyfuncitem, world_size, fn, (), {"fn_kwargs": testargs, "nodes": nodes})
    return True
