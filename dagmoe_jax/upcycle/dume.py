"""DUME (seed 004): the statistics pass, the closed-form routers, oracle routing, DAG upcycling.

* :func:`forced_forward`: the merged MoE with every layer's routing replaced by one expert (the
  domain's); returns the logits (the paper's Oracle baseline) and each layer's MLP input.
* :func:`collect_statistics`: DUME eq. 7's pass: each domain's text through the model forced to
  that domain's expert, accumulating its :class:`~dagmoe_jax.upcycle.ridge.DomainStatistics`.
* :func:`set_routers` / :func:`dume`: the solved routers written into the MoE.
* :func:`upcycle_to_dag`: the DUME model with a DAG aggregator (DAG-MoE eqs. 6-12) whose zero
  ``W_up`` makes it start exactly equal to DUME (the default ``dag_residual='once'`` reading).

DUME+ and BTX (router-only training) are ``RunConfig(trainable='router')`` runs of the
training loop from the DUME or random-router model (docs/design.md section 7).
"""

from __future__ import annotations

import functools

from typing import Callable, Dict, Iterable, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dagmoe_jax.config import block_summary
from dagmoe_jax.families.dense.config import DenseConfig
from dagmoe_jax.families.moe.config import MoEConfig
from dagmoe_jax.analysis.collection import record
from dagmoe_jax.model.attention import rope_angles
from dagmoe_jax.model.layers import dtype_of, swiglu
from dagmoe_jax.model.segments import segment_positions
from dagmoe_jax.model.params import flat_params, set_params
from dagmoe_jax.upcycle.moerge import (EXPERT_PREFIX, MLP_PREFIX, check_dume_config,
                                       check_same_architecture)
from dagmoe_jax.upcycle.ridge import DEFAULT_LAMBDA, DomainStatistics, solve_routers
from dagmoe_jax.model import Transformer

Batch = Dict[str, np.ndarray]
DAG_PREFIX = ("layers", "block", "aggregator", "iterations")
SHARED_PREFIX = ("layers", "block", "shared")


def forced_forward(model: nnx.Module, tokens: jax.Array, expert: jax.Array, head: bool = True,
                   segment_ids: Optional[jax.Array] = None):
    """Logits [B, S, V] of the MoE ``model`` with every token of every layer sent to expert
    ``expert`` (an int32 scalar; gate 1), and the MLP inputs x = RMSNorm(h) of every layer
    [layers, B, S, d] (DUME eq. 7's X^(l)_j). The attention, norms and embedding are the
    model's own; only the routing is replaced, so with shared (averaged) non-MLP weights this is
    dense model ``expert`` run with those weights (the paper's Oracle). ``head=False`` (the
    statistics pass) returns None for the logits and skips the LM head. ``segment_ids``
    [B, S]: packed examples (instruction data), as :class:`~dagmoe_jax.model.Transformer`
    takes them (positions restart, attention stays within an example).

    Memory: the model's state is only read, and the layers run one at a time, each a call of
    one jitted program that takes the stacked weights and the layer's index and slices them
    itself (no copy of a layer's weights is made outside it). A scan over the stacked layers
    inside one program let XLA:CPU convert every layer's bfloat16 weights to float32 at once
    (a float32 copy of the model as temporaries); a loop over static slices inside the
    program materialised every slice at once."""
    cfg = model.cfg
    if not isinstance(cfg.block, MoEConfig) or cfg.block.aggregation.kind != "sum":
        raise ValueError(f"forced routing needs a merged MoE with aggregation 'sum' (this is "
                         f"{block_summary(cfg.block)}): collect statistics before upcycling "
                         f"into a DAG")
    graphdef, state = nnx.split(model)
    layers_graphdef, stacked = nnx.split(model.layers)
    h, sin, cos = _embedded(graphdef, state, tokens, segment_ids)
    inputs = []
    for index in range(cfg.num_layers):
        h, x = _forced_layer(layers_graphdef, stacked, jnp.int32(index), h, sin, cos, expert,
                             segment_ids)
        inputs.append(x)
    inputs = jnp.stack(inputs)
    if not head:
        return None, inputs
    return _head(graphdef, state, h), inputs


@functools.partial(jax.jit, static_argnums=0)
def _embedded(graphdef, state, tokens, segment_ids):
    """(the embedded ``tokens`` in the compute dtype, RoPE's sin and cos) of the model
    ``nnx.merge(graphdef, state)``."""
    model = nnx.merge(graphdef, state)
    cfg = model.cfg
    positions = (jnp.arange(tokens.shape[1])[None, :] if segment_ids is None
                 else segment_positions(segment_ids))
    sin, cos = rope_angles(positions, cfg.rope_dim, cfg.rope_theta, cfg.rope_scaling)
    return model.embed[...].astype(dtype_of(cfg.compute_dtype))[tokens], sin, cos


@functools.partial(jax.jit, static_argnums=0)
def _forced_layer(graphdef, stacked, index, h, sin, cos, expert, segment_ids):
    """Decoder layer ``index`` of the stacked layers ``nnx.merge(graphdef, stacked)`` with its
    MLP input routed to ``expert``: (the layer's output, its MLP input x)."""
    layer = nnx.merge(graphdef, jax.tree.map(
        lambda a: jax.lax.dynamic_index_in_dim(a, index, keepdims=False), stacked))
    dt = h.dtype
    b, s, _ = h.shape
    a, _ = layer.attn(layer.attn_norm(h), sin, cos, segment_ids=segment_ids)
    h = (h + a).astype(dt)
    x = layer.block_norm(h)
    e = layer.block.experts
    w = [getattr(e, n)[...][expert].astype(dt) for n in ("w_gate", "w_up", "w_down")]
    y = swiglu(x.reshape(b * s, -1).astype(dt), *w, fused=e.plan.execution.fuse_projections)
    if layer.block.shared is not None:
        y = y + layer.block.shared(x.reshape(b * s, -1))
    return layer.add_block_output(h, y.reshape(b, s, -1)).astype(dt), x


@functools.partial(jax.jit, static_argnums=0)
def _head(graphdef, state, h):
    """The logits of the final hidden states ``h`` (float32)."""
    model = nnx.merge(graphdef, state)
    h = model.final_norm(h)
    return jnp.dot(h, model.lm_head[...].astype(h.dtype), preferred_element_type=jnp.float32)


def token_mask(batch: Batch, tokens_per_sequence: Optional[int] = None) -> np.ndarray:
    """Which input tokens of ``batch`` count in the statistics [B, S]: the non-padding ones
    (``batch['mask']``, all when absent) among the first ``tokens_per_sequence`` of each row
    (the authors' ``--num_dume_tokens``; None: all)."""
    mask = np.asarray(batch.get("mask", np.ones_like(batch["inputs"], bool)), bool)
    if tokens_per_sequence is not None:
        mask = mask & (np.arange(mask.shape[1])[None, :] < tokens_per_sequence)
    return mask


@jax.jit
def accumulate_on_device(sums, x: jax.Array, mask: jax.Array):
    """DUME eq. 7 on the device: ``sums`` = (gram, gram_carry, total, total_carry) float32
    [layers, d+1, d+1] / [layers, d+1] plus one batch of MLP inputs ``x`` [layers, T, d] whose
    tokens ``mask`` [T] keeps: ``A += X~^T X~``, ``B_j += X~^T 1`` with ``X~ = [X, 1]`` (masked
    rows zero). The batch's products are float32 matmuls (HIGHEST precision); the running sums
    are Kahan-compensated (the carries hold what each addition lost), so the error over many
    batches stays that of one batch's matmul, ``<= T u |X~|^T |X~|`` (u = 2^-24), the size of
    the forward pass's own float32 rounding of x. Returns the new ``sums``."""
    m = mask.astype(jnp.float32)[None, :, None]
    xt = jnp.concatenate([x.astype(jnp.float32), jnp.ones(x.shape[:2] + (1,), jnp.float32)],
                         axis=-1) * m
    gram = jnp.einsum("ltd,lte->lde", xt, xt, precision=jax.lax.Precision.HIGHEST)
    out = []
    for acc, carry, inc in ((sums[0], sums[1], gram), (sums[2], sums[3], xt.sum(axis=1))):
        y = inc - carry
        t = acc + y
        out += [t, (t - acc) - y]
    return tuple(out)


def collect_statistics(model: nnx.Module, batches: Iterable[Batch], expert: int, *,
                       tokens_per_sequence: Optional[int] = None,
                       stats: Optional[DomainStatistics] = None, on_host: bool = False,
                       progress: Callable[[int, int], None] = lambda _batches, _tokens: None
                       ) -> DomainStatistics:
    """One domain's ridge statistics (DUME eq. 7): ``batches`` (dicts with 'inputs' [B, S] and
    optionally 'mask') through ``model`` forced to ``expert``, every layer's MLP inputs
    accumulated on the device (:func:`accumulate_on_device`, compensated float32, whatever
    the model's compute dtype; only the [layers, d+1, d+1] sums reach the host, once, added
    to the float64 statistics a layer at a time). ``on_host=True``: each batch's
    inputs copied to the host and accumulated in float64 NumPy (the reference). ``stats``:
    statistics to add to (a domain seen in several passes); ``progress(batches, tokens)``
    hears after every batch."""
    check_dume_config(model.cfg)
    cfg = model.cfg
    stats = stats or DomainStatistics.zeros(cfg.num_layers, cfg.d_model)
    n = cfg.d_model + 1
    sums = (jnp.zeros((cfg.num_layers, n, n), jnp.float32),) * 2 + (
        jnp.zeros((cfg.num_layers, n), jnp.float32),) * 2
    tokens = stats.tokens
    for i, batch in enumerate(batches):
        segments = batch.get("segment_ids")
        _, x = forced_forward(model, jnp.asarray(batch["inputs"]), jnp.int32(expert),
                              head=False,
                              segment_ids=None if segments is None else jnp.asarray(segments))
        mask = token_mask(batch, tokens_per_sequence).reshape(-1)
        x = x.reshape(cfg.num_layers, -1, cfg.d_model)
        if on_host:
            stats.update(np.asarray(x, np.float64), mask)
            tokens = stats.tokens
        else:
            sums = accumulate_on_device(sums, x, jnp.asarray(mask))
            tokens += int(mask.sum())
        progress(i + 1, tokens)
    if not on_host:
        host = [np.asarray(a) for a in sums]       # float32; float64 one layer at a time
        for layer in range(cfg.num_layers):        # Kahan: the carry is what the sum lacks
            stats.gram[layer] += host[0][layer].astype(np.float64) - host[1][layer]
            stats.total[layer] += host[2][layer].astype(np.float64) - host[3][layer]
        stats.tokens = tokens
    return stats


def set_routers(model: nnx.Module, w: np.ndarray, b: np.ndarray) -> None:
    """Write router weights W [layers, d, N] and biases b [layers, N] into the MoE ``model``."""
    check_dume_config(model.cfg)
    set_params(model, {("layers", "block", "router", "w_router"): w,
                       ("layers", "block", "router", "b_router"): b})


def dume(model: nnx.Module, stats: Sequence[DomainStatistics],
         lam: float = DEFAULT_LAMBDA) -> nnx.Module:
    """The MoE ``model`` with its routers set to DUME's closed-form solution (eqs. 6-7,
    normalised columns) for the per-domain ``stats`` in expert order; returns ``model``."""
    if len(stats) != model.cfg.block.experts.num_experts:
        raise ValueError(f"{len(stats)} domains of statistics for "
                         f"{model.cfg.block.experts.num_experts} experts: one domain per expert")
    set_routers(model, *solve_routers(stats, lam))
    return model


def add_expert(moe: nnx.Module, dense: nnx.Module, *, seed: int = 0,
               reaverage: bool = False) -> nnx.Module:
    """``moe`` with one more expert: dense model ``dense``'s MLPs appended as expert N in every
    layer. By default the shared (averaged) weights stay those of ``moe``, not re-averaged, so
    the forced passes of the old domains, and with them their statistics, are unchanged:
    solving with the old domains' saved statistics plus the new domain's equals solving from
    scratch on the new model (DUME sec. 2.3, "experts can be added dynamically").
    ``reaverage=True`` makes the shared weights the mean over all N + 1 models, ``(N * mean +
    new) / (N + 1)`` in float64 (equal to merging the N + 1 models afresh when ``moe`` holds the
    plain mean, DUME sec. 2.2): every layer's inputs change, so every domain needs fresh
    statistics (:func:`collect_statistics`) before :func:`dume`. The routers are random until
    :func:`dume` sets them."""
    check_dume_config(moe.cfg)
    as_dense = moe.cfg.replace(block=DenseConfig(ffn_hidden=moe.cfg.block.experts.expert_hidden))
    check_same_architecture([as_dense, dense.cfg], ["the merged model", "the new model"])
    n = moe.cfg.block.experts.num_experts
    cfg = moe.cfg.replace(block=dict(experts=dict(num_experts=n + 1)))
    grown = Transformer(cfg, execution=moe.execution, rngs=nnx.Rngs(seed))
    params = {p: v for p, v in flat_params(moe).items() if "router" not in p}
    new = flat_params(dense)
    if reaverage:
        for path in [p for p in params if p[:len(EXPERT_PREFIX)] != EXPERT_PREFIX]:
            total = n * params[path].astype(np.float64) + new[path].astype(np.float64)
            params[path] = (total / (n + 1)).astype(np.float32)
    for name in ("w_gate", "w_up", "w_down"):
        path = EXPERT_PREFIX + (name,)
        params[path] = np.concatenate([params[path], new[MLP_PREFIX + (name,)][:, None]], axis=1)
    set_params(grown, params)
    return grown


def redraw_fan_in(model: nnx.Module, paths: Sequence[Tuple[str, ...]], seed: int) -> None:
    """Redraw the weights at ``paths`` (stacked [..., in, out]) from N(0, 1 / in): each output
    then has about its inputs' RMS, where ``init_std`` 0.02 shrinks it ~0.02 sqrt(in) times."""
    keys = jax.random.split(jax.random.key(seed), len(paths))
    params = flat_params(model)
    set_params(model, {p: jax.random.normal(k, params[p].shape) / np.sqrt(params[p].shape[-2])
                       for k, p in zip(keys, paths)})


def upcycle_to_dag(moe: nnx.Module, *, dag_dim: int = 128, dag_iters: int = 2,
                   seed: int = 0, fan_in: bool = False, **aggregation) -> nnx.Module:
    """A DAG-MoE (``AggregationConfig(kind='dag')``) holding every parameter of the merged MoE
    ``moe``; the DAG module's own parameters are freshly initialised, ``W_up`` at zero, so with
    the default ``dag_residual='once'`` the model computes exactly what ``moe`` does until
    training moves ``W_up`` (tests/test_upcycle.py). At ``init_std`` 0.02 its messages have
    RMS ~1e-3 and W_up's updates barely show (inert); ``fan_in=True`` redraws W_down, W_edge
    and W_node from N(0, 1 / fan-in) (:func:`redraw_fan_in`), so the messages have RMS ~1 and
    W_up's first steps move the output; the start is still exactly DUME (W_up = 0)."""

    cfg = moe.cfg.replace(block=dict(aggregation=dict(kind="dag", dag_dim=dag_dim,
                                                      dag_iters=dag_iters, **aggregation)))
    if cfg.block.aggregation.dag_residual != "once":
        raise ValueError("AggregationConfig.dag_residual='literal' adds RMSNorm(h) to the "
                         "stream, so the upcycled model would not start equal to DUME: use "
                         "'once'")
    dag = Transformer(cfg, execution=moe.execution, rngs=nnx.Rngs(seed))
    set_params(dag, flat_params(moe))
    if fan_in:
        redraw_fan_in(dag, [DAG_PREFIX + (n,) for n in ("w_down", "w_edge", "w_node")], seed)
    return dag


def add_shared_expert(moe: nnx.Module, hidden: int, *, seed: int = 0,
                      fan_in: bool = False) -> nnx.Module:
    """The merged MoE ``moe`` plus one shared SwiGLU expert of ``hidden`` units in every layer
    (the DAG's parameter-matched baseline, DAG-MoE sec. 5.1, with
    :func:`dagmoe_jax.config.matched_shared_hidden`), its ``w_down`` zero so the model starts
    exactly equal to ``moe``; ``fan_in``: ``w_gate`` and ``w_up`` from N(0, 1 / d), as
    :func:`upcycle_to_dag`'s messages."""
    check_dume_config(moe.cfg)
    cfg = moe.cfg.replace(block=dict(experts=dict(num_shared=1, shared_hidden=hidden)))
    grown = Transformer(cfg, execution=moe.execution, rngs=nnx.Rngs(seed))
    set_params(grown, flat_params(moe))
    down = SHARED_PREFIX + ("w_down",)
    set_params(grown, {down: np.zeros(flat_params(grown)[down].shape, np.float32)})
    if fan_in:
        redraw_fan_in(grown, [SHARED_PREFIX + (n,) for n in ("w_gate", "w_up")], seed)
    return grown


def routing_accuracy(model: nnx.Module, batches: Iterable[Batch], expert: int) -> np.ndarray:
    """Per layer, the share of a domain's (non-padding) tokens whose top-1 expert is the
    domain's own ``expert`` when ``model`` routes by itself (its router inputs are those of its
    own routing, not the forced pass) [layers]."""
    hits, count = 0.0, 0.0
    for batch in batches:
        top1 = np.asarray(record(model, batch["inputs"])["indices"][:, 0, :, 0])  # [layers, T]
        mask = token_mask(batch).reshape(-1)
        hits = hits + ((top1 == expert) & mask[None]).sum(axis=1)
        count += mask.sum()
    return np.asarray(hits, np.float64) / max(count, 1.0)
