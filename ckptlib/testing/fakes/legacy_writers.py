"""Test-only writers of the formats ckptlib reads but never writes in production: v0 per-rank
sets (see ``ckptlib.format.foreign.v0.V0_FORMAT``), sharded safetensors (through the
``safetensors`` package, an independent producer) and monolithic ``torch.save`` files.

They take a *full* nested state (plain tensors and plain values) and lay it out the way an
older trainer or another tool would have.
"""

from __future__ import annotations

import json
import os
from typing import Any, Callable, Mapping

import torch


def uneven_bounds(n: int, world_size: int) -> list[int]:
    """Boundaries of an uneven split of n rows over world_size ranks (rank r weighs r + 1).

    7 rows on 3 ranks -> [1, 3, 3]; 2 rows on 3 ranks -> [0, 1, 1] (an empty piece on rank 0).
    """
    total = world_size * (world_size + 1) // 2
    cum = 0
    bounds = [0]
    for r in range(world_size):
        cum += r + 1
        bounds.append(int(n * cum / total + 0.5))
    bounds[-1] = n
    return bounds


def _pieces(tensor: torch.Tensor, world_size: int, dim: int | None) -> list[tuple[torch.Tensor, list[int]]]:
    """(local, offsets) per rank; dim None replicates the tensor on every rank."""
    if dim is None or tensor.dim() == 0:
        return [(tensor.clone(), [0] * tensor.dim()) for _ in range(world_size)]
    bounds = uneven_bounds(tensor.shape[dim], world_size)
    out = []
    for r in range(world_size):
        offsets = [0] * tensor.dim()
        offsets[dim] = bounds[r]
        out.append((tensor.narrow(dim, bounds[r], bounds[r + 1] - bounds[r]).clone(), offsets))
    return out


def _split_tree(state: Mapping[str, Any], path: tuple = ()) -> tuple[dict, dict]:
    """(tensors, objects): the nested state split into its tensor leaves and the rest."""
    tensors: dict = {}
    objects: dict = {}
    for key, value in state.items():
        if isinstance(value, torch.Tensor):
            tensors[key] = value
        elif isinstance(value, Mapping):
            t, o = _split_tree(value, path + (key,))
            if t:
                tensors[key] = t
            if o:
                objects[key] = o
        elif isinstance(value, (list, tuple)) and any(isinstance(v, torch.Tensor) for v in value):
            raise ValueError(f"v0 cannot hold tensors inside lists ({'.'.join(path + (key,))})")
        else:
            objects[key] = value
    return tensors, objects


def write_v0(
    directory: str,
    state: Mapping[str, Any],
    world_size: int,
    *,
    split_dim: Callable[[str, torch.Tensor], int | None] | None = None,
    flat_keys: bool = False,
    skip_empty: bool = False,
) -> list[str]:
    """Write `state` (full tensors, nested dicts, plain values) as a v0 set of `world_size` ranks.

    `split_dim(fqn, tensor)` picks the dimension each tensor is split along (unevenly, see
    `uneven_bounds`), or None to replicate it; by default dim 0, and 0-dim tensors are
    replicated. `flat_keys` writes "model.proj.weight" keys instead of nested mappings;
    `skip_empty` leaves empty pieces out instead of writing zero-size tensors.
    """
    split_dim = split_dim or (lambda fqn, t: 0 if t.dim() else None)
    tensors, objects = _split_tree(state)
    per_rank: list[dict] = [{} for _ in range(world_size)]

    def visit(tree: dict, path: tuple) -> None:
        for key, value in tree.items():
            if isinstance(value, dict):
                visit(value, path + (key,))
                continue
            fqn = ".".join(path + (key,))
            for rank, (local, offsets) in enumerate(_pieces(value, world_size, split_dim(fqn, value))):
                if skip_empty and local.numel() == 0 and value.numel() != 0:
                    continue
                record = {"local": local, "global_shape": list(value.shape), "offsets": offsets}
                if flat_keys:
                    per_rank[rank][fqn] = record
                else:
                    node = per_rank[rank]
                    for part in path:
                        node = node.setdefault(part, {})
                    node[key] = record

    visit(tensors, ())
    os.makedirs(directory, exist_ok=True)
    names = []
    for rank in range(world_size):
        name = f"rank_{rank}.pt"
        doc = {"world_size": world_size, "rank": rank, "tensors": per_rank[rank], "objects": objects}
        torch.save(doc, os.path.join(directory, name))
        names.append(name)
    return names


def write_torch_save(path: str, state: Mapping[str, Any]) -> None:
    """One monolithic torch.save file of the full state (the layout dcp_to_torch_save writes)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    torch.save(dict(state), path)


def write_safetensors(directory: str, tensors: Mapping[str, torch.Tensor], *, shards: int = 1) -> list[str]:
    """Flat FQN -> tensor as `model.safetensors`, or `shards` files plus `model.safetensors.index.json`,
    written by the `safetensors` package (the producer users' files come from)."""
    from safetensors.torch import save_file

    os.makedirs(directory, exist_ok=True)
    items = {k: v.contiguous() for k, v in tensors.items()}
    if shards <= 1:
        save_file(items, os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})
        return ["model.safetensors"]
    keys = list(items)
    names = []
    weight_map = {}
    per = -(-len(keys) // shards)
    for i in range(shards):
        name = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {k: items[k] for k in keys[i * per : (i + 1) * per]}
        save_file(part, os.path.join(directory, name), metadata={"format": "pt"})
        weight_map.update({k: name for k in part})
        names.append(name)
    total = sum(v.numel() * v.element_size() for v in items.values())
    with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=1, sort_keys=True)
    return names + ["model.safetensors.index.json"]
