"""A CPU stand-in for "this code makes no device-to-host sync": fail on every op that would need one.

On a GPU, reading a device value on the host (``.item()``, ``float(t)``, ``bool(t)``, ``.tolist()``,
``torch.equal``, ``nonzero``, boolean-mask indexing, ``unique``, ``repeat_interleave`` with tensor
repeats...) blocks the CPU until the GPU's queue has drained. On CPU nothing blocks, so the tests run
the code under :class:`HostSyncGuard`, which raises at each such op while it is armed. Ops on tensors
that live on the host by design (index lists built from Python ints) are not device reads and are
not flagged when they are plain Python (the guard sees only tensor ops, and ``tolist`` on tensors).
"""

from __future__ import annotations

import contextlib
import traceback
from collections.abc import Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# Ops whose result (or output shape) depends on tensor values that the host must see.
SYNC_OPS = {
    "aten::_local_scalar_dense",
    "aten::item",
    "aten::equal",
    "aten::is_nonzero",
    "aten::nonzero",
    "aten::nonzero_static",
    "aten::masked_select",
    "aten::_unique2",
    "aten::unique_dim",
    "aten::unique_consecutive",
    "aten::repeat_interleave.Tensor",
    "aten::bincount",
}


class HostSyncError(AssertionError):
    pass


class HostSyncGuard(TorchDispatchMode):
    """Raise :class:`HostSyncError` on an op in :data:`SYNC_OPS` (or ``Tensor.tolist``) while armed."""

    def __init__(self) -> None:
        super().__init__()
        self.armed = False
        self.seen: list[str] = []

    def _flag(self, what: str) -> None:
        where = "".join(traceback.format_stack(limit=12)[:-2])
        raise HostSyncError(f"host sync inside the guarded region: {what}\n{where}")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name + (f".{func._overloadname}" if func._overloadname != "default" else "")
        if self.armed and (func._schema.name in SYNC_OPS or name in SYNC_OPS):
            self._flag(name)
        return func(*args, **(kwargs or {}))

    @contextlib.contextmanager
    def region(self) -> Iterator[None]:
        """Arm the guard for a block (nested inside ``with guard:``)."""
        previous, self.armed = self.armed, True
        try:
            yield
        finally:
            self.armed = previous


@contextlib.contextmanager
def no_tolist(guard: HostSyncGuard) -> Iterator[None]:
    """Also flag ``Tensor.tolist`` (it reads the data without dispatching an op) while ``guard`` is armed."""
    original = torch.Tensor.tolist

    def tolist(self):
        if guard.armed:
            guard._flag("Tensor.tolist")
        return original(self)

    torch.Tensor.tolist = tolist
    try:
        yield
    finally:
        torch.Tensor.tolist = original
