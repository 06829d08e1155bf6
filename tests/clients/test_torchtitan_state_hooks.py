"""torchtitan 0.3's real Llama3 (fused QKV: its `wqkv` parameter saved as `wq`/`wk`/`wv` by
state-dict hooks, which torch's get_model_state_dict cannot follow) saved by `ckptlib.save`
with its AdamW under FSDP2 at 2 ranks and loaded at 1 and 3, bit-exactly, in the client env
`ci/client_envs.sh hf` builds (tests/helpers/client_envs.py; the script:
tests/helpers/client_scripts/). The same hook pattern without torchtitan, at 1, 2 and 3 ranks:
tests/api/test_state_hooks.py."""

from __future__ import annotations

import pytest
import torch

client_envs = pytest.importorskip(
    "helpers.client_envs", reason="the client environments (tests/helpers/client_envs.py)"
)

pytestmark = pytest.mark.clients


@pytest.mark.parametrize("load_ws", [1, 3], ids=["save2-fsdp2-load1", "save2-fsdp2-load3-fsdp2"])
def test_torchtitan_fused_qkv_saves_and_reshards_bit_exact(tmp_path, load_ws):
    uri = str(tmp_path / "ckpt")
    work = str(tmp_path)
    saved = client_envs.run("hf", "titan_state_hooks.py", uri, "save", nproc=2, workdir=work)
    assert saved[0]["helper"] == "AttributeError: 'FusedQKVLinear' object has no attribute 'wq'"
    keys = saved[0]["keys"]
    assert "model.layers.0.attention.qkv_linear.wq.weight" in keys
    assert not [k for k in keys if k.startswith("model.") and ".wqkv." in k]
    assert "optim.state.layers.0.attention.qkv_linear.wqkv.weight.exp_avg" in keys  # paired by parameter name
    loaded = client_envs.run(
        "hf", "titan_state_hooks.py", uri, "load", nproc=load_ws if load_ws > 1 else 0, workdir=work
    )
    expected = torch.load(saved[0]["values"])
    for report in loaded:
        got = torch.load(report["values"])
        assert sorted(got) == sorted(expected)
        assert [k for k in expected if not torch.equal(expected[k], got[k])] == []
