"""Running the model on a device mesh (docs/design.md section 8).

* :mod:`~dagmoe_jax.parallel.axes`: logical axis names, the rules mapping them onto the mesh
  ``data, fsdp, expert, tensor`` (:data:`DEFAULT_RULES`) and activation constraints.
* :mod:`~dagmoe_jax.parallel.mesh`: :class:`MeshConfig`, :func:`make_mesh`, :func:`activate`.
* :mod:`~dagmoe_jax.parallel.state`: parameters and optimizer state created sharded
  (:func:`create_sharded`, :func:`create_train_state`), moved onto the mesh
  (:func:`place_on_mesh`), and global batches (:func:`shard_batch`).
* :mod:`~dagmoe_jax.parallel.multihost`: multi-process start-up (:func:`initialize` of
  ``jax.distributed`` from flags, the environment or the cluster).

Expert-parallel token dispatch (``shard_map`` + all-to-all) is the model's own,
:mod:`dagmoe_jax.model.routed.expert_parallel`: the experts run it when the model was built with a
mesh layout (:class:`~dagmoe_jax.parallel.axes.MeshLayout`).
"""

from dagmoe_jax.parallel.axes import (DEFAULT_RULES, MESH_AXES, constrain, logical_to_spec,
                                      replicated)
from dagmoe_jax.parallel.config import MeshConfig
from dagmoe_jax.parallel.mesh import activate, make_mesh, parallel_active
from dagmoe_jax.parallel.state import (batch_sharding, create_sharded, create_train_state,
                                       place_on_mesh, shard_batch, state_specs, variable_spec)

__all__ = ["DEFAULT_RULES", "MESH_AXES", "MeshConfig", "activate", "batch_sharding", "constrain",
           "create_sharded", "create_train_state", "logical_to_spec", "make_mesh",
           "parallel_active", "place_on_mesh", "replicated", "shard_batch", "state_specs",
           "variable_spec"]
