"""Validated configuration of the model, exposed to gin: what is computed.

* :mod:`~dagmoe_jax.config.model`: ``ModelConfig`` (the decoder and attention's RoPE scaling);
* :mod:`~dagmoe_jax.config.execution`: ``ExecutionConfig``, how the model runs on a machine
  rather than what it computes (a run holds it beside the mesh, ``RunConfig.execution``,
  and settles it when the run is built);
* :mod:`~dagmoe_jax.config.families`: the block families' registry; each family's config
  (``ModelConfig.block`` holds one) is in its package, ``dagmoe_jax.families.<kind>.config``:
  dense, MoE (with its aggregation: DAG-MoE), Chain-of-Experts and Decoupling of Experts
  (with its Stage 1 topic model, ``TopicConfig``), found through the registry
  (:func:`family_of`), never imported here: the families stand above the core;
* :mod:`~dagmoe_jax.config.blocks`: what the families share (the router's and the experts'
  configs) and the questions a layer asks of any family's config.

The data, optimiser, training and mesh configs live with the code they configure
(:mod:`dagmoe_jax.data.config`, :mod:`dagmoe_jax.run.config`, :mod:`dagmoe_jax.parallel.config`).
"""

from dagmoe_jax.config.blocks import (BALANCE_LOADS, BALANCE_PROBS, DISPATCH_MODES,
                                      RETIRED_DISPATCH, ROUTER_TRAINING_FIELDS, SCORE_FNS,
                                      ExpertConfig, RouterConfig, aggregation_of, block_summary,
                                      dag_aggregation_of, default_ffn_hidden, experts_of,
                                      nested_configs, router_of, routing_steps)
from dagmoe_jax.config.execution import (ATTENTION_IMPLS, EXPERT_EXCHANGES, GROUPED_MATMULS,
                                         REMAT_POLICIES, ExecutionConfig)
from dagmoe_jax.config.families import FAMILIES, KINDS, Family, all_families, family_of
from dagmoe_jax.config.model import (BLOCK_TYPES, DTYPES, ROPE_SCALINGS, BlockConfig,
                                     MLAConfig, MTPConfig, ModelConfig, RopeScalingConfig)

__all__ = ["ATTENTION_IMPLS", "BALANCE_LOADS", "BALANCE_PROBS", "BLOCK_TYPES", "BlockConfig",
           "DISPATCH_MODES", "DTYPES", "EXPERT_EXCHANGES", "ExecutionConfig", "ExpertConfig",
           "FAMILIES", "Family", "GROUPED_MATMULS", "KINDS", "MLAConfig", "MTPConfig",
           "ModelConfig", "REMAT_POLICIES", "RETIRED_DISPATCH", "ROPE_SCALINGS",
           "ROUTER_TRAINING_FIELDS", "RopeScalingConfig", "RouterConfig", "SCORE_FNS",
           "aggregation_of", "all_families", "block_summary", "dag_aggregation_of",
           "default_ffn_hidden", "experts_of", "family_of", "nested_configs", "router_of",
           "routing_steps"]
