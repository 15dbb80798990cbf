"""Weights in 2 MB pages: the arrays of a parameter tree packed into one memory mapping that
Linux backs with transparent huge pages, and used there by jax in place (CPU).

A batch-1 decode step reads every weight once, in runs of a few MB per kernel call. XLA:CPU
allocates each buffer in 4 KB pages (transparent huge pages are "madvise" on most
distributions, and XLA does not advise them), so the read takes a TLB miss every 4 KB and
the hardware prefetchers stop at every page boundary. Packed into one 2 MB-aligned mapping
advised with `madvise(MADV_HUGEPAGE)` before it is written, the same weights are read in
2 MB pages, one after another in the order the step reads them (the tree's order: layer by
layer). `gpt-jax bench huge_pages` measures the step both ways (benchmarks/README.md,
"Packed weights and spinning helpers"). The mechanism: the Linux kernel's documentation,
Documentation/admin-guide/mm/transhuge.rst (`madvise` mode, `MADV_HUGEPAGE`).
"""

from __future__ import annotations

import mmap

import jax
import numpy as np

HUGE_PAGE = 2 << 20  # bytes of an x86-64 / arm64 transparent huge page
ALIGN = 64  # bytes: each array starts on a cache line (jax aliases 64-byte-aligned arrays)


def pack(tree):
    """`tree` with its arrays copied into one anonymous mapping advised into transparent huge
    pages, as jax arrays that use it in place: the same values, dtypes, shapes and tree
    structure, each array 64-byte aligned, the first at a 2 MB boundary, in tree order.
    The mapping lives as long as any of the arrays (they hold it).

    Returns `tree` unchanged where it is packed already (its arrays laid out as `pack` lays
    them out) or where packing does not apply: an array on a device other than
    one CPU device (a GPU, TPU, or a sharded array), a platform without `MADV_HUGEPAGE`
    (only Linux has it), or a jax that copies a host array instead of aliasing it. Where
    the kernel grants no huge pages (`transparent_hugepage/enabled` set to "never") the
    arrays are still packed, in 4 KB pages.
    """
    leaves, treedef = jax.tree.flatten(tree)
    if not leaves or not hasattr(mmap, "MADV_HUGEPAGE") or not all(
            isinstance(leaf, jax.Array) and _on_one_cpu(leaf) for leaf in leaves):
        return tree
    sizes = [-(-leaf.nbytes // ALIGN) * ALIGN for leaf in leaves]
    if _packed(leaves, sizes):
        return tree
    total = -(-sum(sizes) // HUGE_PAGE) * HUGE_PAGE
    region = mmap.mmap(-1, total + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    start = np.frombuffer(region, np.uint8).ctypes.data
    offset = -start % HUGE_PAGE
    region.madvise(mmap.MADV_HUGEPAGE, offset, total)  # before any page is touched
    packed = []
    for leaf, size in zip(leaves, sizes):
        view = np.frombuffer(region, leaf.dtype, leaf.size, offset).reshape(leaf.shape)
        view[...] = np.asarray(leaf)
        view.flags.writeable = False
        # Committed as the original was: an uncommitted array may join a mesh or a program
        # on another device, and jit's cache tells committed arguments from uncommitted ones.
        array = jax.device_put(view, *leaf.devices()) if leaf.committed else jax.device_put(view)
        if leaf.size and array.unsafe_buffer_pointer() != view.ctypes.data:
            return tree  # copied, not aliased: the region would only cost memory
        packed.append(array)
        offset += size
    return jax.tree.unflatten(treedef, packed)


def _on_one_cpu(leaf: jax.Array) -> bool:
    devices = leaf.devices()
    return len(devices) == 1 and next(iter(devices)).platform == "cpu"


def _packed(leaves: list[jax.Array], sizes: list[int]) -> bool:
    """Whether `leaves` lie as `pack` lays them out: from a 2 MB boundary, one after another."""
    address = leaves[0].unsafe_buffer_pointer()
    if address % HUGE_PAGE:
        return False
    for leaf, size in zip(leaves, sizes):
        if leaf.size and leaf.unsafe_buffer_pointer() != address:
            return False
        address += size
    return True
