"""MosaicML Composer 0.32.1 (torch 2.7) and ckptlib, both ways (issue 28.3, 28.6):

- a real Composer Trainer's FSDP2 sharded checkpoints (saved at 2 ranks) load bit-exactly at
  1 and 3 ranks through `preset="composer"` (its save folder's latest-rank0.pt followed, its
  keys renamed, its timedelta and numpy RNG objects allowed without trusted), on torch 2.7
  and on torch 2.13;
- a ckptlib save in Composer's layout (`ckptlib.presets.composer_save.save(folder, trainer.state)`)
  autoresumes in Composer (`Trainer(autoresume=True)`) at another world size, bit-exactly.
"""

from __future__ import annotations

import pytest
from helpers import client_envs

pytestmark = pytest.mark.clients


@pytest.fixture(scope="module")
def composer_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("composer")
    (trained,) = set(
        r["batch"]
        for r in client_envs.run(
            "composer", "composer_run.py", "train", str(root), "composer", "4", nproc=2, workdir=str(root)
        )
    )
    assert trained == 4
    return root


@pytest.mark.parametrize("env", ["composer", "hf"], ids=["torch27", "torch213"])
@pytest.mark.parametrize("world_size", [1, 3], ids=lambda n: f"save2-composer-load{n}")
def test_composer_checkpoint_loads_bit_exactly_through_the_preset(composer_root, env, world_size):
    results = client_envs.run(
        env, "composer_run.py", "load", str(composer_root), "composer", nproc=world_size, workdir=str(composer_root)
    )
    assert len(results) == world_size
    for got in results:
        assert got["differences"] == []
        assert got["uri"] == "ep0-ba4"  # latest-rank0.pt's target
        assert got["step"] == 4 and got["timestamp_batch"] == 4 and got["run_name"] == "tiny-run"


@pytest.mark.parametrize(
    "save_world, resume_world", [(2, 1), (1, 2)], ids=["save2-ckptlib-resume1", "save1-ckptlib-resume2"]
)
def test_a_ckptlib_save_in_composers_layout_autoresumes_in_composer(tmp_path, save_world, resume_world):
    root = str(tmp_path)
    trained = client_envs.run(
        "composer", "composer_run.py", "train", root, "ckptlib", "2", nproc=save_world, workdir=root
    )
    assert {r["batch"] for r in trained} == {2}
    assert (tmp_path / "ckptlib" / "latest-rank0.pt").is_symlink()
    assert (tmp_path / "ckptlib" / "ep0-ba2" / "ckptlib.json").is_file()  # a committed ckptlib checkpoint
    resumed = client_envs.run(
        "composer", "composer_run.py", "autoresume", root, "ckptlib", nproc=resume_world, workdir=root
    )
    for got in resumed:
        assert got["resumed_batch"] == 2
        assert got["differences"] == []
        assert got["final_batch"] == 6
