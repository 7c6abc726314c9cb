"""Validated configuration of the model, exposed to gin: what is computed.

* :mod:`~dagmoe_jax.config.model`: ``ModelConfig`` (the decoder and attention's RoPE scaling);
* :mod:`~dagmoe_jax.config.execution`: ``ExecutionConfig``, how the model runs on a machine
  rather than what it computes (a run holds it beside the mesh, ``TrainConfig.execution``,
  and settles it when the run is built);
* :mod:`~dagmoe_jax.config.blocks`: the block families' configs ``ModelConfig.block`` holds:
  dense, MoE (router, experts, aggregation) and Chain-of-Experts;
* :mod:`~dagmoe_jax.config.doe`: the Decoupling-of-Experts family (``DoEConfig``) and its
  Stage 1 topic model (``TopicConfig``).

The data, optimiser, training and mesh configs live with the code they configure
(:mod:`dagmoe_jax.data.config`, :mod:`dagmoe_jax.run.config`, :mod:`dagmoe_jax.parallel.config`).
"""

from dagmoe_jax.budget import dag_params_per_layer, matched_shared_hidden
from dagmoe_jax.config.blocks import (AGGREGATORS, BALANCE_LOADS, BALANCE_PROBS, BLOCK_CONFIGS,
                                      BLOCK_TYPES, COE_READINGS, COE_RESIDUALS, DAG_EDGES,
                                      DAG_READINGS, DISPATCH_MODES, EDGE_ACTIVATIONS,
                                      RETIRED_DISPATCH, ROUTER_TRAINING_FIELDS, SCORE_FNS,
                                      AggregationConfig, CoEConfig,
                                      DenseConfig, ExpertConfig, MoEConfig, RouterConfig,
                                      aggregation_of, block_summary, dag_aggregation_of,
                                      default_ffn_hidden,
                                      experts_of, nested_configs, router_of)
from dagmoe_jax.config.doe import (DOE_GATES, DOE_SIGNALS, DOE_VAE_SHARING, DOE_EXPERTS,
                                   DOE_KNOWLEDGE_SCALES, DOE_FIRST_INPUTS, DoEConfig, TopicConfig)
from dagmoe_jax.config.execution import (ATTENTION_IMPLS, EXPERT_EXCHANGES, GROUPED_MATMULS,
                                         REMAT_POLICIES, ExecutionConfig)
from dagmoe_jax.config.model import (DTYPES, ROPE_SCALINGS, BlockConfig, ModelConfig,
                                     RopeScalingConfig)

__all__ = ["AGGREGATORS", "ATTENTION_IMPLS", "AggregationConfig", "BALANCE_LOADS",
           "BALANCE_PROBS", "BLOCK_CONFIGS", "BLOCK_TYPES", "BlockConfig", "COE_READINGS",
           "COE_RESIDUALS", "CoEConfig", "DAG_EDGES", "DAG_READINGS", "DISPATCH_MODES",
           "DOE_EXPERTS", "DOE_FIRST_INPUTS", "DOE_GATES", "DOE_KNOWLEDGE_SCALES", "DOE_SIGNALS",
           "DOE_VAE_SHARING", "DTYPES", "DenseConfig", "DoEConfig", "EDGE_ACTIVATIONS",
           "EXPERT_EXCHANGES", "ExecutionConfig", "ExpertConfig", "GROUPED_MATMULS",
           "ModelConfig", "MoEConfig", "REMAT_POLICIES", "RETIRED_DISPATCH", "ROPE_SCALINGS",
           "ROUTER_TRAINING_FIELDS",
           "RopeScalingConfig", "RouterConfig", "SCORE_FNS", "TopicConfig",
           "aggregation_of", "block_summary", "dag_aggregation_of", "dag_params_per_layer",
           "default_ffn_hidden",
           "experts_of", "matched_shared_hidden", "nested_configs", "router_of"]
