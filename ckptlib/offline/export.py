"""Export a checkpoint as one consolidated model in Hugging Face's layout.

    ckptlib.export("ckpt/run1", "hf/", dtype=torch.bfloat16)  # the model alone
    # hf/model-00001-of-00003.safetensors ... + hf/model.safetensors.index.json
    # (one hf/model.safetensors when everything fits in one shard, as Hugging Face does)

Any source ckptlib reads (ckptlib or plain DCP at any saved world size, torch.save files,
v0 per-rank files, safetensors; a CheckpointManager root exports its `latest` step), in one
process, one tensor in memory at a time: peak memory is about the largest tensor plus a
few tens of MiB, never the checkpoint (the writers live with their readers in
`ckptlib.format.foreign.safetensors` and `ckptlib.format.foreign.torch_save`; `ckptlib.format.output` is the
one writer path `export` and `convert` share).

A directory export records what it wrote in `ckptlib_export.json` (no absolute path: the
source by its name, so the directory can be published as is), written before the first
weight file and completed after the last: `force=True` replaces only an export ckptlib
wrote (it removes exactly the files that record lists), never a directory of other files;
a single file only when it carries ckptlib's mark. Side files already in the target
(`config.json`, tokenizer files, README) are kept; `hf_config=`/`copy_from=` copy them in.
Tied weights are written once, as transformers does. A failed export removes what it wrote.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any, Callable, Mapping

import torch

from ckptlib import presets
from ckptlib._runtime.observe import log_operation
from ckptlib.errors import CheckpointNotFoundError, NotACheckpointError, StateError, UnsupportedError
from ckptlib.format.foreign.foreign import DEFAULT_PREFIX
from ckptlib.format.foreign.safetensors_hf import CONFIG, parse_config, side_files, tied_names, with_dtype
from ckptlib.format.foreign.shard_files import planned_entries
from ckptlib.format.output import (
    DEFAULT_MAX_SHARD_SIZE,
    EXPORT_RECORD,
    is_single_file,
    overlaps,
    parse_size,
    progress_bar,
    write_output,
)
from ckptlib.format.source import inspect_checkpoint, open_reader
from ckptlib.format.streaming import SourceValues
from ckptlib.storage import as_storage, is_remote
from ckptlib.storage.base import Storage, root_is_file

FORMATS = ("safetensors", "torch")


@dataclasses.dataclass
class ExportResult:
    """What an export wrote: `files` in `dst`, `bytes` of tensor data (as written, after the
    dtype cast), the source's step and saved world size, and the tensors left out."""

    src: str
    dst: str
    src_format: str
    format: str
    step: int | None
    world_size: int | None
    dtype: str | None
    tensors: int
    bytes: int
    files: list[str]
    skipped: list[str]
    seconds: float
    tied: dict[str, str] = dataclasses.field(default_factory=dict)  # name left out -> the name it is tied to

    @property
    def mib_per_s(self) -> float | None:
        return self.bytes / (1 << 20) / self.seconds if self.seconds > 0 else None


def parse_dtype(value: torch.dtype | str | None) -> torch.dtype | None:
    if value is None or isinstance(value, torch.dtype):
        return value
    dtype = getattr(torch, str(value).removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating-point torch dtype such as bfloat16, got {value!r}")
    return dtype


def _preset_source(storage: Storage, step: int | None, preset: presets.Preset) -> Storage:
    """A client's checkpoint: `storage` itself, the newest in its save folder, or its `step`."""
    if step is None:
        return preset.resolve(storage)
    for info in reversed(preset.scan(storage)):  # the newest of that step (Lightning's -v1 after its name)
        if info.step == step and info.state in ("committed", "dcp"):
            return storage.child(info.name)
    raise CheckpointNotFoundError(f"{storage.uri} has no {preset.name} checkpoint of step {step}", path=storage.uri)


def _source_storage(src: str | os.PathLike | Storage, step: int | None, preset: presets.Preset | None) -> Storage:
    """The checkpoint to export: `src` itself, or a step of the CheckpointManager root `src`
    (`step`, default the one `latest` names), or with a preset one of its save folder's."""
    storage = as_storage(src)
    if preset is not None:
        return _preset_source(storage, step, preset)
    from ckptlib.format.native.root import step_dir
    from ckptlib.manager.manager import CheckpointManager

    manager = CheckpointManager(storage.uri)
    if step is not None:
        if step not in manager.steps():
            raise CheckpointNotFoundError(f"{storage.uri} has no committed step {step}", path=manager.path(step))
        return storage.child(step_dir(step))
    try:
        inspect_checkpoint(storage, verify=False)
        return storage
    except NotACheckpointError:
        latest = manager.latest() if storage.exists() and not root_is_file(storage) else None
        if latest is None:
            raise
        return storage.child(step_dir(latest))


KeyMap = Callable[[str], "str | None"] | Mapping[str, "str | None"]


def _as_callable(key_map: KeyMap | None) -> Callable[[str], str | None] | None:
    """A key map given as {old_prefix: new_prefix} (the longest matching prefix wins; a None
    value leaves the tensors under that prefix out) as a callable."""
    if key_map is None or callable(key_map):
        return key_map
    if not isinstance(key_map, Mapping) or not all(
        isinstance(k, str) and (v is None or isinstance(v, str)) for k, v in key_map.items()
    ):
        raise StateError(f"key_map must be a callable or a dict of str prefixes, got {key_map!r}")
    prefixes = sorted(key_map, key=len, reverse=True)

    def rename(name: str) -> str | None:
        for old in prefixes:
            if name.startswith(old):
                new = key_map[old]
                return None if new is None else new + name[len(old) :]
        return name

    return rename


# An entry, or a key's last part, that only an optimizer's (or scheduler's) state has.
_OPTIMIZER_ENTRIES = frozenset(
    ("optim", "optimizer", "optimizers", "optim_state", "optimizer_state", "optimizer_states", "lr_scheduler")
)
_OPTIMIZER_LEAVES = frozenset(("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer", "square_avg"))


def _looks_like_optimizer(key: str) -> bool:
    parts = key.split(".")
    return parts[0] in _OPTIMIZER_ENTRIES or "param_groups" in parts or parts[-1] in _OPTIMIZER_LEAVES


def _has_model_entry(source: SourceValues, planner_paths: Any) -> bool:
    """Whether the state has a "model" entry: a tensor under "model." that DCP saved nested
    under "model" (its planner path), not one a flat state dict names "model.x" (transformers'
    `LlamaForCausalLM.state_dict()` saved as is: "model.embed_tokens.weight", "lm_head.weight")."""
    dotted = DEFAULT_PREFIX + "."
    paths = planner_paths if isinstance(planner_paths, Mapping) else {}
    for key in source.tensor_keys:
        if key.startswith(dotted):
            path = paths.get(key)
            if not isinstance(path, tuple) or (len(path) > 1 and path[0] == DEFAULT_PREFIX):
                return True
    return False


def _model_only(
    model_only: bool | None,
    prefix: str | None,
    preset: presets.Preset | None,
    uri: str,
    source: SourceValues,
    planner_paths: Any,
) -> bool:
    """Whether only the model's tensors are exported: as asked, else the state's "model" entry
    (with a preset, its model keys) when there is one, else every tensor of a plain model
    state dict; a state of other entries (e.g. "net" + "optim") has to say which is the model."""
    if model_only is not None:
        return model_only
    if prefix is not None:
        return False
    if preset is not None or _has_model_entry(source, planner_paths):
        return True
    keys = [*source.tensor_keys, *source.object_keys]
    if not any(_looks_like_optimizer(k) for k in keys):
        return False
    entries = ", ".join(sorted({k.split(".", 1)[0] for k in keys}))
    raise StateError(
        f"{uri}: no {DEFAULT_PREFIX!r} entry to export as the model (entries: {entries}); pass prefix= "
        "(CLI --prefix) to name the model's entry, or model_only=False (CLI --all) for every tensor",
        path=uri,
    )


def _selector(model_only: bool, prefix: str | None, preset: presets.Preset | None) -> Callable[[str], str | None]:
    """Source key -> the name it is exported as before the key map (None: not exported)."""
    if prefix is not None:
        dotted = prefix + "." if prefix else ""
        return lambda fqn: fqn[len(dotted) :] if fqn.startswith(dotted) else None
    if model_only and preset is not None:
        return preset.model_name
    if model_only:
        dotted = DEFAULT_PREFIX + "."
        return lambda fqn: fqn[len(dotted) :] if fqn.startswith(dotted) else None
    return lambda fqn: fqn


def _names(
    tensor_keys: list[str],
    object_keys: list[str],
    select: Callable[[str], str | None],
    key_map: Callable[[str], str | None] | None,
) -> tuple[dict[str, str], list[str]]:
    """({written name: source key}, skipped source keys)."""
    names: dict[str, str] = {}
    skipped = list(object_keys)
    for fqn in tensor_keys:
        name: str | None = select(fqn)
        if name is None:
            skipped.append(fqn)
            continue
        if key_map is not None:
            name = key_map(name)
            if name is None:
                skipped.append(fqn)
                continue
            if not isinstance(name, str) or not name:
                raise StateError(f"key_map returned {name!r} for {fqn!r}; expected a non-empty str or None")
        if name in names:
            raise StateError(f"two tensors are exported as {name!r}: {names[name]!r} and {fqn!r} (check key_map)")
        names[name] = fqn
    return names, skipped


def _side_files_and_config(
    dst: str, hf_config: Any, copy_from: str | os.PathLike | None, cast: torch.dtype | None
) -> tuple[dict[str, bytes], dict[str, Any] | None]:
    """(side files to copy in, the model's config: the one copied in, else the one in `dst`).
    A copied config names the dtype the weights are written in."""
    side = side_files(hf_config, copy_from)
    if CONFIG in side and cast is not None:
        side[CONFIG] = with_dtype(side[CONFIG], cast)
    raw = side.get(CONFIG)
    existing = os.path.join(dst, CONFIG)
    if raw is None and os.path.isfile(existing):
        with open(existing, "rb") as f:
            raw = f.read()
    return side, parse_config(raw)


def export(
    src: str | os.PathLike | Storage,
    dst: str | os.PathLike,
    *,
    format: str = "safetensors",
    dtype: torch.dtype | str | None = None,
    max_shard_size: int | str | None = DEFAULT_MAX_SHARD_SIZE,
    model_only: bool | None = None,
    prefix: str | None = None,
    key_map: KeyMap | None = None,
    step: int | None = None,
    force: bool = False,
    progress: bool = False,
    trusted: bool = False,
    verify: bool = True,
    hf_config: Any = None,
    copy_from: str | os.PathLike | None = None,
    preset: str | presets.Preset | None = None,
) -> ExportResult:
    """Write the checkpoint at `src` as one consolidated model in Hugging Face's layout at `dst`.

    - `format="safetensors"`: `model.safetensors`, or `model-0000k-of-0000n.safetensors` plus
      `model.safetensors.index.json` (`metadata.total_size` and `metadata.total_parameters`,
      `weight_map`, as transformers writes it) when the tensors exceed `max_shard_size`
      (bytes, or "5GB"/"500MB"/"2GiB" as Hugging Face spells it; a tensor larger than that
      gets a shard of its own). `format="torch"`: `pytorch_model.bin` (torch.save of the flat
      {name: tensor} dict), or `pytorch_model-0000k-of-0000n.bin` plus
      `pytorch_model.bin.index.json`. A `dst` ending in .safetensors (or .bin/.pt/.pth for
      torch) is one file, never sharded.
    - The model alone by default (`model_only=None`): the tensors of the state's "model"
      entry, named without the "model." prefix (the names `model.state_dict()` has, which is
      what transformers' `from_pretrained` expects; with a `preset`, the client's model
      keys); a checkpoint without a "model" entry that holds a plain model state dict (no
      optimizer-looking entry) exports every tensor; one with other entries ("net" +
      "optim") is a StateError naming them. `model_only=True`: the "model" entry, or an
      error; `model_only=False`: every tensor under its full key, optimizer state included
      ("model.w", "optim.state.w.exp_avg", ...). `prefix="net"`: the tensors of that entry
      instead ("" for every tensor). Non-tensor values are never exported (listed in
      `skipped`).
    - `dtype` (e.g. torch.bfloat16 or "bfloat16"): floating-point tensors are cast to it;
      integer and bool tensors keep theirs.
    - `key_map(name) -> str | None`: renames each tensor (after the prefix is stripped);
      None leaves it out. A dict {old_prefix: new_prefix} renames by prefix (longest first;
      a None value leaves the tensors under that prefix out).
    - Tied weights are written once, under the name transformers ties to (`lm_head.weight`
      is left out for `model.embed_tokens.weight`): names the checkpoint stores in the same
      bytes, or the output and input embeddings when the config says
      `tie_word_embeddings: true` (they must then be equal). A config saying false writes
      both. `ExportResult.tied` lists what was left out.
    - `hf_config`: a config.json file, a model directory (its config.json and
      generation_config.json), a dict or a transformers config, copied in as config.json
      (naming `dtype` when the weights are cast); `copy_from`: a directory whose files other
      than weights (tokenizer, README, ...) are copied in. Side files already in `dst` are
      kept; one with other bytes than the copy is refused.
    - `src`: a checkpoint in any format ckptlib reads, or a CheckpointManager root (its
      `latest` step, or `step`); with `preset` ("composer", "torchtitan", "lightning"), that
      client's checkpoint or save folder (its newest checkpoint, or `step`).

    Refuses (CheckpointExistsError) to write into an existing `dst` that holds weights
    ckptlib did not write, or an earlier export unless `force=True`.
    """
    if format not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}, got {format!r}")
    cast = parse_dtype(dtype)
    shard_bytes = parse_size(max_shard_size)
    started = time.perf_counter()
    if is_remote(dst) or str(dst).startswith("file://"):
        raise UnsupportedError(f"export writes a local directory or file; {dst} is not a local path")
    dst_path = os.fspath(dst)
    client = None if preset is None else presets.get(preset)

    source_storage = _source_storage(src, step, client)
    info = inspect_checkpoint(source_storage, verify=verify, trusted=trusted)
    reader, info = open_reader(source_storage, info=info, verify=verify, trusted=trusted)
    source = SourceValues(reader, info.metadata, trusted=trusted)
    planner_paths = getattr(info.metadata, "planner_data", None)
    model_only = _model_only(model_only, prefix, client, info.uri, source, planner_paths)
    select = _selector(model_only, prefix, client)
    names, skipped = _names(source.tensor_keys, source.object_keys, select, _as_callable(key_map))
    if not names:
        shown = ", ".join(source.tensor_keys[:8]) + (" ..." if len(source.tensor_keys) > 8 else "")
        where = f" under {prefix!r}" if prefix else (" of the model" if model_only else "")
        raise StateError(f"{info.uri}: no tensors to export{where} (tensors: {shown or 'none'})", path=info.uri)
    if overlaps(source_storage, dst_path):
        raise StateError(f"refusing to export {info.uri} into or over itself ({dst_path})", path=dst_path)
    single = is_single_file(dst_path, format)
    side, config = ({}, None) if single else _side_files_and_config(dst_path, hf_config, copy_from, cast)
    if single and (hf_config is not None or copy_from is not None):
        raise StateError(f"{dst_path} is one weights file; hf_config and copy_from need a directory to copy into")
    tied = tied_names(source, names, config)
    for name in tied:
        skipped.append(names.pop(name))

    dtype_name = None if cast is None else str(cast).removeprefix("torch.")
    total = sum(e.nbytes for e in planned_entries(source, names, cast))
    bar = progress_bar(total, f"export {format}", progress)
    try:
        files = write_output(
            source,
            dst_path,
            format=format,
            names=names,
            dtype=cast,
            max_shard_bytes=shard_bytes,
            force=force,
            on_tensor=lambda _fqn, nbytes: bar.update(nbytes),
            record={
                "source": os.path.basename(info.uri.rstrip("/")),
                "step": info.step,
                "export_format": format,
                "dtype": dtype_name,
                "model_only": model_only,
                "preset": None if client is None else client.name,
                "tied": tied,
            },
            side_files=side,
        )
    finally:
        bar.close()
    seconds = time.perf_counter() - started
    result = ExportResult(
        src=info.uri,
        dst=dst_path,
        src_format=info.kind,
        format=format,
        step=info.step,
        world_size=info.world_size,
        dtype=dtype_name,
        tensors=len(names),
        bytes=total,
        files=files,
        skipped=skipped,
        seconds=seconds,
        tied=tied,
    )
    log_operation(
        "export",
        uri=dst_path,
        step=info.step,
        nbytes=total,
        seconds=seconds,
        world_size=info.world_size,
        format=format,
        src=info.uri,
    )
    return result


__all__ = ["DEFAULT_MAX_SHARD_SIZE", "EXPORT_RECORD", "ExportResult", "FORMATS", "export", "parse_dtype", "parse_size"]
