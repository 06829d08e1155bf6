"""No credential in any message or log line, whichever path made it (issue 26): not only the
storage backends' own errors (test_scrub.py) but every CheckpointError, the `ckpt` command's
error lines, the `ckptlib` logger's records, the manager's and the tiered upload's errors, and
a URI that itself carries a password or a signature. A message naming a state key such as
`model.token: ...` keeps its text.

Before: a URI with a password (`https://user:pw@host/x`, `file://user:pw@host/x`) was repeated
verbatim by every error and by `ckpt`; the `ckptlib` logger had no scrubbing filter.
"""

from __future__ import annotations

import logging
import os
import socket
import warnings

import pytest
import torch
from helpers.storage import record_sleeps

import ckptlib
from ckptlib import CheckpointManager, Cluster, RemoteLag, RemoteLagError, RemoteTier, RemoteUnavailableWarning
from ckptlib._runtime.observe import log_operation
from ckptlib.cli import main as cli_main
from ckptlib.errors import CheckpointError, StorageError
from ckptlib.testing.fakes import emulators as em
from ckptlib.testing.fakes.emulators import environ
from ckptlib.testing.fakes.s3_server import s3_env

PASSWORD = "Pw-in-the-uri-0123456"
SIGNATURE = "c2lnbmF0dXJlLXZhbHVlLTAxMjM"
URIS = {
    "https-userinfo": f"https://ckpt-user:{PASSWORD}@127.0.0.1:9/bucket/run",
    "file-userinfo": f"file://ckpt-user:{PASSWORD}@remote-host/run",
    "presigned-query": f"https://b.s3.amazonaws.com/run?X-Amz-Signature={SIGNATURE}&X-Amz-Expires=60",
    "sas-query": f"https://acct.blob.core.windows.net/c/run?sv=2021-08-06&sig={SIGNATURE}",
}
SECRETS = (PASSWORD, SIGNATURE)


def _clean(text: str) -> bool:
    return not any(secret in text for secret in SECRETS)


def _chain_clean(exc: BaseException) -> bool:
    seen = []
    while exc is not None and exc not in seen:
        seen.append(exc)
        if isinstance(exc, CheckpointError) and not (_clean(str(exc)) and _clean(str(exc.path))):
            return False
        exc = exc.__cause__ or exc.__context__
    return True


API_CALLS = {
    "save": lambda uri, tmp: ckptlib.save(uri, {"w": torch.ones(2)}),
    "load": lambda uri, tmp: ckptlib.load(uri, {"w": torch.ones(2)}),
    "manager": lambda uri, tmp: CheckpointManager(uri).save(1, {"w": torch.ones(2)}),
    "convert": lambda uri, tmp: ckptlib.convert(uri, str(tmp / "out")),
    "export": lambda uri, tmp: ckptlib.export(uri, str(tmp / "hf")),
}


@pytest.mark.parametrize("call", list(API_CALLS))
@pytest.mark.parametrize("kind", list(URIS))
def test_a_uri_carrying_a_credential_is_never_repeated(tmp_path, caplog, kind, call):
    with caplog.at_level(logging.DEBUG):
        with pytest.raises(CheckpointError) as info:
            API_CALLS[call](URIS[kind], tmp_path)
    assert _chain_clean(info.value), (str(info.value), info.value.path)
    assert "<redacted>" in str(info.value) or "unsupported URI" in str(info.value), str(info.value)
    assert _clean(caplog.text)


@pytest.mark.parametrize("argv", [["inspect"], ["verify"], ["ls"], ["gc", "--keep", "1"], ["export"], ["convert"]])
@pytest.mark.parametrize("kind", list(URIS))
def test_the_ckpt_command_never_prints_a_credential(tmp_path, capsys, kind, argv):
    extra = [str(tmp_path / "out")] if argv[0] in ("export", "convert") else []
    rc = cli_main([argv[0], URIS[kind], *extra, *argv[1:]])
    out, err = capsys.readouterr()
    assert rc != 0 and err.startswith(f"ckpt {argv[0]}: error: "), (rc, err)
    assert _clean(out) and _clean(err), err


def test_the_ckptlib_logger_scrubs_its_records(caplog):
    with caplog.at_level(logging.INFO, logger="ckptlib"):
        log_operation("save", uri=URIS["presigned-query"], step=1, nbytes=10, seconds=1.0, world_size=1)
    (record,) = [r for r in caplog.records if r.name == "ckptlib"]
    assert _clean(record.getMessage()) and "X-Amz-Signature=<redacted>" in record.getMessage()


def test_every_checkpoint_error_is_scrubbed_but_keeps_state_keys(monkeypatch):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "env-secret-value-123")
    err = CheckpointError("upload failed: env-secret-value-123 rejected; password=hunter2hunter2", path="/x")
    assert "env-secret-value-123" not in str(err) and "hunter2hunter2" not in str(err)
    shape = "model.token: shape (9,) in the state, (8,) in the checkpoint; model.sig: dtype float64"
    assert str(CheckpointError(shape)) == shape


def test_a_warning_that_quotes_a_backends_error_is_scrubbed(tmp_path, monkeypatch):
    """The lock that could not be removed after a save: its StaleLockWarning quotes the error,
    whose endpoint URL carries a password (and a signed URL), and shows neither."""
    from ckptlib.manager.lock import RootLock, StaleLockWarning

    def unreachable(self):
        raise OSError(
            f"Could not connect to the endpoint URL: {URIS['https-userinfo']}/ckptlib.lock ({URIS['presigned-query']})"
        )

    monkeypatch.setattr(RootLock, "release", unreachable)
    with pytest.warns(StaleLockWarning, match="could not remove the lock") as caught:
        CheckpointManager(str(tmp_path / "run")).save(1, {"w": torch.ones(2)})
    (warning,) = [w for w in caught if issubclass(w.category, StaleLockWarning)]
    text = str(warning.message)
    assert _clean(text) and "ckpt-user:<redacted>@127.0.0.1" in text and "X-Amz-Signature=<redacted>" in text, text
    assert warning.filename == __file__  # it names the user's line, as before


# -- every backend, through the manager, the tiered upload and the ckpt command ------------------

REMOTE = [
    pytest.param("s3", id="s3", marks=pytest.mark.s3),
    pytest.param("gcs", id="gcs", marks=pytest.mark.gcs),
    pytest.param("azure", id="azure", marks=pytest.mark.azure),
]
ROOTS = {"s3": "s3://some-bucket/run", "gcs": "gs://some-bucket/run", "azure": "az://some-container/run"}


@pytest.fixture
def endpoint_with_password(request, tmp_path, monkeypatch):
    """This backend's endpoint at http://ckpt-user:<PASSWORD>@127.0.0.1:<a closed port>."""
    cloud = request.param
    pytest.importorskip({"s3": "boto3", "gcs": "google.cloud.storage", "azure": "azure.storage.blob"}[cloud])
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    url = f"http://ckpt-user:{PASSWORD}@127.0.0.1:{port}"
    env = {"s3": lambda: s3_env(url, str(tmp_path)), "gcs": lambda: em.gcs_env(url), "azure": lambda: em.azure_env(url)}
    record_sleeps(monkeypatch)
    for name in ("CKPTLIB_S3_MAX_ATTEMPTS", "CKPTLIB_GS_MAX_ATTEMPTS", "CKPTLIB_AZ_MAX_ATTEMPTS"):
        monkeypatch.setenv(name, "2")
    with environ(env[cloud]()):
        yield cloud


@pytest.mark.parametrize("endpoint_with_password", REMOTE, indirect=True)
def test_manager_tiered_and_cli_paths_of_every_backend_never_show_the_password(
    endpoint_with_password, tmp_path, caplog, capsys
):
    root = ROOTS[endpoint_with_password]
    state = {"w": torch.ones(2)}
    with caplog.at_level(logging.DEBUG):
        with pytest.raises(StorageError) as saved:
            CheckpointManager(root).save(1, state)
        with pytest.raises(CheckpointError) as loaded:
            CheckpointManager(root).load(state)
        tiered = CheckpointManager(str(tmp_path / "local"), keep_last=1, cluster=Cluster(remote=RemoteTier(root)))
        with pytest.warns(RemoteUnavailableWarning) as left_local:  # the step stays local: a warning
            tiered.save(1, state)
            tiered.wait()
        with pytest.raises(RemoteLagError) as closed:
            tiered.close()  # the end of the job: step 1 never reached the remote, and close() says so
        strict = Cluster(remote=RemoteTier(root), remote_lag=RemoteLag(steps=0))
        strict_tier = CheckpointManager(str(tmp_path / "strict"), keep_last=1, cluster=strict)
        with pytest.raises(CheckpointError) as uploaded, warnings.catch_warnings(record=True) as also:
            warnings.simplefilter("always")
            strict_tier.save(1, state)
            strict_tier.wait()
        try:
            strict_tier.close()
        except CheckpointError as exc:  # the upload's failure, if save() had not raised it yet
            assert _chain_clean(exc), str(exc)
    assert any("could not be uploaded" in str(w.message) for w in left_local), [str(w.message) for w in left_local]
    for caught in [*left_local, *also]:
        assert _clean(str(caught.message)), str(caught.message)
    assert "step 1 is committed locally only" in str(closed.value)
    for info in (saved, loaded, uploaded, closed):
        assert _chain_clean(info.value), str(info.value)
    assert caplog.records and _clean(caplog.text)
    for argv in (["ls", root], ["inspect", root], ["verify", root, "--no-progress"], ["gc", root, "--keep", "1"]):
        assert cli_main(argv) != 0
        out, err = capsys.readouterr()
        assert err and _clean(out) and _clean(err), err
    assert os.path.isdir(tmp_path / "local")
