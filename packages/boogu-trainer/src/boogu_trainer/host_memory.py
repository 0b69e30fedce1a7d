"""Host memory of a CPU run: keep freed tensor memory in the process instead of faulting it in again.

PyTorch's CPU allocator takes every tensor from ``malloc`` and gives it back on ``free``. glibc's
``malloc`` serves large blocks (above ``M_MMAP_THRESHOLD``, at most 32 MiB with its dynamic rule)
with a fresh ``mmap`` and returns them with ``munmap``, and trims the top of its heap whenever more
than ``M_TRIM_THRESHOLD`` is free. Each denoising step of a CPU rollout allocates and frees hundreds
of activation tensors of a few MiB, so their pages go back to the kernel and are faulted in, zeroed,
4 KiB at a time, by the next step: measured 0.7-1.5 million page faults per rollout of the scenes
task (``scenes_task_config``: 64 images, 10 CFG steps), 14-26% of its CPU time spent in the kernel
(``benchmarks/demo_throughput.py``). :func:`keep_freed_host_memory` raises both thresholds, so
freed blocks stay in the heap: over the first rollouts the heap grows to a step's working set, and
from then on tensors reuse it without a fault. The process's resident memory stays near its peak
instead of shrinking between steps (the demo's peak grew by 1-6%). It changes where tensors
live, not what is computed: results are bitwise the same.
"""

from __future__ import annotations

import ctypes
import logging
import sys

logger = logging.getLogger("boogu_trainer")

__all__ = ["keep_freed_host_memory"]

# glibc's malloc.h parameter numbers for mallopt.
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_MMAP_THRESHOLDS = (1 << 30, 32 << 20)
"""Tried in order: 1 GiB, else glibc's documented maximum on 64-bit systems (32 MiB)."""
_TRIM_THRESHOLD = (1 << 31) - 1
"""The largest value ``mallopt``'s ``int`` takes: keep up to 2 GiB free at the top of the heap."""


def keep_freed_host_memory() -> bool:
    """Set glibc's ``malloc`` to keep freed blocks (see the module docstring); True if it took effect.

    Process-wide and not undone: the trainer's CLI calls it for a CPU run (``model.device=cpu``),
    before the model loads. Elsewhere than glibc on Linux it does nothing and returns False.
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl names its libc differently)
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    if not any(mallopt(_M_MMAP_THRESHOLD, value) == 1 for value in _MMAP_THRESHOLDS):
        logger.warning("keep_freed_host_memory: glibc refused every M_MMAP_THRESHOLD tried")
        return False
    return mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD) == 1
