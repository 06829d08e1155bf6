"""What a Hugging Face model directory holds besides its weights, and which weights are tied.

- Side files (`config.json`, `generation_config.json`, tokenizer files, README...): an export
  keeps those already in its target and can copy them in (`side_files`); a file whose name
  transformers reads as weights (`is_weight_file`) is never one.
- Tied weights (`tied_names`): transformers stores an alias pair such as `lm_head.weight` /
  `model.embed_tokens.weight` once, under the name it ties to, and re-ties at load. An export
  does the same when the checkpoint stores both names in the same bytes (storage identity) or
  the config says `tie_word_embeddings: true` (then the two tensors must be equal).
"""

from __future__ import annotations

import json
import os
import re
from typing import TYPE_CHECKING, Any, Mapping

import torch

from ckptlib.errors import CheckpointNotFoundError, StateError

if TYPE_CHECKING:
    from ckptlib.format.streaming import SourceValues

CONFIG = "config.json"
GENERATION_CONFIG = "generation_config.json"
# model.safetensors, model-00001-of-00003.safetensors, pytorch_model.bin(.index.json), tf/flax weights
_WEIGHTS_RE = re.compile(
    r"^(model|pytorch_model|tf_model|flax_model)(-\d+-of-\d+)?\.(safetensors|bin|h5|msgpack)(\.index\.json)?$"
)
# A checkpoint's own files (DCP, ckptlib): never mixed with an export.
_CHECKPOINT_RE = re.compile(r"^(\.metadata|ckptlib\.json|ckptlib\.pending|__\d+_\d+\.distcp)$")
# Output embeddings transformers ties to the input embeddings (dropped from a tied pair).
_OUTPUT_NAMES = ("lm_head.weight", "output.weight", "embed_out.weight")
_INPUT_NAMES = (
    "embed_tokens.weight",
    "wte.weight",
    "word_embeddings.weight",
    "embed_in.weight",
    "tok_embeddings.weight",
)


def is_weight_file(name: str) -> bool:
    """Whether transformers (or DCP) reads a file of this name as a model's weights."""
    return bool(_WEIGHTS_RE.match(name) or _CHECKPOINT_RE.match(name))


def _config_bytes(config: Any) -> bytes:
    """A config given as an object (transformers' PretrainedConfig) or a dict, as config.json bytes."""
    if hasattr(config, "to_json_string"):
        return config.to_json_string().encode("utf-8")
    if hasattr(config, "to_dict"):
        config = config.to_dict()
    if isinstance(config, Mapping):
        return (json.dumps(dict(config), indent=2, sort_keys=True) + "\n").encode("utf-8")
    raise StateError(f"hf_config must be a path, a directory, a dict or a transformers config, got {config!r}")


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def side_files(hf_config: Any = None, copy_from: str | os.PathLike | None = None) -> dict[str, bytes]:
    """{name: bytes} to copy into an export: `hf_config` (a config.json file, a model directory:
    its config.json and generation_config.json, a dict or a transformers config) and every
    top-level file of the directory `copy_from` that is not weights (tokenizer, README...)."""
    out: dict[str, bytes] = {}
    if copy_from is not None:
        directory = os.fspath(copy_from)
        if not os.path.isdir(directory):
            raise CheckpointNotFoundError(f"copy_from: {directory} is not a directory", path=directory)
        for name in sorted(os.listdir(directory)):
            path = os.path.join(directory, name)
            if os.path.isfile(path) and not is_weight_file(name) and not name.startswith(("ckptlib_export", ".")):
                out[name] = _read(path)
    if hf_config is None:
        return out
    if isinstance(hf_config, (str, os.PathLike)):
        path = os.fspath(hf_config)
        if os.path.isdir(path):
            if not os.path.isfile(os.path.join(path, CONFIG)):
                raise CheckpointNotFoundError(f"hf_config: {path} holds no {CONFIG}", path=path)
            for name in (CONFIG, GENERATION_CONFIG):
                if os.path.isfile(os.path.join(path, name)):
                    out[name] = _read(os.path.join(path, name))
        elif os.path.isfile(path):
            out[CONFIG] = _read(path)
        else:
            raise CheckpointNotFoundError(f"hf_config: no such file or directory: {path}", path=path)
    else:
        out[CONFIG] = _config_bytes(hf_config)
    return out


def parse_config(raw: bytes | None, where: str = CONFIG) -> dict[str, Any] | None:
    if raw is None:
        return None
    try:
        doc = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise StateError(f"{where} is not a JSON object ({exc})") from exc
    if not isinstance(doc, dict):
        raise StateError(f"{where} is not a JSON object")
    return doc


def with_dtype(raw: bytes, dtype: torch.dtype) -> bytes:
    """config.json bytes naming the dtype the weights are written in (`dtype`, and the older
    `torch_dtype` where the config has it), as transformers writes them."""
    doc = parse_config(raw) or {}
    name = str(dtype).removeprefix("torch.")
    doc["dtype"] = name
    if "torch_dtype" in doc:
        doc["torch_dtype"] = name
    return (json.dumps(doc, indent=2, sort_keys=True) + "\n").encode("utf-8")


def _storage_places(source: SourceValues) -> dict[str, tuple | None]:
    """{fqn: where a DCP source stores its bytes}: equal for names stored once (aliases); None
    when a locator carries no file position (foreign sources)."""
    places: dict[str, list] = {}
    for index, loc in source.metadata.storage_data.items():
        fqn = getattr(index, "fqn", None)
        where = (getattr(loc, "relative_path", None), getattr(loc, "offset", None), getattr(loc, "length", None))
        if fqn is not None:
            places.setdefault(fqn, []).append(None if None in where else (tuple(index.offset or ()), where))
    return {fqn: None if None in found else tuple(sorted(found)) for fqn, found in places.items()}


def _drop_order(name: str) -> tuple[int, str]:
    """Output embeddings are dropped first; a name like an input embedding is kept last."""
    if name.endswith(_OUTPUT_NAMES):
        return (0, name)
    if name.endswith(_INPUT_NAMES):
        return (2, name)
    return (1, name)


def _same_bytes_groups(source: SourceValues, names: dict[str, str]) -> list[list[str]]:
    places = _storage_places(source)
    groups: dict[tuple, list[str]] = {}
    for name, fqn in names.items():
        key = places.get(fqn)
        if key is not None:
            groups.setdefault(key, []).append(name)
    return [sorted(g) for g in groups.values() if len(g) > 1]


def _config_pair(source: SourceValues, names: dict[str, str]) -> list[str] | None:
    """The output embedding and the one input embedding it ties to, by name and shape."""
    outputs = [n for n in names if n.endswith(_OUTPUT_NAMES)]
    if len(outputs) != 1:
        return None
    out = outputs[0]
    meta = source.tensor_meta(names[out])
    inputs = [
        n
        for n in names
        if n.endswith(_INPUT_NAMES)
        and tuple(source.tensor_meta(names[n]).size) == tuple(meta.size)
        and source.tensor_meta(names[n]).properties.dtype == meta.properties.dtype
    ]
    return [out, inputs[0]] if len(inputs) == 1 else None


def tied_names(source: SourceValues, names: dict[str, str], config: dict[str, Any] | None) -> dict[str, str]:
    """{name left out: the name it is tied to}: the names of each tied group but one.

    Groups: names the checkpoint stores in the same bytes, unless the config says
    `tie_word_embeddings: false` (then both are written: transformers would initialise a
    missing untied head); and, when it says true, the output embedding and its input
    embedding, which must then hold equal values (StateError otherwise)."""
    flag = (config or {}).get("tie_word_embeddings")
    groups = [] if flag is False else _same_bytes_groups(source, names)
    if flag is True:
        pair = _config_pair(source, names)
        if pair is not None and not any(set(pair) <= set(g) for g in groups):
            out, inp = pair
            if not torch.equal(source.tensor(names[out]), source.tensor(names[inp])):
                raise StateError(
                    f"the config says tie_word_embeddings: true, but {out} and {inp} hold different values; "
                    "export the config of an untied model, or fix the weights"
                )
            groups.append(sorted(pair))
    dropped: dict[str, str] = {}
    for group in groups:
        ordered = sorted(group, key=_drop_order)
        kept = ordered[-1]
        for name in ordered[:-1]:
            dropped[name] = kept
    return dropped


__all__ = ["CONFIG", "is_weight_file", "parse_config", "side_files", "tied_names", "with_dtype"]
