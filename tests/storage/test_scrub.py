"""The one credential scrubber of every storage backend (ckptlib._scrub): each kind of
secret, from the patterns and from the environment, in messages, chained exceptions and log
lines; and each backend's errors and log lines with a password in its endpoint URL or a
credential in the SDK's own error text. No emulator is needed: the endpoints are closed ports
on 127.0.0.1 and injected errors are raised before a request is sent."""

from __future__ import annotations

import logging
import socket
from urllib.parse import quote

import pytest
from helpers.storage import LABELS, Faults, record_sleeps

from ckptlib._scrub import REDACTED, guard_loggers, logger, scrub, scrub_exception
from ckptlib.errors import StorageError
from ckptlib.storage import open_storage
from ckptlib.testing.fakes import emulators as em
from ckptlib.testing.fakes.emulators import environ
from ckptlib.testing.fakes.s3_server import s3_env

AZURE_KEY = "Zm9vYmFyYmF6cXV4" * 5 + "YWJjZG=="  # 88 characters of base64: the shape of an account key
PRIVATE_KEY = "-----BEGIN PRIVATE KEY-----\\nMIIEvQIBADANBgkqhkiG9w0BAQEFAASC\\n-----END PRIVATE KEY-----\\n"

# (kind, text, the secret in it): each kind of credential a message may carry.
SECRETS = [
    (
        "url-password",
        'Could not connect to the endpoint URL: "http://user:p4ss-w0rd!x@127.0.0.1:9000/b/k"',
        "p4ss-w0rd!x",
    ),
    ("url-password-quoted", "GET https://admin:s%40cret%2Fpass@minio.local/bucket failed", "s%40cret%2Fpass"),
    ("aws-access-key-id", "InvalidAccessKeyId: AKIAIOSFODNN7EXAMPLE is not valid", "AKIAIOSFODNN7EXAMPLE"),
    ("aws-temporary-key-id", "key ASIAY34FZKBOKMUTVV7A expired", "ASIAY34FZKBOKMUTVV7A"),
    ("aws-secret-key", "aws_secret_access_key = wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY", "wJalrXUtnFEMI/K7MDENG"),
    ("aws-session-token-header", "x-amz-security-token: FwoGZXIvYXdzEBYaDHqa0AP1k", "FwoGZXIvYXdzEBYaDHqa0AP1k"),
    (
        "aws-presigned-url",
        "https://b.s3.amazonaws.com/k?X-Amz-Credential=AKID%2F20260101&X-Amz-Security-Token=IQoJb3JpZ2lu"
        "&X-Amz-Signature=0f1e2d3c4b5a69788796a5b4c3d2e1f0",
        "IQoJb3JpZ2lu",
    ),
    (
        "aws-signature",
        "https://b.s3.amazonaws.com/k?X-Amz-Signature=0f1e2d3c4b5a69788796a5b4c3d2e1f0",
        "0f1e2d3c4b5a69788796a5b4c3d2e1f0",
    ),
    (
        "sas-signature",
        "https://acct.blob.core.windows.net/c/b?sv=2021-08-06&se=2026-01-01&sp=r&sig=AbC%2Bdef%3Dxyz",
        "AbC%2Bdef%3Dxyz",
    ),
    (
        "azure-connection-string",
        f"DefaultEndpointsProtocol=https;AccountName=acct;AccountKey={AZURE_KEY};EndpointSuffix=core.windows.net",
        AZURE_KEY,
    ),
    (
        "azure-sas-connection-string",
        "BlobEndpoint=https://acct.blob.core.windows.net;SharedAccessSignature=sv=2021&sig=Zm9vYmFyc2ln",
        "Zm9vYmFyc2ln",
    ),
    ("azure-account-key", f"credential rejected: {AZURE_KEY}", AZURE_KEY),
    ("bearer-token", "Authorization: Bearer eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxIn0.c2lnbmF0dXJl", "eyJhbGciOiJIUzI1NiJ9"),
    ("bearer-in-text", "401 for request with bearer abcDEF123456ghiJKL", "abcDEF123456ghiJKL"),
    ("authorization-header", "'Authorization': 'SharedKey devstoreaccount1:c2VjcmV0c2lnbmF0dXJl'", "c2VjcmV0c2lnbmF0"),
    ("gcs-access-token", "token ya29.a0AfH6SMBxQ7kWgYz-abc_def expired", "ya29.a0AfH6SMBxQ7kWgYz-abc_def"),
    ("gcs-refresh-token", '{"refresh_token": "1//0gAbCdEfGhIjKlMnOpQrStUvWxYz"}', "1//0gAbCdEfGhIjKlMnOpQrStUvWxYz"),
    (
        "gcs-private-key",
        f'{{"type": "service_account", "private_key": "{PRIVATE_KEY}"}}',
        "MIIEvQIBADANBgkqhkiG9w0BAQEFAASC",
    ),
    (
        "gcs-private-key-id",
        '{"private_key_id": "3f2a1b0c9d8e7f6a5b4c", "client_email": "x@p.iam"}',
        "3f2a1b0c9d8e7f6a5b4c",
    ),
    ("gcs-client-secret", "client_secret=GOCSPX-abcdefghijkl", "GOCSPX-abcdefghijkl"),
    (
        "google-api-key",
        "x-goog-api-key: AIzaSyA-1234567890abcdefghijklmnopqrstu",
        "AIzaSyA-1234567890abcdefghijklmnopqrstu",
    ),
    ("password-field", "login failed: password=hunter2-hunter2", "hunter2-hunter2"),
]

# Messages that hold no credential and must come out as they went in.
CLEAN = [
    "S3 put failed for s3://bucket-name/run/x: SignatureDoesNotMatch (HTTP 403): The request signature we "
    "calculated does not match the signature you provided. - the secret key does not match the access key id",
    "Azure Blob put failed for az://container@account/run/x: AuthenticationFailed (HTTP 403) - the account key, "
    "SAS token or credential was rejected",
    "gs://bucket/run/step_0000000001/__0_0.distcp: wanted 10 bytes at offset 5, object holds 7",
    'Could not connect to the endpoint URL: "http://127.0.0.1:9000/bucket/key"',
    'sha1 da39a3ee5e6b4b0d3255bfef95601890afd80709, etag "9b2cf535f27731c974343645a3985328-3"',
    "lock token-1 is held by pid 12 on host vm; ContinuationToken: abc",
]


@pytest.mark.parametrize("kind,text,secret", SECRETS, ids=[s[0] for s in SECRETS])
def test_each_kind_of_secret_is_redacted(kind, text, secret):
    clean = scrub(text)
    assert secret not in clean and REDACTED in clean


def test_what_surrounds_a_secret_stays():
    assert scrub('to "http://user:pw-12345@127.0.0.1:9000/b/k"') == 'to "http://user:<redacted>@127.0.0.1:9000/b/k"'
    assert scrub("a?sv=2021&sig=AbC%2B&se=1") == "a?sv=2021&sig=<redacted>&se=1"
    assert (
        scrub("AccountName=a;AccountKey=xyz123;EndpointSuffix=e")
        == "AccountName=a;AccountKey=<redacted>;EndpointSuffix=e"
    )
    assert scrub("Authorization: Bearer abc.def") == "Authorization: Bearer <redacted>"


@pytest.mark.parametrize("text", CLEAN)
def test_messages_without_secrets_are_unchanged(text):
    assert scrub(text) == text


def test_credentials_in_the_environment_are_redacted_wherever_they_appear(monkeypatch):
    secret = "a-secret-with/slash+plus="
    password = "endpoint-pw-123"
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://me:{password}@127.0.0.1:1")
    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", f"AccountName=a;AccountKey={AZURE_KEY[:40]};")
    monkeypatch.setenv("AZURE_STORAGE_SAS_TOKEN", "sv=2021&sig=sas-token-value")
    text = f"{secret} {quote(secret, safe='')} {password} {AZURE_KEY[:40]} sv=2021&sig=sas-token-value"
    clean = scrub(text, secrets=["client-only-secret"])
    for value in (secret, quote(secret, safe=""), password, AZURE_KEY[:40], "sas-token-value"):
        assert value not in clean
    assert scrub("the client-only-secret leaked", ["client-only-secret"]) == "the <redacted> leaked"
    assert scrub("short pw12 stays", ["pw12"]) == "short pw12 stays"  # too short to replace by value


def test_a_chain_of_exceptions_is_scrubbed_in_place():
    from botocore.exceptions import EndpointConnectionError

    url = "http://user:chained-pw-1@127.0.0.1:1/b/k"
    try:
        try:
            raise EndpointConnectionError(endpoint_url=url)
        except EndpointConnectionError as inner:
            raise RuntimeError(f"outer with sig=outer-signature-1 from {url}") from inner
    except RuntimeError as exc:
        outer = exc
    scrub_exception(outer)
    for exc in (outer, outer.__cause__):
        assert "chained-pw-1" not in str(exc) and "chained-pw-1" not in repr(exc)
    assert "outer-signature-1" not in str(outer)
    assert outer.__cause__.kwargs["endpoint_url"] == "http://user:<redacted>@127.0.0.1:1/b/k"


def test_log_lines_are_scrubbed_with_their_tracebacks(caplog):
    log = logger("ckptlib.storage.test_scrub")
    with caplog.at_level(logging.DEBUG, logger="ckptlib.storage.test_scrub"):
        try:
            raise ValueError("inner sig=trace-signature-1")
        except ValueError:
            log.warning("connect to %s failed", "http://u:log-pw-123@h:1/x", exc_info=True)
    (record,) = caplog.records
    assert record.getMessage() == "connect to http://u:<redacted>@h:1/x failed"
    assert "log-pw-123" not in caplog.text and "trace-signature-1" not in caplog.text
    assert "sig=<redacted>" in caplog.text


def test_an_sdks_loggers_are_scrubbed_once_guarded(caplog):
    guard_loggers(["ckptlib_test_sdk"])
    sdk_log = logging.getLogger("ckptlib_test_sdk.endpoint")
    guard_loggers(["ckptlib_test_sdk"])  # loggers that exist by now are covered too
    with caplog.at_level(logging.DEBUG, logger="ckptlib_test_sdk"):
        sdk_log.debug("Sending http request: url=%s", "http://u:sdk-pw-1234@127.0.0.1:1/b")
    assert "sdk-pw-1234" not in caplog.text and "u:<redacted>@" in caplog.text


# -- every backend, through its real client --------------------------------------------------------

REMOTE = [
    pytest.param("s3", id="s3", marks=pytest.mark.s3),
    pytest.param("gcs", id="gcs", marks=pytest.mark.gcs),
    pytest.param("azure", id="azure", marks=pytest.mark.azure),
]
URIS = {"s3": "s3://some-bucket/run", "gcs": "gs://some-bucket/run", "azure": "az://some-container/run"}


@pytest.fixture
def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]  # nothing listens there once the socket is closed


@pytest.fixture
def endpoint_with_password(request, closed_port, tmp_path):
    """This backend's endpoint set to http://ckpt-user:<password>@127.0.0.1:<closed port>."""
    cloud = request.param
    password = f"Pw-{cloud}-in-the-url-0123"
    url = f"http://ckpt-user:{password}@127.0.0.1:{closed_port}"
    env = {"s3": lambda: s3_env(url, str(tmp_path)), "gcs": lambda: em.gcs_env(url), "azure": lambda: em.azure_env(url)}
    pytest.importorskip({"s3": "boto3", "gcs": "google.cloud.storage", "azure": "azure.storage.blob"}[cloud])
    with environ(env[cloud]()):
        yield cloud, password


def _chain(exc: BaseException | None) -> list[BaseException]:
    out = []
    while exc is not None and exc not in out:
        out.append(exc)
        exc = exc.__cause__ or exc.__context__
    return out


@pytest.mark.parametrize("endpoint_with_password", REMOTE, indirect=True)
def test_no_backend_shows_its_endpoints_password(endpoint_with_password, monkeypatch, caplog):
    """A password in the endpoint URL (S3: AWS_ENDPOINT_URL; GCS: STORAGE_EMULATOR_HOST; Azure:
    the connection string's BlobEndpoint) appears in no message, chained exception or log line,
    ckptlib's or the SDK's, while the server cannot be reached."""
    cloud, password = endpoint_with_password
    record_sleeps(monkeypatch)
    storage = open_storage(URIS[cloud])
    storage.max_attempts = 2
    with caplog.at_level(logging.DEBUG):
        with pytest.raises(StorageError) as info:
            storage.write("x", b"1")
    assert str(info.value).startswith(f"{LABELS[cloud]} put failed for {URIS[cloud]}/x: ")
    assert str(info.value).endswith("(gave up after 2 attempts)")
    for exc in _chain(info.value):
        assert password not in str(exc) and password not in repr(exc)
    assert caplog.records
    assert all(password not in record.getMessage() for record in caplog.records)
    assert password not in caplog.text


def _sdk_error_carrying(cloud: str, text: str) -> Exception:
    """The backend SDK's own permanent error, whose message carries `text`."""
    if cloud == "s3":
        from botocore.exceptions import ClientError

        reply = {"Error": {"Code": "AccessDenied", "Message": text}, "ResponseMetadata": {"HTTPStatusCode": 403}}
        return ClientError(reply, "PutObject")
    if cloud == "gcs":
        from google.api_core.exceptions import Forbidden

        return Forbidden(text)
    from azure.core.exceptions import ClientAuthenticationError

    return ClientAuthenticationError(message=text)


@pytest.mark.parametrize("endpoint_with_password", REMOTE, indirect=True)
def test_no_backend_repeats_credentials_from_the_sdks_error(endpoint_with_password, monkeypatch):
    """Whatever credential an SDK's error text carries (a SAS signature, an account key, a
    bearer token, a session token, an access key id) is redacted from the StorageError and
    from the SDK error it chains."""
    cloud, _ = endpoint_with_password
    storage = open_storage(URIS[cloud])
    faults = Faults.install(monkeypatch, storage)
    secrets = ["sig=Zm9vYmFyc2ln", f"AccountKey={AZURE_KEY}", "Bearer eyJhbGciOiJIUzI1NiJ9", "AKIAIOSFODNN7EXAMPLE"]
    secrets.append("X-Amz-Security-Token=FwoGZXIvYXdzEBYaDH")
    faults.fail("put", lambda: _sdk_error_carrying(cloud, "denied for " + " ".join(secrets)))
    with pytest.raises(StorageError) as info:
        storage.write("x", b"1")
    for exc in _chain(info.value):
        for value in ("Zm9vYmFyc2ln", AZURE_KEY, "eyJhbGciOiJIUzI1NiJ9", "AKIAIOSFODNN7EXAMPLE", "FwoGZXIvYXdzEBYaDH"):
            assert value not in str(exc), (type(exc).__name__, value)
    assert str(info.value).startswith(f"{LABELS[cloud]} put failed for {URIS[cloud]}/x: ")
    assert faults.count("put") == 1
