"""transformers 5.24 reads ckptlib's Hugging Face export as its own (issue 28.2, 28.6): a tiny
Llama trained in bf16 or fp32, tied or untied, saved with ckptlib and exported (sharded or
one file, config saved first or copied in) loads with `from_pretrained` bit-exactly, the tied
head written once, the index as transformers writes it, no absolute path in the record."""

from __future__ import annotations

import pytest
from helpers import client_envs

pytestmark = pytest.mark.clients

CASES = [
    ("tied", "bfloat16", "sharded", "hf-config"),
    ("untied", "bfloat16", "sharded", "config-first"),
    ("tied", "float32", "single", "config-first"),
    ("untied", "float32", "single", "hf-config"),
]


def _strings(value):
    if isinstance(value, dict):
        for v in value.values():
            yield from _strings(v)
    elif isinstance(value, list):
        for v in value:
            yield from _strings(v)
    elif isinstance(value, str):
        yield value


@pytest.mark.parametrize("tied, dtype, shards, order", CASES, ids=["-".join(c) for c in CASES])
def test_from_pretrained_of_an_export_equals_the_trained_model(tmp_path, tied, dtype, shards, order):
    (got,) = client_envs.run("hf", "hf_export.py", str(tmp_path), tied, dtype, shards, order, workdir=str(tmp_path))
    assert got["differences"] == []
    assert got["loaded_dtype"] == f"torch.{dtype}"
    assert got["tied_in_model"] is (tied == "tied")
    assert got["tied"] == ({"lm_head.weight": "model.embed_tokens.weight"} if tied == "tied" else {})
    weights = [f for f in got["files"] if f.endswith(".safetensors")]
    assert "config.json" in got["files"] and "ckptlib_export.json" in got["files"]
    if shards == "sharded":
        assert len(weights) > 1 and "model.safetensors.index.json" in got["files"]
        assert got["index_has_lm_head"] is (tied == "untied")
        assert got["index_metadata"] == {
            "total_parameters": got["num_parameters"],
            "total_size": got["expected_total_size"],
        }
    else:
        assert weights == ["model.safetensors"] and got["index_metadata"] is None
    record = got["record"]
    assert record["complete"] is True and record["source"] == "ckpt" and record["step"] == 3
    assert ("config.json" in record["files"]) is (order == "hf-config")  # a config the user saved is not ours
    assert not [s for s in _strings(record) if s.startswith("/") or str(tmp_path) in s]
    assert got["verify_rc"] == 0 and got["inspect_rc"] == 0
