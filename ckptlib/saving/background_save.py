"""Asynchronous saves: stage the state to CPU memory, write and commit in a background thread.

`ckptlib.async_save(uri, state)` returns an `AsyncSave` once the state is staged; the
caller may then change the state (a training step) without affecting what is saved.

Collectives: the background thread never touches the caller's process group. Its
collectives (DCP's plan exchange, the gather of file records, rank 0's commit decision)
run on a dedicated gloo group, created collectively and lazily by the first async save of a
group, so they never interleave with the training's collectives on the default group. The
group belongs to its world: after `destroy_process_group()` and `init_process_group()` the
first async save makes the new world's (`_runtime.world`).
Because that group orders its collectives, at most one async save per group is in flight:
a new save first waits for the previous one (and re-raises its failure, if it failed and
nobody waited for it: a failure is reported once, by whichever of `wait()`, `result()`, the
next save, or the manager's `wait()`/`save()`/`gc()`/`close()` sees it first; the call that
sees it raises it and does nothing else, the next call proceeds).

Failures: a failed background save never writes the manifest, so it never becomes a
committed checkpoint; its error is raised by `wait()` / `result()` on every rank. Errors in
the arguments or the state are raised by `async_save()` itself; the target is prepared (debris
removed, pending marker written and fsynced) in the background, before any shard is
written, so a CheckpointExistsError comes from `wait()`.

Exit: an atexit handler waits for every save still in flight, so a process that ends
without `wait()` still commits its last checkpoint; then the ranks of every group that
saved asynchronously pass a store-based exit barrier (up to 60 s), so no rank exits while
a peer still reads the background's last collective (gloo would abort that peer). Call `wait()` before
`destroy_process_group()`: the background needs the group until the commit.

Background staging (`background_staging=True`): `async_save()` returns right after its checks;
the background first copies the state (then agrees on the dedicated group that every rank
did), and `wait_staged()` returns once it has. Nothing may change the state before that:
no optimizer step, and no training-mode forward pass that updates buffers (BatchNorm's
running statistics). Without such buffers, calling `wait_staged()` right before
`optimizer.step()` lets the device-to-host copy overlap forward and backward on a GPU.

Memory: the staging copy (about one state per rank) is kept and reused by the next async
save of a state with the same tensor shapes, so steady-state saves copy into memory that is
already mapped (no page faults); `release_staging()` frees it. Tied tensors (two keys, one
memory: `lm_head.weight` is `embed.weight`) are copied once and stay tied in the copy, so an
async save stores them once, byte for byte the checkpoint `save` writes. With
`AsyncMode(max_staging_bytes=N)` nothing is copied up front: the tensors are copied in pieces of
at most N as they are written (`capped_staging`).
"""

from __future__ import annotations

import atexit
import copy
import threading
import time
import weakref
from typing import Any, Callable

import torch
import torch.distributed as dist

from ckptlib._runtime import agree as _dist
from ckptlib._runtime import world
from ckptlib._runtime.teardown import exit_barrier
from ckptlib.errors import CheckpointError
from ckptlib.format.native.aliases import alias_key
from ckptlib.saving import capped_staging, writer_process

__all__ = ["AsyncSave", "release_pools", "release_staging"]

_lock = threading.Lock()
_groups: dict[Any, Any] = {}  # caller's group (None: default) -> dedicated gloo group
_inflight: dict[Any, "AsyncSave"] = {}  # caller's group -> the save in flight on it
_staging: dict[Any, "StagingPool"] = {}  # (caller's group, shared) -> staged buffers by key path
_all: "weakref.WeakSet[AsyncSave]" = weakref.WeakSet()


def _forget_world() -> None:
    """A new world (`_runtime.world`): the dedicated groups of the old one are dead, so the next
    async save of each group makes its own; what was kept for the old world's explicit groups
    (never passed again: the new world's groups are new objects) is freed, except a save's still
    running (it fails on its dead group; `release_staging()` frees that)."""
    with _lock:
        _groups.clear()
        for key in [k for k, h in _inflight.items() if k is not None and h.done()]:
            del _inflight[key]
        busy = {k for k, h in _inflight.items() if not h.done()}
        pools = [_staging.pop(k) for k in list(_staging) if k[0] is not None and k[0] not in busy]
    for pool in pools:
        pool.release_unused(StagingPool())
    capped_staging.release(lambda key: key is not None and key not in busy)


world.on_new_world(_forget_world)


class AsyncSave:
    """Handle of a save running in the background.

    `wait(timeout=None)` and `result()` return the SaveResult once the checkpoint is
    committed, or raise the background failure (on every rank alike). `done()` tells whether
    the background work has finished. `wait_staged(timeout=None)` returns once the state
    has been copied (at once unless the save used `background_staging=True`): from then on
    the caller may change it. `blocking_seconds` is how long `save()` blocked the caller;
    `staged_seconds` how long after the call the copy was done; `seconds` the whole save.
    """

    def __init__(
        self, uri: str, work: Callable[[], Any], *, blocking_seconds: float = 0.0, started: float, staged: bool = True
    ):
        self.uri = uri
        self.blocking_seconds = blocking_seconds
        self.staged_seconds: float | None = blocking_seconds if staged else None
        self.seconds: float | None = None
        self._staged = threading.Event()
        if staged:
            self._staged.set()
        self._started = started
        self._work = work
        self._result: Any = None
        self._error: BaseException | None = None
        self._done = threading.Event()
        self._observed = False
        self._thread = threading.Thread(target=self._run, name="ckptlib-async-save", daemon=True)

    def __repr__(self) -> str:
        state = "failed" if self._error is not None else ("committed" if self._done.is_set() else "in flight")
        return f"AsyncSave({self.uri!r}, {state})"

    def _start(self) -> None:
        _all.add(self)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._result = self._work()
        except BaseException as exc:  # noqa: BLE001 - handed to wait()/result()
            self._error = exc
        finally:
            self._work = None  # drop the staged state dict as soon as it is written
            self.seconds = time.perf_counter() - self._started
            self._done.set()
            self._staged.set()  # wakes wait_staged() after a failure before the copy was done

    def mark_staged(self) -> None:
        """Called by the background work once its copy of the state is complete."""
        self.staged_seconds = time.perf_counter() - self._started
        self._staged.set()

    def wait_staged(self, timeout: float | None = None) -> None:
        """Return once the state is copied (the caller may change it from then on); raises
        the failure of a save that failed before its copy was complete."""
        if not self._staged.wait(timeout):
            raise TimeoutError(f"async save to {self.uri} still copying the state after {timeout} s")
        if self.staged_seconds is None:  # the work ended without completing the copy
            self._observed = True
            raise self._error if self._error is not None else CheckpointError(f"async save to {self.uri} never staged")

    def until_staged(self) -> None:
        """Wait until the copy is complete or the save ended, raising nothing (the failure stays
        for `wait()`): how `async_save` with a staging cap returns once its last piece is copied."""
        self._staged.wait()

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None = None):
        """The SaveResult, once committed; raises the background failure, or TimeoutError."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"async save to {self.uri} still running after {timeout} s")
        self._observed = True
        if self._error is not None:
            raise self._error
        return self._result

    def result(self):
        return self.wait()

    def deliver(self, timeout: float | None = None):
        """Like wait(), but a failure is raised only if nobody has observed it yet (by wait(),
        result(), exception(), wait_staged() or an earlier deliver()); after that, None.
        The manager and the next async save use this, so a failure surfaces exactly once."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"async save to {self.uri} still running after {timeout} s")
        with _lock:
            first, self._observed = not self._observed, True
        if self._error is not None:
            if first:
                raise self._error
            return None
        return self._result

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """The background failure (None on success), without raising it."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"async save to {self.uri} still running after {timeout} s")
        self._observed = True
        return self._error


def _group_key(group) -> Any:
    return None if group is None else group


def async_group(group=None):
    """The dedicated gloo group for background saves of `group` (collective on first use).

    Every rank of `group` is in the async save that calls this, so creating the group here is
    safe; with the default group, `new_group` needs every rank of the world, which it has.
    """
    if not _dist.is_distributed():
        return None
    world.generation()  # a new world: the old one's groups are forgotten first
    key = _group_key(group)
    with _lock:
        found = _groups.get(key)
    if found is not None:
        return found
    if group is None:
        created = dist.new_group(backend="gloo")
    else:
        ranks = dist.get_process_group_ranks(group)
        created = dist.new_group(ranks=ranks, backend="gloo", use_local_synchronization=True)
    with _lock:
        _groups[key] = created
    return created


def wait_inflight(group=None) -> None:
    """Wait for the async save in flight on `group`; re-raise its failure if nobody saw it."""
    with _lock:
        previous = _inflight.get(_group_key(group))
    if previous is None:
        return
    previous._done.wait()
    with _lock:
        if _inflight.get(_group_key(group)) is previous:
            del _inflight[_group_key(group)]
    try:
        previous.deliver()
    except BaseException as exc:
        raise CheckpointError(
            f"the previous async save to {previous.uri} failed and nobody waited for it: {exc}"
        ) from exc


def register(group, handle: AsyncSave) -> None:
    with _lock:
        _inflight[_group_key(group)] = handle
    handle._start()


# --------------------------------------------------------------------------- staging


class StagingPool(dict):
    """Staging buffers by key path, reused by the next save of a tensor of the same shape and
    dtype. Plain memory, or with an `arena` shared memory a writer process maps
    (`staging_arena`); `grow` is how much a new arena segment takes (what is left to allocate)."""

    def __init__(self, arena=None):
        super().__init__()
        self.arena = arena
        self.grow = 0

    def allocate(self, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        if self.arena is None:
            return torch.empty(shape, dtype=dtype)
        buf = self.arena.tensor(shape, dtype, grow=self.grow)
        self.grow = max(0, self.grow - _padded(buf.numel() * buf.element_size()))
        return buf

    def prepare(self, leaves: dict[str, tuple[torch.Size, torch.dtype]]) -> None:
        """Before staging a state whose tensors are `leaves` (key path -> shape, dtype): give
        back the buffers it will not reuse first, so the new ones can take their place, and
        size the growth to what is left to allocate."""
        if self.arena is None:
            return
        for key in [k for k, buf in self.items() if leaves.get(k) != (buf.shape, buf.dtype)]:
            self.arena.release(self.pop(key))
        self.arena.trim()
        self.grow = sum(
            _padded(shape.numel() * dtype.itemsize) for k, (shape, dtype) in leaves.items() if k not in self
        )

    def release_unused(self, used: "StagingPool") -> None:
        """Give back the buffers of this (previous) pool that `used` no longer holds."""
        if self.arena is None:
            return
        for key, buf in self.items():
            if used.get(key) is not buf:
                self.arena.release(buf)
        self.arena.trim()


def _padded(nbytes: int) -> int:
    return -(-nbytes // 64) * 64


def _staged_tensor(key: str, value: torch.Tensor, pool: StagingPool, used: StagingPool):
    """A CPU copy of `value` in a reused buffer when the pool has one of the same shape and dtype."""
    value = value.detach()
    buf = pool.get(key)
    if buf is None or buf.shape != value.shape or buf.dtype != value.dtype or buf.layout != value.layout:
        buf = pool.allocate(value.shape, value.dtype)
    buf.copy_(value)
    used[key] = buf
    return buf


def _stage(obj: Any, path: str, pool: StagingPool, used: StagingPool, memo: dict[tuple, Any]) -> Any:
    """`obj` with every tensor copied (see `stage`); a tensor whose memory an earlier one of the
    state holds (a tied weight: `lm_head.weight` is `embed.weight`) becomes that one's copy, so
    the copies alias as the originals did and the save stores them once (`format.native.aliases`),
    as a synchronous save does."""
    memory = _memory(obj)
    if memory is not None:
        twin = memo.get(memory)
        if twin is not None:
            return twin
        staged = _stage_tensor(obj, path, pool, used)
        memo[memory] = staged
        return staged
    if isinstance(obj, torch.Tensor):
        return _stage_tensor(obj, path, pool, used)
    if isinstance(obj, dict):
        return {k: _stage(v, f"{path}.{k}", pool, used, memo) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_stage(v, f"{path}[{i}]", pool, used, memo) for i, v in enumerate(obj)]
    if isinstance(obj, tuple):
        return tuple(_stage(v, f"{path}[{i}]", pool, used, memo) for i, v in enumerate(obj))
    return copy.deepcopy(obj)  # plain values: a snapshot, so later changes do not leak in


def _memory(obj: Any) -> tuple | None:
    """What makes a tensor the same memory as another (`aliases.alias_key`), for the strided
    tensors and DTensors staging copies; None for anything else."""
    if not isinstance(obj, torch.Tensor):
        return None
    dtensor_cls = _dtensor_cls()
    local = obj.to_local() if dtensor_cls is not None and isinstance(obj, dtensor_cls) else obj
    if local.layout != torch.strided:
        return None
    return alias_key(obj)


def _stage_tensor(obj: torch.Tensor, path: str, pool: StagingPool, used: StagingPool) -> Any:
    dtensor_cls = _dtensor_cls()
    if dtensor_cls is not None and isinstance(obj, dtensor_cls):
        local = obj.to_local()
        if obj.device_mesh.device_type == "cpu":
            staged = _staged_tensor(path, local, pool, used)
            return dtensor_cls.from_local(
                staged, obj.device_mesh, obj.placements, run_check=False, shape=obj.shape, stride=obj.stride()
            )
        if pool.arena is not None and local.layout == torch.strided:  # straight into shared (pinned) memory
            from ckptlib._torch import host_memory

            return host_memory.dtensor_over(_staged_tensor(path, local, pool, used), obj)
        return obj.detach().to("cpu")  # the device-to-host copy is the staging copy
    if obj.layout != torch.strided:
        return obj.detach().to("cpu", copy=True)
    return _staged_tensor(path, obj, pool, used)


def _leaves(obj: Any, path: str, out: dict[str, tuple[torch.Size, torch.dtype]], seen: set | None = None) -> dict:
    """The (shape, dtype) of every tensor `_stage` would copy into a buffer, by its key path
    (a tied tensor once, under its first path, as `_stage` copies it)."""
    seen = set() if seen is None else seen
    dtensor_cls = _dtensor_cls()
    memory = _memory(obj)
    if memory is not None:
        if memory in seen:
            return out
        seen.add(memory)
    if dtensor_cls is not None and isinstance(obj, dtensor_cls):
        obj = obj.to_local()
    if isinstance(obj, torch.Tensor):
        if obj.layout == torch.strided:
            out[path] = (obj.shape, obj.dtype)
    elif isinstance(obj, dict):
        for k, v in obj.items():
            _leaves(v, f"{path}.{k}", out, seen)
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            _leaves(v, f"{path}[{i}]", out, seen)
    return out


def _dtensor_cls():
    from ckptlib._torch import probes

    return probes.dtensor_cls()


def stage(state_dict: dict[str, Any], group=None, arena=None) -> dict[str, Any]:
    """A CPU snapshot of `state_dict` (DTensors stay DTensors over the same mesh), in buffers
    kept for the next save of `group`; in `arena`'s shared memory when one is given."""
    key = (_group_key(group), arena is not None)  # a pool per group and async_mode
    with _lock:
        pool = _staging.pop(key, None)
    if pool is None or pool.arena is not arena:  # first save, or a new writer process: fresh buffers
        if pool is not None:
            pool.release_unused(StagingPool())
        pool = StagingPool(arena)
    used = StagingPool(arena)
    if arena is not None:
        pool.prepare(_leaves(state_dict, "", {}))
    try:
        staged = _stage(state_dict, "", pool, used, {})
    except BaseException:
        used.release_unused(pool)  # what this attempt allocated (and the pool does not hold)
        with _lock:
            _staging[key] = pool
        raise
    pool.release_unused(used)
    with _lock:
        _staging[key] = used
    return staged


def release_pools(group=None) -> None:
    """Free the staging buffers kept for `group`'s next uncapped save (a capped save of the
    group holds nothing else: `capped_staging`)."""
    with _lock:
        pools = [_staging.pop(key) for key in list(_staging) if key[0] == _group_key(group)]
    for pool in pools:
        pool.release_unused(StagingPool())


def release_staging(*, shared_only: bool = False) -> None:
    """Free the staging buffers kept for the next async save (after waiting for saves in
    flight), and stop the writer process of async_mode="process" saves if one runs.
    `shared_only`: only the shared-memory buffers (`CheckpointManager.close()`)."""
    _wait_all()
    with _lock:
        keys = [key for key, pool in _staging.items() if pool.arena is not None or not shared_only]
        pools = [_staging.pop(key) for key in keys]
    for pool in pools:
        pool.release_unused(StagingPool())
    capped_staging.release()
    writer_process.shutdown()


# --------------------------------------------------------------------------- exit


def _wait_all() -> None:
    for handle in list(_all):
        handle._done.wait()


@atexit.register
def _wait_at_exit() -> None:
    pending = [h for h in list(_all) if not h.done()]
    if pending:
        import sys

        print(f"ckptlib: waiting for {len(pending)} async checkpoint save(s) to commit before exit", file=sys.stderr)
        _wait_all()
        for handle in pending:
            if handle._error is not None and not handle._observed:
                print(f"ckptlib: async save to {handle.uri} failed: {handle._error}", file=sys.stderr)
    writer_process.shutdown()  # async_mode="process": its writer exits with it (it would anyway, a moment later)
    if not _dist.is_distributed():
        return
    world.generation()  # only this world's groups meet at the barrier
    # A background save's last collective may still be in flight on a peer: the ranks of
    # every group that saved asynchronously (all of them did: its dedicated group was made
    # collectively) leave together, whether or not their own save was still running.
    for group in list(_groups):
        try:
            ranks = dist.get_process_group_ranks(group) if group is not None else range(dist.get_world_size())
            exit_barrier(timeout_s=60.0, key=f"ckptlib/async_save_exit/{','.join(map(str, ranks))}", group=group)
        except Exception as exc:  # noqa: BLE001 - exiting anyway; say why a peer may complain
            import sys

            print(f"ckptlib: exit barrier after async saves failed: {exc}", file=sys.stderr)
