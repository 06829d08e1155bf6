"""Load control (only=, ignore_keys=, rename=) and CheckpointManager(initial_load=).

Axes: the control (only / ignore / rename by prefix / rename by callable), the source
format (ckptlib, torch.save, safetensors), the world sizes (saved at 2, loaded at 3), and
strictness. Every check is bit-exact against the saved tensors or the untouched ones.
"""

from __future__ import annotations

import os
import time
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn

import ckptlib
from ckptlib import (
    CastWarning,
    CheckpointManager,
    CheckpointNotFoundError,
    InitialLoad,
    MissingKeysError,
    ShapeMismatchError,
    StateError,
)
from ckptlib._torch import parallel
from ckptlib.testing.fakes.legacy_writers import write_safetensors, write_torch_save


class Net(nn.Module):
    def __init__(self, seed: int):
        super().__init__()
        torch.manual_seed(seed)
        self.encoder = nn.Linear(8, 16)
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        return self.head(torch.tanh(self.encoder(x)))


class RenamedNet(nn.Module):
    """Net with its encoder called `backbone` (a refactored model loading an old checkpoint)."""

    def __init__(self, seed: int):
        super().__init__()
        torch.manual_seed(seed)
        self.backbone = nn.Linear(8, 16)
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        return self.head(torch.tanh(self.backbone(x)))


def _trained(seed: int = 0):
    model = Net(seed)
    optim = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(3, 8)).sum().backward()
    optim.step()
    return model, optim


def _sd(module: nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for k, v in module.state_dict().items():
        v = v.full_tensor() if hasattr(v, "full_tensor") else v
        out[k] = v.detach().clone()
    return out


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _as_backbone(sd: dict) -> dict:
    return {k.replace("encoder.", "backbone."): v for k, v in sd.items()}


@pytest.fixture
def full_ckpt(tmp_path):
    model, optim = _trained()
    path = tmp_path / "full"
    ckptlib.save(path, {"model": model, "optim": optim, "epoch": 7}, step=5)
    return path, _sd(model), optim.state_dict()


# ---------------------------------------------------------------- only=


@pytest.mark.parametrize("only", [("model",), "model", ["model", "epoch"]], ids=["tuple", "str", "list+plain"])
def test_only_loads_the_named_entries(full_ckpt, only):
    path, saved, _ = full_ckpt
    model = Net(1)
    optim = torch.optim.AdamW(model.parameters(), lr=0.1)
    state = {"model": model, "optim": optim, "epoch": -1}
    result = ckptlib.load(path, state, only=only)
    assert _equal(_sd(model), saved)
    assert optim.state_dict()["state"] == {}  # untouched: still fresh
    assert state["epoch"] == (7 if "epoch" in only else -1)
    assert result.step == 5 and result.missing_keys == []


def test_only_names_must_exist(full_ckpt):
    path, _, _ = full_ckpt
    with pytest.raises(StateError, match=r"only= names \['optimizer'\] that the state does not have"):
        ckptlib.load(path, {"model": Net(1)}, only=("optimizer",))


# ---------------------------------------------------------------- ignore_keys=


@pytest.mark.parametrize(
    "patterns, ignored_prefixes",
    [
        (["model.head.*"], ["head."]),
        (["model.head.bias", "model.encoder.weight"], ["head.bias", "encoder.weight"]),
        (["*bias"], ["head.bias", "encoder.bias"]),
        ("model.encoder.*", ["encoder."]),
    ],
    ids=["glob-head", "two-exact", "suffix-glob", "single-str"],
)
def test_ignored_keys_keep_their_values(full_ckpt, patterns, ignored_prefixes):
    path, saved, saved_optim = full_ckpt
    model = Net(1)
    before = _sd(model)
    optim = torch.optim.AdamW(model.parameters(), lr=0.1)
    ckptlib.load(path, {"model": model, "optim": optim}, ignore_keys=patterns)
    after = _sd(model)
    for key in after:
        want = before[key] if any(key.startswith(p) for p in ignored_prefixes) else saved[key]
        assert torch.equal(after[key], want), key
    # the optimizer is loaded (its keys are not ignored): AdamW moments match the saved ones
    for index, moments in saved_optim["state"].items():
        assert torch.equal(optim.state_dict()["state"][index]["exp_avg"], moments["exp_avg"])


def test_ignored_keys_are_not_missing(tmp_path):
    ckptlib.save(tmp_path / "c", {"w": torch.arange(4.0)})
    state = {"w": torch.zeros(4), "new_buffer": torch.full((2,), 9.0)}
    with pytest.raises(MissingKeysError, match="new_buffer"):
        ckptlib.load(tmp_path / "c", state)
    result = ckptlib.load(tmp_path / "c", state, ignore_keys=["new_*"])
    assert result.missing_keys == []
    assert torch.equal(state["w"], torch.arange(4.0)) and torch.equal(state["new_buffer"], torch.full((2,), 9.0))
    state["w"].zero_()
    result = ckptlib.load(tmp_path / "c", state, strict=False, ignore_keys=["w"])
    assert result.missing_keys == ["new_buffer"] and torch.equal(state["w"], torch.zeros(4))


# ---------------------------------------------------------------- rename=


@pytest.mark.parametrize(
    "rename",
    [
        {
            "model.encoder.": "model.backbone.",
            "optim.state.encoder.": "optim.state.backbone.",
            "optim.param_groups.encoder.": "optim.param_groups.backbone.",
        },
        lambda key: key.replace("encoder.", "backbone."),
    ],
    ids=["prefix-dict", "callable"],
)
def test_rename_loads_old_keys_into_new_names(full_ckpt, rename):
    path, saved, saved_optim = full_ckpt
    model = RenamedNet(1)
    optim = torch.optim.AdamW(model.parameters(), lr=0.1)
    result = ckptlib.load(path, {"model": model, "optim": optim}, rename=rename)
    assert _equal(_sd(model), _as_backbone(saved))
    assert result.missing_keys == []
    got = optim.state_dict()["state"]
    for index, moments in saved_optim["state"].items():
        assert torch.equal(got[index]["exp_avg"], moments["exp_avg"])
        assert torch.equal(got[index]["exp_avg_sq"], moments["exp_avg_sq"])


def test_rename_longest_prefix_wins(tmp_path):
    ckptlib.save(tmp_path / "c", {"a": {"x": torch.ones(2), "xy": torch.full((2,), 2.0)}})
    state = {"b": {"x": torch.zeros(2)}, "c": {"y": torch.zeros(2)}}
    ckptlib.load(tmp_path / "c", state, rename={"a.": "b.", "a.xy": "c.y"})
    assert torch.equal(state["b"]["x"], torch.ones(2)) and torch.equal(state["c"]["y"], torch.full((2,), 2.0))


def test_rename_errors(full_ckpt):
    path, _, _ = full_ckpt
    with pytest.raises(StateError, match="rename maps both checkpoint keys"):
        ckptlib.load(path, {"model": Net(1)}, rename=lambda k: "model.head.bias" if k.startswith("model.") else k)
    with pytest.raises(StateError, match="rename returned None for checkpoint key"):
        ckptlib.load(path, {"model": Net(1)}, rename=lambda k: None)
    with pytest.raises(StateError, match="rename raised on checkpoint key"):
        ckptlib.load(path, {"model": Net(1)}, rename=lambda k: 1 / 0)
    with pytest.raises(StateError, match="rename must map old key prefixes"):
        ckptlib.load(path, {"model": Net(1)}, rename={"model.": 3})


def test_a_key_renamed_away_is_missing(full_ckpt):
    """rename moves `model.head.*` to `model.old_head.*`: the state's own head has no source."""
    path, saved, _ = full_ckpt
    model = Net(1)
    before = _sd(model)
    with pytest.raises(MissingKeysError, match="no checkpoint key is renamed to model.head.bias, model.head.weight"):
        ckptlib.load(path, {"model": model}, rename={"model.head.": "model.old_head."})
    result = ckptlib.load(path, {"model": model}, rename={"model.head.": "model.old_head."}, strict=False)
    assert result.missing_keys == ["model.head.bias", "model.head.weight"]
    after = _sd(model)
    assert torch.equal(after["head.weight"], before["head.weight"])
    assert torch.equal(after["encoder.weight"], saved["encoder.weight"])


# ---------------------------------------------------------------- foreign formats


@pytest.mark.parametrize("shards", [1, 2], ids=["safetensors-single", "safetensors-sharded"])
def test_safetensors_with_rename_and_ignore(tmp_path, shards):
    model, _ = _trained()
    write_safetensors(str(tmp_path / "hf"), model.state_dict(), shards=shards)
    target = RenamedNet(3)
    before = _sd(target)
    optim = torch.optim.AdamW(target.parameters(), lr=0.1)
    result = ckptlib.load(
        tmp_path / "hf",
        {"model": target, "optim": optim},
        only=("model",),
        rename={"model.encoder.": "model.backbone."},
        ignore_keys=["model.head.bias"],
    )
    assert result.format == "safetensors"
    want = _as_backbone(_sd(model))
    want["head.bias"] = before["head.bias"]
    assert _equal(_sd(target), want)


def test_torch_save_file_model_only(tmp_path):
    model, optim = _trained()
    write_torch_save(str(tmp_path / "ckpt.pt"), {"model": model.state_dict(), "optim": optim.state_dict()})
    target = Net(4)
    target_optim = torch.optim.AdamW(target.parameters(), lr=0.1)
    ckptlib.load(tmp_path / "ckpt.pt", {"model": target, "optim": target_optim}, only=["model"])
    assert _equal(_sd(target), _sd(model)) and target_optim.state_dict()["state"] == {}


# ---------------------------------------------------------------- resharded: save at 2, load at 3


def _fsdp(model: nn.Module) -> nn.Module:
    fully_shard = parallel.require_fsdp2_cpu()
    mesh = parallel.init_device_mesh_fn()("cpu", (dist.get_world_size(),))
    for child in model.children():
        fully_shard(child, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _save_sharded(path: str) -> dict:
    model = _fsdp(Net(0))
    optim = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(3, 8)).sum().backward()
    optim.step()
    ckptlib.save(path, {"model": model, "optim": optim}, step=2)
    return _sd(model)


def _load_renamed_sharded(path: str) -> tuple[dict, dict]:
    model = _fsdp(RenamedNet(9))
    before = _sd(model)
    optim = torch.optim.AdamW(model.parameters(), lr=0.1)
    ckptlib.load(
        path,
        {"model": model, "optim": optim},
        only=("model",),
        rename={"model.encoder.": "model.backbone."},
        ignore_keys=["model.head.*"],
    )
    return before, _sd(model)


def test_resharded_load_with_rename_ignore_and_only(tmp_path, dist_run):
    if parallel.fsdp2_cpu_reason() is not None:
        pytest.skip(parallel.fsdp2_cpu_reason())
    path = str(tmp_path / "c")
    saved = dist_run(2, _save_sharded, path)[0]
    results = dist_run(3, _load_renamed_sharded, path)
    for before, after in results:
        want = _as_backbone(saved)
        want["head.weight"], want["head.bias"] = before["head.weight"], before["head.bias"]
        assert _equal(after, want)


# ---------------------------------------------------------------- initial_load


def test_initial_load_model_only_then_ignored_once_the_root_has_a_step(full_ckpt, tmp_path):
    path, saved, _ = full_ckpt
    root = tmp_path / "run"
    model = Net(1)
    optim = torch.optim.AdamW(model.parameters(), lr=0.1)
    state = {"model": model, "optim": optim, "epoch": -1}
    mgr = CheckpointManager(root, initial_load=path)
    assert mgr.load(state) == 0 and mgr.initial_loaded
    assert _equal(_sd(model), saved) and optim.state_dict()["state"] == {} and state["epoch"] == -1
    assert mgr.last_load.uri == str(path) and mgr.last_load.step == 5  # the LoadResult of that load
    model(torch.randn(2, 8)).sum().backward()
    optim.step()
    mgr.save(1, state)
    trained = _sd(model)

    again = Net(2)
    again_optim = torch.optim.AdamW(again.parameters(), lr=0.1)
    mgr2 = CheckpointManager(root, initial_load=path)
    assert mgr2.load({"model": again, "optim": again_optim, "epoch": -1}) == 1 and not mgr2.initial_loaded
    assert _equal(_sd(again), trained) and again_optim.state_dict()["state"] != {}


def test_initial_load_with_optimizer_and_after_debris(full_ckpt, tmp_path):
    path, saved, saved_optim = full_ckpt
    root = tmp_path / "run"
    (root / "step_0000000003").mkdir(parents=True)
    (root / "step_0000000003" / "ckptlib.pending").write_text("{}")  # a crashed first save
    model = Net(1)
    optim = torch.optim.AdamW(model.parameters(), lr=0.1)
    mgr = CheckpointManager(root, initial_load=InitialLoad(str(path), only=("model", "optim")))
    assert mgr.load({"model": model, "optim": optim}) == 0
    assert _equal(_sd(model), saved)
    assert torch.equal(optim.state_dict()["state"][0]["exp_avg"], saved_optim["state"][0]["exp_avg"])


def test_initial_load_that_does_not_exist(tmp_path):
    missing = tmp_path / "no-such-checkpoint"
    mgr = CheckpointManager(tmp_path / "run", initial_load=missing)
    with pytest.raises(CheckpointNotFoundError, match=f"initial_load '{missing}' does not exist") as info:
        mgr.load({"model": Net(1)})
    assert info.value.path == str(missing)


def test_initial_load_needs_modules_or_names(full_ckpt, tmp_path):
    path, _, _ = full_ckpt
    mgr = CheckpointManager(tmp_path / "run", initial_load=path)
    with pytest.raises(StateError, match="the state has none; pass initial_load_only"):
        mgr.load({"w": torch.zeros(2)})


def _initial_from_safetensors(root: str, hf: str):
    model = _fsdp(RenamedNet(5))
    mgr = CheckpointManager(root, initial_load=hf)
    step = mgr.load({"model": model}, rename={"model.encoder.": "model.backbone."})
    return step, _sd(model)


def test_initial_load_safetensors_at_2_ranks(tmp_path, dist_run):
    if parallel.fsdp2_cpu_reason() is not None:
        pytest.skip(parallel.fsdp2_cpu_reason())
    model, _ = _trained()
    write_safetensors(str(tmp_path / "hf"), model.state_dict(), shards=2)
    results = dist_run(2, _initial_from_safetensors, str(tmp_path / "run"), str(tmp_path / "hf"))
    for step, got in results:
        assert step == 0 and _equal(got, _as_backbone(_sd(model)))
    assert not os.path.exists(tmp_path / "run" / "latest")


@pytest.mark.parametrize(
    "control",
    [{"only": ("model",)}, {"ignore_keys": ["optim.*", "epoch"]}, {"ignore_keys": "[oe]*"}],
    ids=["only-model", "ignore-optim.*+epoch", "ignore-glob"],
)
def test_manager_load_takes_the_same_controls(full_ckpt, tmp_path, control):
    path, saved, _ = full_ckpt
    mgr = CheckpointManager(tmp_path / "run")
    model, optim = _trained(0)
    mgr.save(3, {"model": model, "optim": optim, "epoch": 7})
    target = Net(6)
    target_optim = torch.optim.AdamW(target.parameters(), lr=0.1)
    state = {"model": target, "optim": target_optim, "epoch": -1}
    assert mgr.load(state, **control) == 3
    assert _equal(_sd(target), _sd(model)) and state["epoch"] == -1
    assert target_optim.state_dict()["state"] == {}  # untouched, not even initialised


def test_load_result_carries_the_format_notes(tmp_path):
    """A flat model state dict saved with torch.save loads as the "model" entry, and the
    LoadResult says so: the format's notes reach the caller."""
    model = Net(3)
    write_torch_save(str(tmp_path / "model.pt"), model.state_dict())
    target = Net(4)
    result = ckptlib.load(tmp_path / "model.pt", {"model": target})
    assert _equal(_sd(target), _sd(model))
    assert result.notes == [f"{tmp_path / 'model.pt'}: a flat model state dict, loaded as the 'model' entry"]


# ---------------------------------------------------------------- results and long key lists


def test_save_and_load_results_report_size_and_duration(tmp_path):
    state = {"w": torch.arange(1000, dtype=torch.float32)}
    before = time.perf_counter()
    saved = ckptlib.save(tmp_path / "ck", state, step=3)
    save_bound = time.perf_counter() - before
    assert isinstance(saved.total_bytes, int) and saved.total_bytes > 4000  # the 4000-byte tensor and more
    assert saved.bytes == saved.total_bytes
    assert 0 < saved.seconds <= save_bound
    assert saved.mib_per_s == saved.total_bytes / (1 << 20) / saved.seconds
    before = time.perf_counter()
    loaded = ckptlib.load(tmp_path / "ck", {"w": torch.zeros(1000)})
    assert 0 < loaded.seconds <= time.perf_counter() - before
    assert (loaded.step, loaded.world_size, loaded.load_world_size) == (3, 1, 1)


def _keys(n: int) -> list[str]:
    return [f"k{i:02d}" for i in range(n)]


@pytest.mark.parametrize("n", [20, 21])
def test_missing_keys_message_names_twenty_then_counts(tmp_path, n):
    ckptlib.save(tmp_path / "ck", {"w": torch.zeros(2)})
    state = {"w": torch.zeros(2), **{key: torch.zeros(2) for key in _keys(n)}}
    with pytest.raises(MissingKeysError) as caught:
        ckptlib.load(tmp_path / "ck", state)
    suffix = " ... (21 in all)" if n == 21 else ""
    assert str(caught.value) == f"{tmp_path / 'ck'} lacks keys the state asks for: {', '.join(_keys(20))}{suffix}"
    assert caught.value.keys == _keys(n)


@pytest.mark.parametrize("n", [20, 21])
def test_cast_warning_names_twenty_then_counts(tmp_path, n):
    ckptlib.save(tmp_path / "ck", {key: torch.zeros(2) for key in _keys(n)})
    with pytest.warns(CastWarning) as caught:
        ckptlib.load(tmp_path / "ck", {key: torch.zeros(2, dtype=torch.float64) for key in _keys(n)}, cast=True)
    shown = "; ".join(f"{key} saved as float32, requested float64" for key in _keys(20))
    suffix = " ... (21 in all)" if n == 21 else ""
    [warning] = [w for w in caught if issubclass(w.category, CastWarning)]
    assert str(warning.message) == f"{tmp_path / 'ck'}: converted to the dtypes the state asked for: {shown}{suffix}"


@pytest.mark.parametrize(
    "requested, lossy",
    [(torch.float32, False), (torch.int8, False), (torch.complex64, True)],
    ids=["to-float", "to-int", "to-complex"],
)
def test_cast_from_bool(tmp_path, requested, lossy):
    """bool widens exactly to floats and ints; to a complex dtype the warning says lossy."""
    ckptlib.save(tmp_path / "ck", {"b": torch.tensor([True, False])})
    target = {"b": torch.zeros(2, dtype=requested)}
    with pytest.warns(CastWarning) as caught:
        ckptlib.load(tmp_path / "ck", target, cast=True)
    name = str(requested).replace("torch.", "")
    [warning] = [w for w in caught if issubclass(w.category, CastWarning)]
    assert str(warning.message).endswith(f"b saved as bool, requested {name}{' (lossy)' if lossy else ''}")
    assert target["b"].tolist() == torch.tensor([True, False]).to(requested).tolist()


def test_plain_dcp_load_reports_the_tensor_bytes(tmp_path):
    """Without a manifest the size is the tensors' bytes: 10 float32 + 3 int64 = 64."""
    import torch.distributed.checkpoint as dcp

    saved = {"w": torch.arange(10, dtype=torch.float32), "i": torch.arange(3), "note": "x"}
    dcp.save(saved, storage_writer=dcp.FileSystemWriter(str(tmp_path / "plain")), no_dist=True)
    target = {"w": torch.zeros(10), "i": torch.zeros(3, dtype=torch.int64)}
    result = ckptlib.load(tmp_path / "plain", target)
    assert result.bytes == 64
    assert target["w"].tolist() == saved["w"].tolist() and target["i"].tolist() == [0, 1, 2]


def test_shape_mismatch_after_a_missing_key_is_still_found(tmp_path):
    """strict=False skips the absent key and still checks every key after it."""
    ckptlib.save(tmp_path / "ck", {"w": torch.zeros(2)})
    with pytest.raises(ShapeMismatchError) as caught:
        ckptlib.load(tmp_path / "ck", {"absent": torch.zeros(1), "w": torch.zeros(3)}, strict=False)
    assert str(caught.value) == (
        f"{tmp_path / 'ck'}: state does not match the checkpoint: w: shape (3,) in the state, (2,) in the checkpoint"
    )


def test_shape_mismatch_message_names_the_first_twenty(tmp_path):
    ckptlib.save(tmp_path / "ck", {key: torch.zeros(2) for key in _keys(21)})
    with pytest.raises(ShapeMismatchError) as caught:
        ckptlib.load(tmp_path / "ck", {key: torch.zeros(3) for key in _keys(21)})
    problems = "; ".join(f"{key}: shape (3,) in the state, (2,) in the checkpoint" for key in _keys(20))
    assert str(caught.value) == f"{tmp_path / 'ck'}: state does not match the checkpoint: {problems}"
    assert caught.value.keys == _keys(21)


def test_absent_nested_plain_value_is_missing_under_its_flat_key(tmp_path):
    """A nested plain value the checkpoint lacks is missing as `meta.epoch` (torch >= 2.4 keys),
    not under the pre-2.4 key `meta`: the old key rules apply only where they match more keys."""
    ckptlib.save(tmp_path / "ck", {"w": torch.ones(2)})
    with pytest.raises(MissingKeysError) as caught:
        ckptlib.load(tmp_path / "ck", {"w": torch.zeros(2), "meta": {"epoch": 1}})
    assert str(caught.value) == (
        f"{tmp_path / 'ck'} lacks keys the state asks for: meta.epoch; the checkpoint has no 'meta' at all (it "
        "holds 'w'): load only=('w',) to load the rest, or strict=False to skip what it lacks"
    )
    state = {"w": torch.zeros(2), "meta": {"epoch": 1}}
    result = ckptlib.load(tmp_path / "ck", state, strict=False)
    assert result.missing_keys == ["meta.epoch"]
    assert state["meta"] == {"epoch": 1} and state["w"].tolist() == [1.0, 1.0]


def test_missing_model_key_is_not_reported_as_an_optimizer_hyperparameter(tmp_path):
    """Only optimizer hyperparameters a newer torch added are kept and noted; an ordinary key
    the checkpoint lacks, beside keys it has, is just missing."""
    ckptlib.save(tmp_path / "ck", {"model": {"w": torch.ones(2)}})
    state = {"model": {"w": torch.zeros(2), "extra": torch.full((2,), 7.0)}}
    result = ckptlib.load(tmp_path / "ck", state, strict=False)
    assert result.missing_keys == ["model.extra"]
    assert result.notes == []
    assert state["model"]["w"].tolist() == [1.0, 1.0] and state["model"]["extra"].tolist() == [7.0, 7.0]


def test_keys_renamed_away_message_names_twenty(tmp_path):
    ckptlib.save(tmp_path / "ck", {key: torch.zeros(2) for key in _keys(21)})
    with pytest.raises(MissingKeysError) as caught:
        ckptlib.load(tmp_path / "ck", {key: torch.ones(2) for key in _keys(21)}, rename={"k": "old_k"})
    assert str(caught.value) == (
        f"{tmp_path / 'ck'}: no checkpoint key is renamed to {', '.join(_keys(20))} (rename= renamed their own "
        "names away)"
    )
    assert caught.value.keys == _keys(21)


def test_cast_warning_points_at_the_caller(tmp_path):
    """The CastWarning names the line that called ckptlib.load (stacklevel), not ckptlib."""
    ckptlib.save(tmp_path / "ck", {"w": torch.zeros(2)})
    with pytest.warns(CastWarning) as caught:
        ckptlib.load(tmp_path / "ck", {"w": torch.zeros(2, dtype=torch.float64)}, cast=True)
    [warning] = [w for w in caught if issubclass(w.category, CastWarning)]
    assert warning.filename == __file__


def test_load_result_carries_metadata_and_metrics(tmp_path):
    ckptlib.save(tmp_path / "ck", {"w": torch.ones(2)}, step=9, metadata={"run": "a"}, metrics={"loss": 0.25})
    result = ckptlib.load(tmp_path / "ck", {"w": torch.zeros(2)})
    assert (result.step, result.metadata, result.metrics, result.format) == (9, {"run": "a"}, {"loss": 0.25}, "ckptlib")
    assert result.seconds > 0 and result.mib_per_s == result.bytes / (1 << 20) / result.seconds


@pytest.mark.parametrize(
    "state, hint",
    [
        (
            {"modle": {"a": torch.zeros(2), "b": torch.zeros(2)}, "optim": {"x": torch.zeros(1)}},
            "modle.a, modle.b; the state's 'modle' is not in the checkpoint, which has 'model': did you mean it?; "
            "the checkpoint's keys the state does not ask for: model.a, model.b, step",
        ),
        (
            {"model": {"a": torch.zeros(2), "b": torch.zeros(2)}, "ema": {"a": torch.zeros(2)}},
            "ema.a; the checkpoint has no 'ema' at all (it holds 'model', 'optim', 'step'): load only=('model',) "
            "to load the rest, or strict=False to skip what it lacks; the checkpoint's keys the state does not ask "
            "for: optim.x, step",
        ),
        (  # a key inside an entry: its unused neighbours listed, no rename between different names
            {"model": {"a": torch.zeros(2), "c": torch.zeros(2)}},
            "model.c; the checkpoint's keys the state does not ask for: model.b, optim.x, step",
        ),
    ],
    ids=["typo", "entry-absent", "key-absent"],
)
def test_missing_keys_say_what_to_do(tmp_path, state, hint):
    ckptlib.save(
        tmp_path / "ck", {"model": {"a": torch.ones(2), "b": torch.ones(2)}, "optim": {"x": torch.ones(1)}, "step": 1}
    )
    with pytest.raises(MissingKeysError) as caught:
        ckptlib.load(tmp_path / "ck", state)
    assert str(caught.value) == f"{tmp_path / 'ck'} lacks keys the state asks for: {hint}"


@pytest.mark.parametrize(
    "options, said",
    [
        ({"ignore_keys": ["model.zz*"]}, "ignore_keys pattern 'model.zz*'"),
        ({"rename": {"modle.": "model."}}, "rename prefix 'modle.'"),
        ({"ignore_keys": ["optim*", "nope"]}, "ignore_keys pattern 'nope'"),
    ],
    ids=["ignore-typo", "rename-typo", "one-of-two"],
)
def test_a_pattern_that_matches_nothing_warns(tmp_path, options, said):
    ckptlib.save(tmp_path / "ck", {"model": {"a": torch.ones(2)}, "optim": {"x": torch.ones(1)}})
    state = {"model": {"a": torch.zeros(2)}, "optim": {"x": torch.zeros(1)}}
    with pytest.warns(ckptlib.UnmatchedPatternWarning) as record:
        ckptlib.load(tmp_path / "ck", state, strict=False, **options)
    assert [str(w.message) for w in record if w.category is ckptlib.UnmatchedPatternWarning] == [
        f"{said} matches no key of the state or the checkpoint (a typo?); it changes nothing"
    ]
    assert torch.equal(state["model"]["a"], torch.ones(2))


@pytest.mark.parametrize(
    "options", [{"ignore_keys": ["optim"]}, {"ignore_keys": ["optim.*"]}, {"rename": {"model.": "model."}}]
)
def test_patterns_that_match_are_quiet(tmp_path, options):
    ckptlib.save(tmp_path / "ck", {"model": {"a": torch.ones(2)}, "optim": {"x": torch.ones(1)}})
    with warnings.catch_warnings():
        warnings.simplefilter("error", ckptlib.UnmatchedPatternWarning)
        ckptlib.load(tmp_path / "ck", {"model": {"a": torch.zeros(2)}, "optim": {"x": torch.zeros(1)}}, **options)
