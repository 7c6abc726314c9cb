"""Validated configuration of the model, exposed to gin: what is computed.

* :mod:`~dagmoe_jax.config.model`: ``ModelConfig`` and the configs of its parts (attention's
  RoPE scaling, the MoE block's router, experts and aggregation, Chain-of-Experts) and
  :mod:`~dagmoe_jax.config.execution` ``ExecutionConfig`` (how the model runs on a machine,
  settled when the run is built);
* :mod:`~dagmoe_jax.config.doe`: the Decoupling-of-Experts block (``DoEConfig``) and its
  Stage 1 topic model (``TopicConfig``).

The data, optimiser, training and mesh configs live with the code they configure
(:mod:`dagmoe_jax.data.config`, :mod:`dagmoe_jax.run.config`, :mod:`dagmoe_jax.parallel.config`).
"""

from dagmoe_jax.config.doe import (DOE_GATES, DOE_SIGNALS, DOE_VAE_SHARING, DOE_EXPERTS,
                                   DOE_KNOWLEDGE_SCALES, DOE_FIRST_INPUTS, DoEConfig, TopicConfig)
from dagmoe_jax.config.execution import (ATTENTION_IMPLS, EXPERT_EXCHANGES, GROUPED_MATMULS,
                                         REMAT_POLICIES, ExecutionConfig)
from dagmoe_jax.config.model import (BLOCK_TYPES, SCORE_FNS, DISPATCH_MODES, AGGREGATORS,
                                     EDGE_ACTIVATIONS, DAG_EDGES, DAG_READINGS, COE_RESIDUALS,
                                     COE_READINGS, BALANCE_LOADS, BALANCE_PROBS, DTYPES,
                                     RETIRED_DISPATCH, ROPE_SCALINGS, RouterConfig,
                                     RopeScalingConfig, ExpertConfig, AggregationConfig, CoEConfig,
                                     ModelConfig, nested_configs, execution_fields,
                                     dag_params_per_layer, matched_shared_hidden)

__all__ = ["AGGREGATORS", "ATTENTION_IMPLS", "AggregationConfig", "BALANCE_LOADS",
           "BALANCE_PROBS", "BLOCK_TYPES", "COE_READINGS", "COE_RESIDUALS", "CoEConfig",
           "DAG_EDGES", "DAG_READINGS", "DISPATCH_MODES", "DOE_EXPERTS", "DOE_FIRST_INPUTS",
           "DOE_GATES", "DOE_KNOWLEDGE_SCALES", "DOE_SIGNALS", "DOE_VAE_SHARING", "DTYPES",
           "DoEConfig", "EDGE_ACTIVATIONS", "EXPERT_EXCHANGES", "ExecutionConfig",
           "ExpertConfig", "GROUPED_MATMULS", "ModelConfig", "REMAT_POLICIES",
           "RETIRED_DISPATCH", "ROPE_SCALINGS", "RopeScalingConfig", "RouterConfig",
           "SCORE_FNS", "TopicConfig", "dag_params_per_layer", "execution_fields",
           "matched_shared_hidden", "nested_configs"]
