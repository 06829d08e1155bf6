"""The fakes as plugin fixtures (ckptlib.testing.fakes.fixtures, registered by
ckptlib.testing.plugin), used the way a user's own storage code would use them: plain SDK
clients built from the environment the fixtures set, in this process and in ranks."""

from __future__ import annotations

import os
import re
import socket
import textwrap
import uuid

import pytest

from ckptlib.testing.fakes import emulators as em

pytest_plugins = ["pytester"]

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FIXTURES = (
    "s3_server",
    "moto_server",
    "s3_root",
    "gcs_server",
    "gcs_root",
    "azure_server",
    "azurite_server",
    "azure_root",
    "fault_proxy",
    "dist_run",
)


def _bucket(root: str) -> str:
    return root.split("://", 1)[1].split("/", 1)[0]


def test_the_plugin_alone_offers_every_fixture(pytester):
    pytester.makeconftest('pytest_plugins = ["ckptlib.testing.plugin"]\n')
    listed = pytester.runpytest("--fixtures").stdout.str()
    missing = [name for name in FIXTURES if f"\n{name} " not in listed and f"\n{name}\n" not in listed]
    assert not missing, listed


@pytest.mark.s3
def test_s3_fixtures_serve_a_plain_boto3_client(s3_server, moto_server, s3_root):
    import boto3

    assert s3_server == moto_server and s3_server.startswith("http://127.0.0.1:")
    bucket = _bucket(s3_root)
    assert s3_root == f"s3://{bucket}/run"
    client = boto3.client("s3")  # nothing passed: the fixture pointed the environment at the server
    client.put_object(Bucket=bucket, Key="run/a", Body=b"bytes of a")
    assert client.get_object(Bucket=bucket, Key="run/a")["Body"].read() == b"bytes of a"


def _rank_reads(bucket: str) -> bytes:
    import boto3

    return boto3.client("s3").get_object(Bucket=bucket, Key="run/shared")["Body"].read()


@pytest.mark.s3
def test_ranks_inherit_the_s3_environment(s3_root, dist_run):
    import boto3

    bucket = _bucket(s3_root)
    boto3.client("s3").put_object(Bucket=bucket, Key="run/shared", Body=b"for every rank")
    assert dist_run(2, _rank_reads, bucket) == [b"for every rank"] * 2


@pytest.mark.gcs
def test_gcs_fixtures_serve_a_plain_storage_client(gcs_server, gcs_root):
    from google.cloud import storage

    assert gcs_server.startswith("http://127.0.0.1:") and os.environ["STORAGE_EMULATOR_HOST"] == gcs_server
    bucket = storage.Client().bucket(_bucket(gcs_root))
    bucket.blob("run/a").upload_from_string(b"bytes of a")
    assert bucket.blob("run/a").download_as_bytes() == b"bytes of a"


@pytest.mark.azure
def test_azure_fixtures_serve_a_plain_blob_client(azure_server, azurite_server, azure_root):
    from azure.storage.blob import BlobServiceClient

    assert azure_server == azurite_server and azure_server.startswith("http://127.0.0.1:")
    service = BlobServiceClient.from_connection_string(os.environ["AZURE_STORAGE_CONNECTION_STRING"])
    container = service.get_container_client(_bucket(azure_root))
    container.upload_blob("run/a", b"bytes of a")
    assert container.download_blob("run/a").readall() == b"bytes of a"


@pytest.mark.s3
def test_fault_proxy_in_front_of_s3(s3_server, s3_root, fault_proxy):
    import boto3
    from botocore.config import Config

    proxy = fault_proxy(s3_server)
    assert proxy.endpoint.startswith("http://127.0.0.1:") and proxy.endpoint != s3_server
    client = boto3.client("s3", endpoint_url=proxy.endpoint, config=Config(retries={"max_attempts": 4}))
    bucket = _bucket(s3_root)
    proxy.fail_next(2)
    client.put_object(Bucket=bucket, Key="run/a", Body=b"through the proxy")  # the SDK retries the 503s
    assert proxy.injected == 2
    proxy.fail_next(10)
    with pytest.raises(Exception, match="503"):
        client.get_object(Bucket=bucket, Key="run/a")
    proxy.fail_next(0)
    assert client.get_object(Bucket=bucket, Key="run/a")["Body"].read() == b"through the proxy"


def test_fault_proxy_takes_a_port_and_closes_its_proxies(pytester):
    pytester.makeconftest('pytest_plugins = ["ckptlib.testing.plugin"]\n')
    pytester.makepyfile(
        """
        import socket

        import pytest

        started = []


        def test_start(fault_proxy):
            with socket.socket() as upstream:
                upstream.bind(("127.0.0.1", 0))
                port = upstream.getsockname()[1]
            for endpoint in (port, f"http://127.0.0.1:{port}"):
                proxy = fault_proxy(endpoint)
                assert proxy.upstream == ("127.0.0.1", port)
                started.append(proxy.port)
            for bad in ("https://127.0.0.1:9", "http://127.0.0.1", "127.0.0.1:9"):
                with pytest.raises(ValueError, match="fault_proxy needs http://host:port"):
                    fault_proxy(bad)


        def test_closed_after_the_test():
            assert len(started) == 2
            for port in started:
                with pytest.raises(ConnectionRefusedError):
                    socket.create_connection(("127.0.0.1", port), timeout=5).close()
        """
    )
    pytester.runpytest().assert_outcomes(passed=2)


def test_a_missing_server_skips_with_its_install_command(monkeypatch):
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception, match=r"^Azurite is not available; install it with: npm install "):
        next(em.serve(None, "Azurite", em.AZURITE_INSTALL, em.start_azurite))
    module = f"no_such_sdk_{uuid.uuid4().hex}"
    with pytest.raises(pytest.skip.Exception, match=rf"^the SDK is not available: No module named '{module}'"):
        em.require((module,), "the SDK", "pip install the-sdk")


@pytest.mark.parametrize("ci", ["true", "1", "yes", "TRUE"])
def test_under_ci_a_missing_server_fails(monkeypatch, ci):
    monkeypatch.setenv("CI", ci)
    with pytest.raises(pytest.fail.Exception, match=r"^CI=true: fake-gcs-server is not available; install it with"):
        next(em.serve(None, "fake-gcs-server", em.GCS_INSTALL, em.start_gcs_server))


def test_azurite_installs_into_the_checkouts_ci_directory():
    assert em.AZURITE_DIR == os.path.join(REPO, ".ci", "azurite")
    assert em.AZURITE_INSTALL.endswith(f"{os.path.relpath(em.AZURITE_DIR)} azurite@{em.AZURITE_VERSION}")


def test_emulator_ports_are_free_ports_on_loopback():
    port = em.free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))  # free: nothing holds it


def _testing_page_examples() -> list[str]:
    with open(os.path.join(REPO, "docs", "testing.md"), encoding="utf-8") as f:
        text = f.read()
    start = text.index("\n## The test harness (also for your own suites)\n")
    section = text[start : text.index("\n## ", start + 1)]
    return [textwrap.dedent(block) for block in re.findall(r"```python\n(.*?)```", section, re.DOTALL)]


@pytest.mark.s3
@pytest.mark.gcs
@pytest.mark.azure
def test_the_testing_page_examples_run(pytester):
    examples = _testing_page_examples()
    assert len(examples) == 4 and all(e.startswith("def test_") for e in examples)
    pytester.makeconftest('pytest_plugins = ["ckptlib.testing.plugin"]\n')
    imports = [
        "import os",
        "import boto3",
        "from azure.storage.blob import BlobServiceClient",
        "from google.cloud import storage",
    ]
    pytester.makepyfile(test_testing_page="\n".join(imports) + "\n\n\n" + "\n\n".join(examples))
    pytester.runpytest("-p", "no:cacheprovider").assert_outcomes(passed=4)
