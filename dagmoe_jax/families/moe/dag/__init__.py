"""The DAG learning module of DAG-MoE (eq. 6-12), the library's namesake, in three parts:

* :mod:`~dagmoe_jax.families.moe.dag.equations`: each equation as a pure function of arrays;
* :mod:`~dagmoe_jax.families.moe.dag.execution`: how its LayerNorm, projections and pair sums run,
  one strategy per ``ExecutionConfig.dag_module`` (XLA on rows, XLA on rank-3 node arrays,
  the CPU kernels), chosen once when the module is built;
* :mod:`~dagmoe_jax.families.moe.dag.module`: the iteration composed from both, its stacked
  parameters and the scanned loop (:class:`DAGAggregator`, the MoE block's ``dag``
  aggregation).
"""

from dagmoe_jax.families.moe.config import edge_mask
from dagmoe_jax.families.moe.dag.equations import (dag_block_output, dag_initial_nodes,
                                                   dag_pair_messages, dag_pair_weights, dag_readout,
                                                   layer_norm)
from dagmoe_jax.families.moe.dag.execution import DAG_EXECUTIONS, dag_execution
from dagmoe_jax.families.moe.dag.module import (DAGAggregator, DAGIteration, dag_iteration,
                                                dag_node_update, dag_summed_update)

__all__ = ["DAGAggregator", "DAGIteration", "DAG_EXECUTIONS", "dag_block_output",
           "dag_execution", "dag_initial_nodes", "dag_iteration", "dag_node_update",
           "dag_pair_messages", "dag_pair_weights", "dag_readout", "dag_summed_update",
           "edge_mask", "layer_norm"]
