"""Host memory for staging: page-locking (pinning) a shared-memory range for fast device-to-host
copies, and a DTensor over a staged local tensor (process-mode async saves, `ckptlib.saving.staging_arena`).

Pinning registers existing memory with CUDA (`cudaHostRegister`, as DCP's own stager does
through `torch.cuda._pin_memory_utils`), so the staging copy of a GPU tensor lands straight in
the shared memory the writer process reads. Without CUDA nothing is pinned.
"""

from __future__ import annotations

from typing import Any

import torch

_PORTABLE = 1  # cudaHostRegisterPortable


def can_pin() -> bool:
    """Whether host memory can be pinned here (CUDA present and initialised on demand)."""
    return bool(torch.cuda.is_available())


def pin(address: int, nbytes: int) -> bool:
    """Page-lock [address, address + nbytes) for CUDA copies; False when there is no CUDA or
    the registration failed (the memory then stays usable, only the copies are slower)."""
    if not can_pin() or nbytes <= 0:
        return False
    utils = getattr(torch.cuda, "_pin_memory_utils", None)
    try:
        if utils is not None:
            utils.pin_memory(address, nbytes)
            return True
        return int(torch.cuda.cudart().cudaHostRegister(address, nbytes, _PORTABLE)) == 0
    except (RuntimeError, AttributeError):
        return False


def unpin(address: int) -> None:
    """Undo `pin` (before the memory is unmapped)."""
    utils = getattr(torch.cuda, "_pin_memory_utils", None)
    try:
        if utils is not None:
            utils.unpin_memory(address)
        else:
            torch.cuda.cudart().cudaHostUnregister(address)
    except (RuntimeError, AssertionError, AttributeError):
        pass


def dtensor_over(local: torch.Tensor, like: Any) -> Any:
    """A DTensor with `like`'s mesh, placements and global shape whose local tensor is `local`
    (a CPU copy of `like`'s local tensor), without moving `local` to the mesh's device: what
    `like.to("cpu")` returns, but over memory the caller chose (`DTensor.from_local` would copy
    it back to a GPU mesh's device)."""
    return type(like)(local, like._spec, requires_grad=False)
