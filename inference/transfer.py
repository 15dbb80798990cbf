"""Host arrays onto the devices the engine's programs run on, without a program of their own.

`jnp.asarray` of a numpy array outside a trace runs it through a small compiled program
per shape and dtype (`jax.lax.stage`, jax >= 0.10), compiled again in every process (each
takes under a second, so JAX's persistent cache does not keep it): a server's first
requests after a warm start compiled a dozen of them on the request path. `to_device`
copies instead, as `jnp.asarray` would place the result: on the default device, uncommitted;
within `jax.set_mesh`, committed and replicated over the mesh
(`jax.make_array_from_process_local_data`: every process gives the same host array, as
`inference.multihost` mirrors the engine's calls on every host).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P


def to_device(tree):
    """`tree` with each numpy array or scalar a `jax.Array` on the default device, or
    replicated over the mesh of an enclosing `jax.set_mesh`; within a trace (a function
    that jit traces builds them too) `jnp.asarray`, which lifts them into it. Every other
    leaf (jax arrays, Python values, `None`) unchanged."""
    try:
        mesh = jax.sharding.get_mesh()  # a ValueError within a trace
    except ValueError:
        put = jnp.asarray
    else:
        if mesh.empty:
            put = jax.device_put
        else:
            replicated = NamedSharding(mesh, P())
            put = lambda x: jax.make_array_from_process_local_data(replicated, x)  # noqa: E731
    return jax.tree.map(lambda x: put(np.asarray(x)) if isinstance(x, (np.ndarray, np.generic))
                        else x, tree)
