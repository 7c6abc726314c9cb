"""MoErging (DUME sec. 2.2): N dense models of one architecture become one MoE.

Every non-MLP tensor (embedding, attention, norms, LM head) is the average of the N models';
each layer's N MLPs become that layer's N routed experts, expert j being dense model j's MLP;
each layer gets a new router ``logits = x W + b`` and the gate ``softmax(top-k(logits / T))``
(DUME eq. 4; ``RouterConfig(score_fn='softmax', renormalize=True, bias=True, temperature=T)``).
The router starts random (BTX, random routing); DUME then solves it in closed form
(:mod:`dagmoe_jax.upcycle.ridge`).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence, Tuple

import numpy as np
from flax import nnx

from dagmoe_jax.config import ExecutionConfig, ExpertConfig, ModelConfig, RouterConfig
from dagmoe_jax.families.moe.config import AggregationConfig, MoEConfig
from dagmoe_jax.families.dense.config import DenseConfig
from dagmoe_jax.model import Transformer
from dagmoe_jax.model.params import flat_params, set_params
from dagmoe_jax.run.checkpoint_files import flatten_json

MLP_PREFIX = ("layers", "block")          # the dense block's w_gate / w_up / w_down
EXPERT_PREFIX = ("layers", "block", "experts")


def dume_config(dense: ModelConfig, num_experts: int, *, top_k: int = 1,
                temperature: float = 1.0) -> ModelConfig:
    """The MoE config of ``num_experts`` merged copies of the dense config ``dense``.

    top_k: experts per token (DUME's default 1: the dense models' forward cost; the authors'
    ``--k``). temperature: T of the gate (the authors' ``--temp``: 1 in their
    language-modelling scripts, 0.1 in the reasoning ones). Dispatch is dropless: a batch of
    one domain sends nearly every token to one expert, and capacity dispatch would drop most
    of them. No balance or z-loss
    (the paper found load balancing had no effect on DUME+ / BTX and trains without it).
    """
    if not isinstance(dense.block, DenseConfig):
        raise ValueError(f"ModelConfig.block={dense.block.kind!r}: DUME merges dense models "
                         f"(block='dense')")
    if num_experts < 1:
        raise ValueError(f"DUME needs at least one dense model (got {num_experts})")
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"DUME top_k={top_k} is invalid: expected an integer in "
                         f"[1, {num_experts}] (the number of dense models)")
    return dense.replace(block=MoEConfig(
        router=RouterConfig(score_fn="softmax", top_k=top_k, renormalize=True, bias=True,
                            temperature=temperature, balance_coef=0.0, z_loss_coef=0.0),
        experts=ExpertConfig(num_experts=num_experts, expert_hidden=dense.resolved_ffn_hidden,
                             num_shared=0, dispatch="dropless"),
        aggregation=AggregationConfig(kind="sum")))


def check_dume_config(cfg: ModelConfig) -> None:
    """Refuse an MoE config DUME's routers and dispatch cannot run (one-line errors)."""
    if not isinstance(cfg.block, MoEConfig):
        raise ValueError(f"ModelConfig.block={cfg.block.kind!r}: a DUME model is block='moe'")
    if cfg.block.experts.dispatch == "capacity":
        raise ValueError("ExpertConfig.dispatch='capacity' is invalid for a DUME model: use "
                         "'dropless' (capacity drops a one-domain batch's tokens)")
    if not cfg.block.router.bias:
        raise ValueError("RouterConfig.bias=False: a DUME router has a bias (the ridge "
                         "solution's last row); set bias=True")


def architecture_fields(cfg: ModelConfig) -> dict:
    """The fields of a dense config that decide its parameters' meaning, by dotted name
    (``block.ffn_hidden``): the model config less the dtypes, ``init_std`` and
    ``max_seq_len``."""
    flat = flatten_json(dataclasses.asdict(cfg))
    return {k: v for k, v in flat.items()
            if k not in ("param_dtype", "compute_dtype", "init_std", "max_seq_len")}


def check_same_architecture(cfgs: Sequence[ModelConfig], names: Sequence[str] = ()) -> None:
    """One-line error naming the first field in which the dense models differ."""
    names = list(names) or [f"model {i}" for i in range(len(cfgs))]
    first = architecture_fields(cfgs[0])
    for cfg, name in zip(cfgs[1:], names[1:]):
        if not isinstance(cfg.block, DenseConfig):
            raise ValueError(f"{name} is block={cfg.block.kind!r}: DUME merges dense models")
        for field, value in architecture_fields(cfg).items():
            if value != first[field]:
                raise ValueError(f"{name} has ModelConfig.{field}={value!r} but {names[0]} has "
                                 f"{first[field]!r}: DUME merges models of one architecture")


def merged_params(dense: Sequence[dict]) -> Tuple[dict, dict]:
    """(averaged non-MLP parameters, experts) of N dense models' :func:`flat_params`: the MLP
    weights [L, ...] of model j become expert j of ``experts`` [L, N, ...] (DUME sec. 2.2)."""
    shared, experts = {}, {}
    for path in dense[0]:
        stack = np.stack([p[path] for p in dense])
        if path[:-1] == MLP_PREFIX:
            experts[EXPERT_PREFIX + path[-1:]] = np.moveaxis(stack, 0, 1)
        else:
            shared[path] = stack.astype(np.float64).mean(axis=0).astype(np.float32)
    return shared, experts


def moerge(models: Sequence[nnx.Module], cfg: ModelConfig, *, execution: ExecutionConfig,
           seed: int = 0) -> nnx.Module:
    """The MoE ``cfg`` (a :func:`dume_config` of the models' config), run as ``execution``
    (settled for ``cfg``: :func:`dagmoe_jax.model.settle.settle`), holding N dense ``models``
    merged (DUME sec. 2.2), its routers initialised at random from ``seed``."""

    check_same_architecture([m.cfg for m in models])
    check_dume_config(cfg)
    if cfg.block.experts.num_experts != len(models):
        raise ValueError(f"ExpertConfig.num_experts={cfg.block.experts.num_experts} but "
                         f"{len(models)} dense models were given: one expert per model")
    moe = Transformer(cfg, execution=execution, rngs=nnx.Rngs(seed))
    shared, experts = merged_params([flat_params(m) for m in models])
    set_params(moe, {**shared, **experts})
    return moe


def average_models(models: Sequence[nnx.Module]) -> nnx.Module:
    """Parameter averaging (the DUME paper's "model averaging" baseline): a dense model whose
    every parameter is the mean of the ``models``' (the first model is copied, then set)."""
    check_same_architecture([m.cfg for m in models])
    params = [flat_params(m) for m in models]
    avg = nnx.clone(models[0])
    set_params(avg, {p: np.stack([q[p] for q in params]).astype(np.float64).mean(0)
                     for p in params[0]})
    return avg
