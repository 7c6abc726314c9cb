"""dagmoe_jax: DAG-MoE and related Mixture-of-Experts language models in JAX / Flax NNX."""

from dagmoe_jax.platform import cpu_where_no_accelerator

cpu_where_no_accelerator()        # before JAX loads: no accelerator plugin starts on a CPU host

from dagmoe_jax.config import ExpertConfig, ModelConfig, RouterConfig
from dagmoe_jax.families.moe.config import AggregationConfig
from dagmoe_jax.families.coe.config import CoEConfig
from dagmoe_jax.families.doe.config import DoEConfig

__version__ = "0.1.0"

__all__ = ["AggregationConfig", "CoEConfig", "DoEConfig", "ExpertConfig", "ModelConfig",
           "RouterConfig", "__version__"]
