"""Data-parallel and sharded training on a `jax.sharding.Mesh`.

One mesh axis, `"data"`, spans the devices (all of them, across hosts after
`jax.distributed.initialize`; see training/README.md). The batch is split along it with a
`NamedSharding`; parameters and optimizer state are either replicated (plain data
parallelism) or, with `shard_params`, each array is split along its first axis whose size the
device count divides (ZeRO-3/FSDP style: every device holds 1/n of the weights and XLA's
GSPMD partitioner inserts the all-gathers and reduce-scatters). The jitted step is the same
program either way; only the shardings of its inputs and outputs change.

On the CPU backend one host can be split into several XLA devices (`split_host_cpu`, which
the training command line applies from `TrainConfig.cpu_devices` before JAX starts): XLA:CPU
runs one program's ops largely one after another, so on a 2-core machine two half-batch
programs, one per device, keep both cores busy where one program keeps about one.

Usage (4 CPU devices):
  python -m training.train --cpu-devices 4 --devices 4
"""

from __future__ import annotations

import os

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

DATA = "data"  # the mesh axis the batch (and, optionally, the parameters) are split along


def host_cores() -> int:
    """CPU cores this process may run on (its affinity mask where the OS has one)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def split_host_cpu(n_devices: int) -> None:
    """Expose the host CPU to XLA as `n_devices` devices (`jax_num_cpu_devices`), so a
    data-parallel mesh over them runs one program per core. Only the CPU backend is affected;
    accelerators are listed as before.

    Raises:
      ValueError: `n_devices` < 1.
      RuntimeError: JAX has already run an operation (the device count is fixed when JAX's
        backends start, so call this first).
    """
    if n_devices < 1:
        raise ValueError(f"n_devices must be >= 1, got {n_devices}")
    jax.config.update("jax_num_cpu_devices", n_devices)


def make_mesh(n_devices: int = 0) -> Mesh:
    """A 1-D mesh over the first `n_devices` devices (0 = all).

    Raises:
      ValueError: more devices asked for than exist.
    """
    devices = jax.devices()
    n = n_devices or len(devices)
    if not 1 <= n <= len(devices):
        raise ValueError(f"devices={n_devices} must be in [0, {len(devices)}] (0 = all); "
                         f"this process sees {len(devices)}: {devices}")
    return Mesh(np.array(devices[:n]), (DATA,))


def batch_sharding(mesh: Mesh, ndim: int = 2, batch_axis: int = 0) -> NamedSharding:
    """Split axis `batch_axis` of an `ndim`-dimensional batch over the mesh."""
    spec = [None] * ndim
    spec[batch_axis] = DATA
    return NamedSharding(mesh, P(*spec))


def array_sharding(shape: tuple[int, ...], mesh: Mesh, shard: bool) -> NamedSharding:
    """Replicated, or (with `shard`) split along the first axis the mesh size divides; arrays
    with no such axis (scalars, small vectors) stay replicated."""
    n = mesh.devices.size
    if shard:
        for axis, size in enumerate(shape):
            if size % n == 0 and size >= n:
                spec = [None] * len(shape)
                spec[axis] = DATA
                return NamedSharding(mesh, P(*spec))
    return NamedSharding(mesh, P())


def tree_shardings(tree, mesh: Mesh, shard: bool):
    """The `array_sharding` of every leaf of a pytree (params or optimizer state)."""
    return jax.tree.map(lambda x: array_sharding(np.shape(x), mesh, shard), tree)


def put_tree(tree, mesh: Mesh, shard: bool):
    """Place a pytree on the mesh, replicated or sharded (see `array_sharding`)."""
    return jax.device_put(tree, tree_shardings(tree, mesh, shard))


def put_batch(batch: np.ndarray, mesh: Mesh, batch_axis: int = 0) -> jax.Array:
    """A global batch, computed identically by every process, as one array split over the
    mesh: each process supplies only the shards its own devices hold.

    Raises:
      ValueError: the batch axis is not divisible by the number of devices.
    """
    n = mesh.devices.size
    if batch.shape[batch_axis] % n:
        raise ValueError(f"batch size {batch.shape[batch_axis]} must be divisible by the "
                         f"{n} devices of the mesh")
    return put_host(batch, batch_sharding(mesh, batch.ndim, batch_axis))


def put_host(array, sharding: NamedSharding) -> jax.Array:
    """An array that every process holds alike, as one array with `sharding`: each process
    copies in only the shards its own devices hold (no cross-process check, unlike
    `jax.device_put` onto a mesh that spans processes)."""
    host = np.asarray(array)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])
