"""Validated configuration of the model, exposed to gin: what is computed.

* :mod:`~dagmoe_jax.config.model`: ``ModelConfig`` (the decoder and attention's RoPE scaling);
* :mod:`~dagmoe_jax.config.execution`: ``ExecutionConfig``, how the model runs on a machine
  rather than what it computes (a run holds it beside the mesh, ``RunConfig.execution``,
  and settles it when the run is built);
* :mod:`~dagmoe_jax.config.families`: the block families' registry; each family's config
  (``ModelConfig.block`` holds one) is in its package, ``dagmoe_jax.families.<kind>.config``:
  dense, MoE (with its aggregation: DAG-MoE), Chain-of-Experts and Decoupling of Experts
  (with its Stage 1 topic model, ``TopicConfig``), re-exported here;
* :mod:`~dagmoe_jax.config.blocks`: what the families share (the router's and the experts'
  configs) and the questions a layer asks of any family's config.

The data, optimiser, training and mesh configs live with the code they configure
(:mod:`dagmoe_jax.data.config`, :mod:`dagmoe_jax.run.config`, :mod:`dagmoe_jax.parallel.config`).
"""

from dagmoe_jax.budget import dag_params_per_layer, matched_shared_hidden
from dagmoe_jax.config.blocks import (BALANCE_LOADS, BALANCE_PROBS, DISPATCH_MODES,
                                      RETIRED_DISPATCH, ROUTER_TRAINING_FIELDS, SCORE_FNS,
                                      ExpertConfig, RouterConfig, aggregation_of, block_summary,
                                      dag_aggregation_of, default_ffn_hidden, experts_of,
                                      nested_configs, router_of, routing_steps)
from dagmoe_jax.config.execution import (ATTENTION_IMPLS, EXPERT_EXCHANGES, GROUPED_MATMULS,
                                         REMAT_POLICIES, ExecutionConfig)
from dagmoe_jax.config.families import FAMILIES, Family, family_of
from dagmoe_jax.config.model import (BLOCK_CONFIGS, BLOCK_TYPES, DTYPES, ROPE_SCALINGS,
                                     BlockConfig, MLAConfig, MTPConfig, ModelConfig,
                                     RopeScalingConfig)
from dagmoe_jax.families.coe.config import COE_READINGS, COE_RESIDUALS, CoEConfig
from dagmoe_jax.families.dense.config import DenseConfig
from dagmoe_jax.families.doe.config import (DOE_EXPERTS, DOE_FIRST_INPUTS, DOE_GATES,
                                            DOE_KNOWLEDGE_SCALES, DOE_SIGNALS, DOE_VAE_SHARING,
                                            DoEConfig, TopicConfig)
from dagmoe_jax.families.moe.config import (AGGREGATORS, DAG_EDGES, DAG_READINGS,
                                            EDGE_ACTIVATIONS, AggregationConfig, MoEConfig)

__all__ = ["AGGREGATORS", "ATTENTION_IMPLS", "AggregationConfig", "BALANCE_LOADS",
           "BALANCE_PROBS", "BLOCK_CONFIGS", "BLOCK_TYPES", "BlockConfig", "COE_READINGS",
           "COE_RESIDUALS", "CoEConfig", "DAG_EDGES", "DAG_READINGS", "DISPATCH_MODES",
           "DOE_EXPERTS", "DOE_FIRST_INPUTS", "DOE_GATES", "DOE_KNOWLEDGE_SCALES", "DOE_SIGNALS",
           "DOE_VAE_SHARING", "DTYPES", "DenseConfig", "DoEConfig", "EDGE_ACTIVATIONS",
           "EXPERT_EXCHANGES", "ExecutionConfig", "ExpertConfig", "FAMILIES", "Family",
           "GROUPED_MATMULS",
           "ModelConfig", "MoEConfig", "REMAT_POLICIES", "RETIRED_DISPATCH", "ROPE_SCALINGS",
           "ROUTER_TRAINING_FIELDS",
           "MLAConfig", "MTPConfig", "RopeScalingConfig", "RouterConfig", "SCORE_FNS",
           "TopicConfig",
           "aggregation_of", "block_summary", "dag_aggregation_of", "dag_params_per_layer",
           "default_ffn_hidden",
           "experts_of", "family_of", "matched_shared_hidden", "nested_configs", "router_of",
           "routing_steps"]
