"""The client tests' environments (tests/helpers/client_envs.py): without them a test skips and
names the command that builds them; under CI=true it fails instead. Runs without the envs."""

from __future__ import annotations

import pytest
from helpers import client_envs


@pytest.mark.parametrize("env", sorted(client_envs.ENVS))
def test_a_missing_env_skips_with_the_command_that_builds_it(tmp_path, monkeypatch, env):
    monkeypatch.setenv("CKPTLIB_CLIENT_ENVS", str(tmp_path))
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception, match=rf"not built; build it with: ci/client_envs.sh {env} "):
        client_envs.python(env)
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match=rf"CI=true: .*ci/client_envs.sh {env}"):
        client_envs.python(env)
    venv = tmp_path / f"venv-{env}" / "bin"
    venv.mkdir(parents=True)
    (venv / "python").write_text("")
    with pytest.raises(pytest.fail.Exception, match="is not built"):  # no stamp: a build that never finished
        client_envs.python(env)
    (tmp_path / f"venv-{env}" / client_envs.STAMP).write_text("0123")
    assert client_envs.python(env) == str(venv / "python")
