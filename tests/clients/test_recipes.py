"""docs/migrating.md's "Coming from torchtitan / Hugging Face / Composer / Lightning" recipes, run as
written against the real packages (issue 28): each code block, with a prelude that builds
what it names and an epilogue that checks what it did (tests/helpers/client_scripts/recipes.py)."""

from __future__ import annotations

import os
import re

import pytest
from helpers import client_envs

pytestmark = pytest.mark.clients

SECTION = "## Coming from torchtitan / Hugging Face / Composer / Lightning"
ENV = {"torchtitan": "hf", "huggingface": "hf", "composer": "composer", "lightning": "hf"}


def recipes() -> dict[str, str]:
    with open(os.path.join(client_envs.REPO, "docs", "migrating.md"), encoding="utf-8") as f:
        text = f.read()
    section = text[text.index(SECTION) :]
    section = section[: section.index("\n## ", len(SECTION))]
    found = {}
    for title, code in re.findall(r"^### (.+?)\n.*?```python\n(.*?)```", section, re.S | re.M):
        found[title.lower().replace(" ", "")] = code
    return found


def test_the_migrating_page_has_a_three_line_recipe_for_each_client():
    found = recipes()
    assert sorted(found) == sorted(ENV)
    for code in found.values():
        assert len([line for line in code.splitlines() if line.strip()]) == 3


@pytest.mark.parametrize("client", sorted(ENV))
def test_recipe_runs_against_the_real_package(tmp_path, client):
    recipe = tmp_path / "recipe.py"
    recipe.write_text(recipes()[client])
    work = tmp_path / "work"
    work.mkdir()
    nproc = 0 if client == "huggingface" else 1
    (got,) = client_envs.run(
        ENV[client], "recipes.py", client, str(recipe), str(work), nproc=nproc, workdir=str(tmp_path)
    )
    assert got["differences"] == []
    if client == "torchtitan":
        assert got["manager"] == "ckptlib.integrations.torchtitan.CheckpointManager" and got["committed"] is True
    elif client == "huggingface":
        assert "model.safetensors" in got["files"] and "config.json" in got["files"]
    elif client == "composer":
        assert got["step"] == 2 and got["pointer"] == "ep0-ba2" and got["committed"] is True
    else:
        assert got["step"] == 4 and got["resumed_to"] == 6 and got["committed"] is True
