"""dagmoe_jax: DAG-MoE and related Mixture-of-Experts language models in JAX / Flax NNX."""

from dagmoe_jax.config import (AggregationConfig, CoEConfig, DoEConfig, ExpertConfig,
                               ModelConfig, RouterConfig)

__version__ = "0.1.0"

__all__ = ["AggregationConfig", "CoEConfig", "DoEConfig", "ExpertConfig", "ModelConfig", "RouterConfig",
           "__version__"]
