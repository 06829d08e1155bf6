"""The fakes as pytest fixtures (registered by ``ckptlib.testing.plugin``), to test ckptlib or your
own S3, GCS and Azure code against servers on 127.0.0.1, without an account or a network:

- ``s3_server`` (session; ``moto_server`` is its older name): the endpoint URL of a moto S3
  server. While it is up, this process's AWS environment points at it (``AWS_ENDPOINT_URL``,
  fake credentials, no profiles), so a plain ``boto3.client("s3")`` talks to it, here and in
  ranks started by ``dist_run``. ``s3_root``: ``s3://<fresh bucket>/run`` per test.
- ``gcs_server`` (session): fake-gcs-server (``STORAGE_EMULATOR_HOST`` is set); ``gcs_root``:
  ``gs://<fresh bucket>/run``.
- ``azure_server`` (session; ``azurite_server`` is its older name): Azurite's blob endpoint
  (``AZURE_STORAGE_CONNECTION_STRING`` is set, Azurite's published development account);
  ``azure_root``: ``az://<fresh container>/run``.
- ``fault_proxy``: ``fault_proxy(endpoint) -> FaultProxy`` between your client and a server:
  point the client at ``proxy.endpoint``, then ``proxy.fail_next(n)`` (503s),
  ``proxy.cut_after(nbytes)`` (an outage mid-upload), ``proxy.restore()``.

Buckets and containers are removed after each test; servers stop at the end of the session
(one per pytest-xdist worker), on free ports. A server that cannot be had skips its tests with
the command that installs it (``pip install -e '.[test]'``; Azurite installs itself with npm on
first use), or fails them under CI=true.
"""

from __future__ import annotations

import urllib.parse
from typing import Callable, Iterator

import pytest

from ckptlib.testing.fakes.emulators import azure_root, azurite_server, gcs_root, gcs_server
from ckptlib.testing.fakes.faultproxy import FaultProxy
from ckptlib.testing.fakes.s3_server import moto_server, s3_root

__all__ = [
    "s3_server",
    "moto_server",
    "s3_root",
    "gcs_server",
    "gcs_root",
    "azure_server",
    "azurite_server",
    "azure_root",
    "fault_proxy",
]


@pytest.fixture(scope="session")
def s3_server(moto_server: str) -> str:
    """The endpoint URL of a moto S3 server on 127.0.0.1, up for the whole session."""
    return moto_server


@pytest.fixture(scope="session")
def azure_server(azurite_server: str) -> str:
    """The blob endpoint of an Azurite server on 127.0.0.1, up for the whole session."""
    return azurite_server


def _host_port(endpoint: str | int) -> tuple[str, int]:
    if isinstance(endpoint, int) and not isinstance(endpoint, bool):
        return "127.0.0.1", endpoint
    parts = urllib.parse.urlsplit(str(endpoint))
    if parts.scheme != "http" or not parts.hostname or parts.port is None:
        raise ValueError(f"fault_proxy needs http://host:port (or a port on 127.0.0.1), got {endpoint!r}")
    return parts.hostname, parts.port


@pytest.fixture
def fault_proxy() -> Iterator[Callable[[str | int], FaultProxy]]:
    """``fault_proxy(endpoint)``: a fault-injecting proxy on 127.0.0.1 in front of the HTTP
    server at ``endpoint`` (``http://host:port``, or a port on 127.0.0.1); every proxy started
    in a test is closed at its end."""
    started: list[FaultProxy] = []

    def start(endpoint: str | int) -> FaultProxy:
        host, port = _host_port(endpoint)
        proxy = FaultProxy(port, host)
        started.append(proxy)
        return proxy

    yield start
    for proxy in started:
        proxy.close()
