"""What one rank spends on the process group and the store, counted: the wrappers of
`ckpt bench scale --ranks` (`ckptlib.bench.scale_ranks`).

- collectives: every call of a `torch.distributed` collective (the package's attributes are
  wrapped, which is where DCP's `_DistWrapper` and ckptlib's `_runtime` call them; a
  collective that torch runs inside another, the size exchange of `gather_object`, is not
  counted again), from any thread of the rank (an async save's background thread included);
- payload bytes this rank sends and receives through them: the pickled size of the objects of
  the object collectives (as torch pickles them), the tensors' bytes of the tensor ones; a
  root's sends are what it hands out, each receiver counts what arrived from the others;
- process groups created (`new_group`, `new_subgroups`, `split_group`);
- store operations: `CountingStore` is a `torch.distributed.Store` that counts every
  operation, by kind, on the store beneath; the rank's default group is created on it, so
  gloo's own rendezvous of every new group and ckptlib's check-ins and heartbeats are counted;
- sockets: the open file descriptors of this process that are sockets (`/proc/self/fd`).

`snapshot()` returns the running totals; an operation's cost is the difference of two.
"""

from __future__ import annotations

import collections
import functools
import os
import pickle
import threading
from typing import Any, Callable

import torch
import torch.distributed as dist

_lock = threading.Lock()
_calls: collections.Counter = collections.Counter()
_bytes = {"sent": 0, "received": 0}
_groups = [0]
_store_ops: collections.Counter = collections.Counter()
_originals: dict[str, Callable] = {}
_alive: list = []  # every CountingStore: one whose Python half is collected answers "Not implemented"

GROUP_MAKERS = ("new_group", "new_subgroups", "new_subgroups_by_enumeration", "split_group")


def _pickled(obj: Any) -> int:
    try:
        return len(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))
    except Exception:  # noqa: BLE001 - torch's pickler could send it; count nothing rather than fail the bench
        return 0


def _nbytes(t: Any) -> int:
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0


def _me(group: Any) -> int:
    return dist.get_rank(group) if group is not None else dist.get_rank()


def _root(kw: dict, name: str, group: Any) -> int:
    """The root's rank in `group` (`group_src`/`group_dst`) or, from `src`/`dst`, globally
    (then compared with the global rank)."""
    if kw.get(f"group_{name}") is not None:
        return kw[f"group_{name}"]
    value = kw.get(name)
    if value is None:
        return 0
    return dist.get_group_rank(group, value) if group is not None else value


def _arg(args: tuple, kw: dict, index: int, name: str) -> Any:
    return args[index] if len(args) > index else kw.get(name)


def _payload(name: str, args: tuple, kw: dict) -> tuple[int, int]:
    """(sent, received) bytes of one finished call."""
    group = kw.get("group")
    if name == "all_gather_object":
        out, obj = _arg(args, kw, 0, "object_list"), _arg(args, kw, 1, "obj")
        me = _me(group)
        return _pickled(obj), sum(_pickled(o) for i, o in enumerate(out or []) if i != me)
    if name == "gather_object":
        obj, out = _arg(args, kw, 0, "obj"), _arg(args, kw, 1, "object_gather_list")
        me = _me(group)
        if me == _root(kw if len(args) < 3 else {**kw, "dst": args[2]}, "dst", group):
            return 0, sum(_pickled(o) for i, o in enumerate(out or []) if i != me)
        return _pickled(obj), 0
    if name == "broadcast_object_list":
        objs = _arg(args, kw, 0, "object_list")
        root = _root(kw if len(args) < 2 else {**kw, "src": args[1]}, "src", group)
        size = sum(_pickled(o) for o in objs or [])
        return (size * max(0, dist.get_world_size(group) - 1), 0) if _me(group) == root else (0, size)
    if name == "scatter_object_list":
        out, ins = _arg(args, kw, 0, "scatter_object_output_list"), _arg(args, kw, 1, "scatter_object_input_list")
        me = _me(group)
        if me == _root(kw if len(args) < 3 else {**kw, "src": args[2]}, "src", group):
            return sum(_pickled(o) for i, o in enumerate(ins or []) if i != me), 0
        return 0, sum(_pickled(o) for o in out or [])
    if name in ("all_reduce", "reduce"):
        size = _nbytes(_arg(args, kw, 0, "tensor"))
        return size, size
    if name == "broadcast":
        size = _nbytes(_arg(args, kw, 0, "tensor"))
        root = _root(kw if len(args) < 2 else {**kw, "src": args[1]}, "src", group)
        return (size * max(0, dist.get_world_size(group) - 1), 0) if _me(group) == root else (0, size)
    if name == "all_gather":
        out, mine = _arg(args, kw, 0, "tensor_list"), _arg(args, kw, 1, "tensor")
        return _nbytes(mine), sum(_nbytes(t) for t in out or []) - _nbytes(mine)
    if name == "all_gather_into_tensor":
        out, mine = _arg(args, kw, 0, "output_tensor"), _arg(args, kw, 1, "input_tensor")
        return _nbytes(mine), _nbytes(out) - _nbytes(mine)
    if name in ("send", "isend"):
        return _nbytes(_arg(args, kw, 0, "tensor")), 0
    if name in ("recv", "irecv"):  # irecv: the buffer's size (what it may receive)
        return 0, _nbytes(_arg(args, kw, 0, "tensor"))
    if name == "all_to_all_single":
        out, ins = _arg(args, kw, 0, "output"), _arg(args, kw, 1, "input")
        return _nbytes(ins), _nbytes(out)
    return 0, 0


COLLECTIVES = (
    "all_gather_object",
    "gather_object",
    "broadcast_object_list",
    "scatter_object_list",
    "all_reduce",
    "reduce",
    "broadcast",
    "all_gather",
    "all_gather_into_tensor",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "gather",
    "scatter",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "monitored_barrier",
    "send",
    "recv",
    "isend",
    "irecv",
    "batch_isend_irecv",
)


def _counting(name: str, original: Callable) -> Callable:
    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        result = original(*args, **kwargs)
        sent, received = _payload(name, args, kwargs)
        with _lock:
            _calls[name] += 1
            _bytes["sent"] += sent
            _bytes["received"] += received
        return result

    return wrapper


def _group_maker(original: Callable) -> Callable:
    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        result = original(*args, **kwargs)
        with _lock:
            _groups[0] += 1
        return result

    return wrapper


def install() -> None:
    """Wrap the collectives and group makers of `torch.distributed` (once per process)."""
    if _originals:
        return
    for name in COLLECTIVES + GROUP_MAKERS:
        original = getattr(dist, name, None)
        if original is None:
            continue
        _originals[name] = original
        setattr(dist, name, _group_maker(original) if name in GROUP_MAKERS else _counting(name, original))


def original(name: str) -> Callable:
    """The unwrapped function (the bench's own barriers are not the operation's)."""
    return _originals.get(name) or getattr(dist, name)


def sockets() -> int:
    """Open file descriptors of this process that are sockets."""
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            count += os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
        except OSError:
            pass
    return count


def snapshot() -> dict[str, Any]:
    """The running totals (and the sockets and threads open now)."""
    with _lock:
        return {
            "collectives": dict(_calls),
            "sent": _bytes["sent"],
            "received": _bytes["received"],
            "groups": _groups[0],
            "store": dict(_store_ops),
            "sockets": sockets(),
            "threads": threading.active_count(),
        }


def difference(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """What happened between two snapshots; sockets and threads: open after, and the change."""

    def counts(key: str) -> dict[str, int]:
        keys = set(before[key]) | set(after[key])
        return {
            k: after[key].get(k, 0) - before[key].get(k, 0)
            for k in sorted(keys)
            if after[key].get(k, 0) != before[key].get(k, 0)
        }

    calls, store = counts("collectives"), counts("store")
    return {
        "collectives": sum(calls.values()),
        "by_collective": calls,
        "sent": after["sent"] - before["sent"],
        "received": after["received"] - before["received"],
        "groups": after["groups"] - before["groups"],
        "store_ops": sum(store.values()),
        "by_store_op": store,
        "sockets": after["sockets"],
        "sockets_added": after["sockets"] - before["sockets"],
        "threads": after["threads"],
        "threads_added": after["threads"] - before["threads"],
    }


class CountingStore(dist.Store):
    """A store that counts every operation on `inner`, by kind."""

    def __init__(self, inner: Any) -> None:
        super().__init__()
        self.inner = inner
        _alive.append(self)  # C++ holds only a store's C++ half (see `clone`)

    def _count(self, kind: str) -> None:
        with _lock:
            _store_ops[kind] += 1

    def set(self, key, value):
        self._count("set")
        return self.inner.set(key, value)

    def get(self, key):
        self._count("get")
        return self.inner.get(key)

    def add(self, key, amount):
        self._count("add")
        return self.inner.add(key, amount)

    def compare_set(self, key, expected, desired):
        self._count("compare_set")
        return self.inner.compare_set(key, expected, desired)

    def check(self, keys):
        self._count("check")
        return self.inner.check(keys)

    def delete_key(self, key):
        self._count("delete_key")
        return self.inner.delete_key(key)

    def num_keys(self):
        self._count("num_keys")
        return self.inner.num_keys()

    def set_timeout(self, timeout):
        return self.inner.set_timeout(timeout)

    def wait(self, keys, timeout=None):
        self._count("wait")
        return self.inner.wait(keys) if timeout is None else self.inner.wait(keys, timeout)

    def multi_get(self, keys):
        self._count("multi_get")
        return self.inner.multi_get(keys)

    def multi_set(self, keys, values):
        self._count("multi_set")
        return self.inner.multi_set(keys, values)

    def append(self, key, value):
        self._count("append")
        return self.inner.append(key, value)

    def has_extended_api(self):
        return self.inner.has_extended_api()

    def list_keys(self):
        self._count("list_keys")
        return self.inner.list_keys()

    def queue_push(self, key, value):
        self._count("queue_push")
        return self.inner.queue_push(key, value)

    def queue_pop(self, key, block=True):
        self._count("queue_pop")
        return self.inner.queue_pop(key, block)

    def queue_len(self, key):
        self._count("queue_len")
        return self.inner.queue_len(key)

    def clone(self):
        """A new connection to the same store (gloo clones it for a group's background work),
        counted like this one."""
        return CountingStore(self.inner.clone())


__all__ = ["CountingStore", "difference", "install", "original", "snapshot", "sockets"]
