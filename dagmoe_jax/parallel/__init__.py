"""Running the model on a device mesh (docs/design.md section 8).

* :mod:`~dagmoe_jax.parallel.axes`: logical axis names, the rules mapping them onto the mesh
  ``data, fsdp, expert, tensor`` (:data:`DEFAULT_RULES`) and activation constraints.
* :mod:`~dagmoe_jax.parallel.mesh`: :class:`MeshConfig`, :func:`make_mesh`, :func:`activate`.
* :mod:`~dagmoe_jax.parallel.state`: parameters and optimizer state created sharded
  (:func:`create_sharded`, :func:`create_train_state`), moved onto the mesh
  (:func:`place_on_mesh`), and global batches (:func:`shard_batch`).
* :mod:`~dagmoe_jax.parallel.expert`: expert-parallel token dispatch (``shard_map`` +
  all-to-all), used by the MoE layers automatically under :func:`activate`.
"""

from dagmoe_jax.parallel.axes import DEFAULT_RULES, MESH_AXES, constrain, logical_to_spec
from dagmoe_jax.parallel.mesh import MeshConfig, activate, make_mesh, parallel_active
from dagmoe_jax.parallel.state import (batch_sharding, create_sharded, create_train_state,
                                       place_on_mesh, shard_batch, state_specs, variable_spec)

__all__ = ["DEFAULT_RULES", "MESH_AXES", "MeshConfig", "activate", "batch_sharding", "constrain",
           "create_sharded", "create_train_state", "logical_to_spec", "make_mesh",
           "parallel_active", "place_on_mesh", "shard_batch", "state_specs", "variable_spec"]
