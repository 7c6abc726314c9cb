"""MoErging Hugging Face checkpoints one tensor at a time (DUME sec. 2.2 at the paper's scale).

:func:`dagmoe_jax.upcycle.moerge.moerge` takes N dense models already in memory, copies them to
float32 NumPy and stacks the experts before writing the MoE: about three times the experts'
size at once. :func:`moerge_hf` builds the MoE abstractly
(``nnx.eval_shape``) and fills it from the N checkpoints' safetensors, one parameter at a time:
a shared parameter is a float64 running sum over the models (one model's tensor read at a
time), then its mean placed; an expert weight [layers, N, ...] starts as zeros on the device
and model j's slice is written in place (a donated jitted update). The host then holds the
merged model plus one parameter's float64 sum and one model's tensor. A ``cfg`` with
``param_dtype='bfloat16'`` holds the merged model in bfloat16 (the means still float64, then
rounded). ``benchmarks/merge_memory.py`` measures the whole upcycling command around it.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dagmoe_jax.config import ExecutionConfig, ModelConfig
from dagmoe_jax.model import Transformer
from dagmoe_jax.hf import llama as hf_llama
from dagmoe_jax.model.params import set_params, variable
from dagmoe_jax.upcycle.moerge import (EXPERT_PREFIX, MLP_PREFIX, check_dume_config,
                                       check_same_architecture)

PathLike = Union[str, Path]


@functools.partial(jax.jit, donate_argnums=0)
def _place_expert(stacked: jax.Array, j: jax.Array, value: jax.Array) -> jax.Array:
    """``stacked`` [layers, N, ...] with expert ``j``'s slice set to ``value`` [layers, ...]."""
    return stacked.at[:, j].set(value.astype(stacked.dtype))


def read_configs(paths: Sequence[PathLike]) -> ModelConfig:
    """The dense model config shared by the Hugging Face checkpoints ``paths``; a
    one-line error naming the first field that differs."""
    cfgs = [hf_llama.model_config_from_hf(hf_llama.read_hf_config(p)) for p in paths]
    check_same_architecture(cfgs, [str(p) for p in paths])
    return cfgs[0]


def moerge_hf(paths: Sequence[PathLike], cfg: ModelConfig, *, execution: ExecutionConfig,
              seed: int = 0) -> nnx.Module:
    """The MoE ``cfg`` (a :func:`~dagmoe_jax.upcycle.moerge.dume_config` of the checkpoints'
    config, one expert per path; run as ``execution``, settled for it) merged from Hugging
    Face Llama directories ``paths`` without loading any of them whole: every non-MLP
    parameter the float64 mean of the N models' (DUME eq. 4's shared weights), layer l's MLP
    of model j expert j. The routers
    are drawn from ``seed`` (normal, ``init_std``; bias zero) until DUME sets them. Equals
    ``moerge`` of the loaded models in every merged parameter (tests/test_upcycle_stream.py)."""
    check_dume_config(cfg)
    if cfg.block.experts.num_experts != len(paths):
        raise ValueError(f"ExpertConfig.num_experts={cfg.block.experts.num_experts} but "
                         f"{len(paths)} checkpoints were given: one expert per model")
    dense = read_configs(paths)
    readers, tied = [], []
    for p in paths:
        reader = hf_llama.SafetensorsReader(p)
        hf = hf_llama.read_hf_config(p)
        tied.append(bool(hf.get("tie_word_embeddings", False)) and "lm_head.weight" not in reader)
        readers.append(reader)
    model = nnx.eval_shape(lambda: Transformer(cfg, execution=execution, rngs=nnx.Rngs(seed)))
    streams = [hf_llama.hf_tensors_to_params(dense, r.__getitem__, t)
               for r, t in zip(readers, tied)]
    while True:
        first = next(streams[0], None)
        if first is None:
            break
        path, value = first
        if path[:-1] == MLP_PREFIX:
            target = EXPERT_PREFIX + path[-1:]
            node = variable(model, target)
            stacked = jnp.zeros(node.shape, node.dtype)
            for j, stream in enumerate(streams):
                if j:
                    value = next(stream)[1]
                stacked = _place_expert(stacked, jnp.int32(j), jnp.asarray(value))
                del value
            node.set_value(stacked)
            continue
        total = value.astype(np.float64)
        del value
        for stream in streams[1:]:
            total += next(stream)[1]
        set_params(model, {path: (total / len(paths)).astype(np.float32)})
        del total
    key = jax.random.key(seed)
    router = ("layers", "block", "router")
    w = variable(model, router + ("w_router",))
    set_params(model, {router + ("w_router",): cfg.init_std * jax.random.normal(key, w.shape)})
    if cfg.block.router.bias:
        b = variable(model, router + ("b_router",))
        set_params(model, {router + ("b_router",): np.zeros(b.shape, np.float32)})
    return model
