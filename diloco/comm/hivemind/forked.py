"""What a process forked from a worker gives back of the worker's memory.

hivemind runs its DHT node and its averager in processes forked from the worker, after the model
and the global params exist. A fork shares the parent's pages copy-on-write, and every page the
worker writes afterwards (each inner step writes the params, each outer step the global copy) is
copied for the worker, leaving the old page to the child alone: within a few steps each such
child holds a dead copy of the worker's tensors, which it never reads. Called first thing in the
child, ``release_inherited_tensors`` tells the kernel to drop its pages of every large CPU tensor
it inherited (``madvise(MADV_DONTNEED)``: the child's view of them becomes zeros; the parent's is
untouched), except the shared-memory ones it works on.
"""

from __future__ import annotations

import ctypes
import gc
import logging
import mmap
import sys
import warnings

import torch

logger = logging.getLogger(__name__)

MADV_DONTNEED = 4
SMALLEST_BYTES = 1 << 20  # smaller tensors are left alone: not worth a system call


def release_inherited_tensors() -> int:
    """``_release_inherited_tensors``, never failing the child: 0 when it could not (logged)."""
    try:
        return _release_inherited_tensors()
    except Exception:  # an object that will not say what it is: the child runs on, holding its pages
        logger.warning("could not release the memory inherited from the worker", exc_info=True)
        return 0


def _release_inherited_tensors() -> int:
    """In a forked child: drop its copy of every CPU tensor of at least ``SMALLEST_BYTES`` that is
    not in shared memory (whole pages inside each; never the allocator's bookkeeping around them).
    The child must not read those tensors afterwards. Returns the bytes released (0 off Linux)."""
    if sys.platform != "linux":
        return 0
    madvise = ctypes.CDLL(None, use_errno=True).madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    page, seen, released = mmap.PAGESIZE, set(), 0
    with warnings.catch_warnings():  # isinstance on every object wakes deprecated module attributes
        warnings.simplefilter("ignore")
        tensors = [obj for obj in gc.get_objects() if isinstance(obj, torch.Tensor)]
    for obj in tensors:
        if obj.device.type != "cpu" or obj.is_sparse:
            continue
        try:
            storage = obj.untyped_storage()
        except Exception:  # no storage of its own (a tensor subclass, a wrapper)
            continue
        if storage.is_shared() or storage.nbytes() < SMALLEST_BYTES or storage.data_ptr() in seen:
            continue
        seen.add(storage.data_ptr())
        start = -(-storage.data_ptr() // page) * page
        end = (storage.data_ptr() + storage.nbytes()) // page * page
        if end > start and madvise(start, end - start, MADV_DONTNEED) == 0:
            released += end - start
    return released
