"""The DAG module (DAG-MoE eq. 6-12) computed in its bottleneck space: the L iterations never
build a d-wide node (``ExecutionConfig.dag_module='bottleneck'``; docs/design.md, "The DAG
module in d_g").

Every d-dimensional quantity an iteration needs from a node enters eq. 7-8 through linear maps
and the LayerNorm's two statistics. Row vectors, W_down [d, d_g], W_up [d_g, d], per node i
(of K) and iteration l (of L); a_i = g_i E_i(x) the expert term of eq. 6 and r = x / K:

* eq. 11 unrolled: x_i^(l-1) = x_i^0 + sum_(l' < l) m_i^l' W_up^l', with x_i^0 = a_i + r
  (eq. 6) and m_i^l = sum_j x_hat_(i,j)^l [d_g] (eq. 10's messages summed);
* eq. 7-8 folded (:mod:`~dagmoe_jax.families.moe.dag.folded`), the centring moved into the weight:
  LN(x) W_down = rho (x C W_g) + beta W_down, with W_g = diag(gamma) W_down, C = I - 1 1^T / d
  (x C = x - mu 1) and rho = 1 / sqrt(var + eps);
* so x_i^(l-1) C W_g^l = x_i^0 C W_g^l + sum_(l' < l) m_i^l' (W_up^l' C W_g^l): [d_g, d_g]
  products of the weights, formed once a step;
* d mu = sum(x_i^0) + sum_(l') m_i^l' . (W_up^l' 1), and d (var + mu^2) = ||x_i^0||^2
  + 2 sum_(l') m_i^l' . (x_i^0 W_up^l'^T) + || sum_(l') m_i^l' W_up^l' ||^2, the last the
  quadratic form of the Gram matrices W_up^l' W_up^l''^T;
* eq. 12: sum_i x_i^L = sum_i x_i^0 + sum_l (sum_i m_i^l) W_up^l, that is eq. 1's weighted
  sum, x, and one [T, L d_g] x [L d_g, d] product.

So the nodes enter once: the experts' outputs projected onto [d, (2L - 1) d_g] columns
[C W_g^1 .. C W_g^L | W_up^1^T .. W_up^(L-1)^T] (the gate g_i applied to the product, the
x / K part taken once on the T tokens, not the T K nodes), and three sums a node, of E_i, of
E_i^2 and of E_i . x, which give sum(x_i^0) and ||x_i^0||^2; after that eq. 7-11 run on
[T, K, d_g] arrays for all L iterations, and no [T, K, d] array is built past the experts'
outputs, forward or backward. It is exact in real arithmetic. In floating point: the
centred product holds no mean to cancel, so it is rounded to the compute dtype; the variance
is E[x^2] - E[x]^2 (the one-pass form Flax's LayerNorm uses) from float32 statistics, which
loses digits as (mu / sigma)^2 eps_f32 where |mu| >> sigma (tests/test_dag_bottleneck.py
checks nodes whose mean is 10 sigma off zero; docs/design.md says where it holds).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from dagmoe_jax.families.moe.config import edge_mask
from dagmoe_jax.families.moe.dag.equations import EDGE_ACTIVATIONS, dag_pair_weights

F32 = jnp.float32
SAVED_NAMES = ("dag_node_statistics", "dag_messages")
"""What a remat policy that keeps the products should keep of this module too
(``ExecutionConfig.remat='dots'``): the nodes' statistics [T, K] (recomputing them re-reads the
experts' outputs) and each iteration's messages [T, K, d_g]."""


def _dot(a: jax.Array, b: jax.Array) -> jax.Array:
    """``a [..., n] @ b [n, m]`` in ``a``'s dtype (float32 accumulation), cast to float32."""
    return jnp.einsum("...n,nm->...m", a, b.astype(a.dtype)).astype(F32)


def _pair_terms(proj: jax.Array, edge_act: str, edges: str):
    """The K x K pair terms of eq. 10 from the projected nodes [T, K, 4 d_g] =
    [e_i | n_i | e_j | n_j]: (pre-activations e_i + e_j, node sums n_i + n_j, mask or None),
    each [T, K, K, d_g] (receiver i on axis 1, sender j on axis 2), float32."""
    k = proj.shape[1]
    e_i, n_i, e_j, n_j = jnp.split(proj.astype(F32), 4, axis=-1)
    pre = e_i[:, :, None, :] + e_j[:, None, :, :]
    nodes = n_i[:, :, None, :] + n_j[:, None, :, :]
    mask = None if edges == "all" else jnp.asarray(
        edge_mask(k, edges), F32)[None, :, :, None]
    return pre, nodes, mask


def _messages(proj: jax.Array, edge_act: str, edges: str) -> jax.Array:
    """Eq. 10 summed over the senders from the projected nodes [T, K, 4 d_g], one fusion."""
    pre, nodes, mask = _pair_terms(proj, edge_act, edges)
    edge = EDGE_ACTIVATIONS[edge_act](pre)
    edge = edge if mask is None else edge * mask
    return jnp.sum(edge * nodes, axis=2).astype(proj.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def pair_messages(u: jax.Array, w_pair: jax.Array, edge_act: str, edges: str) -> jax.Array:
    """DAG-MoE eq. 9-10 summed over the senders j for the down-projected nodes u [T, K, d_g]
    and the pair weights [d_g, 4 d_g] (:func:`~dagmoe_jax.families.moe.dag.equations.dag_pair_weights`),
    as :func:`~dagmoe_jax.families.moe.dag.equations.dag_pair_messages` of ``u @ w_pair`` (its
    function, every edge mode), with a backward written out: it keeps u, not the [T, K, 4 d_g]
    projection (recomputed: a product of d_g columns), and the gradient of the four projected
    parts is one [T, K, 4 d_g] array from the pair terms recomputed on the fly (autodiff kept
    the [T, K, K, d_g] activations and sliced the projection into four arrays)."""
    return _messages(jnp.einsum("tka,ab->tkb", u, w_pair), edge_act, edges)


def _pair_messages_fwd(u, w_pair, edge_act, edges):
    return pair_messages(u, w_pair, edge_act, edges), (u, w_pair)


def _pair_messages_bwd(edge_act, edges, residuals, grad):
    u, w_pair = residuals
    proj = jnp.einsum("tka,ab->tkb", u, w_pair)
    # the barriers keep XLA from splitting this backward into a fusion per part and a copy
    # to concatenate them (it did so for the weight gradient's product to read the parts)
    proj, grad = jax.lax.optimization_barrier((proj, grad))
    pre, nodes, mask = _pair_terms(proj, edge_act, edges)
    edge, slope = jax.jvp(EDGE_ACTIVATIONS[edge_act], (pre,), (jnp.ones_like(pre),))
    g = grad.astype(F32)[:, :, None, :]                    # d msg_i, broadcast over senders j
    if mask is not None:
        g = g * mask
    d_nodes = g * edge                                             # d (n_i + n_j)
    d_pre = g * slope * nodes                                      # d (e_i + e_j)
    k = proj.shape[1]
    over = lambda a, axis: sum(jax.lax.index_in_dim(a, j, axis, keepdims=False)  # noqa: E731
                               for j in range(k))       # K terms: elementwise, one fusion
    d_proj = jnp.concatenate([over(d_pre, 2), over(d_nodes, 2), over(d_pre, 1),
                              over(d_nodes, 1)], axis=-1).astype(proj.dtype)
    d_proj = jax.lax.optimization_barrier(d_proj)
    d_u = jnp.einsum("tkb,ab->tka", d_proj, w_pair)
    d_w = jnp.einsum("tka,tkb->ab", u, d_proj, preferred_element_type=F32)
    return d_u, d_w.astype(w_pair.dtype)


pair_messages.defvjp(_pair_messages_fwd, _pair_messages_bwd)


def bottleneck_weights(weights: dict, num_iters: int, shared: bool, dtype) -> dict:
    """The weights' products the iterations need, from the DAG parameters ``weights`` by name
    ([L, ...] unless ``shared``), for nodes of ``dtype``:

    * ``columns`` [d, C]: what each node is projected onto, the (2L - 1) d_g-wide blocks
      C W_g^l and W_up^l^T (with shared weights one of each), in ``dtype``;
    * ``z`` and ``q``: for each iteration, the block index of W_g^l, and of W_up^l^T
      (``q[l]`` None for the L-th, which no later iteration reads);
    * ``cross[l]`` [(l - 1) d_g, d_g]: [W_up^1 C W_g^l; ..; W_up^(l-1) C W_g^l], the
      earlier messages' share of x^(l-1) C W_g^l;
    * ``gram[l]`` [(l - 1) d_g, (l - 1) d_g]: the W_up^l' W_up^l''^T blocks, and ``up_sum[l]``
      [(l - 1) d_g]: the W_up^l' 1, their share of ||x||^2 and of sum(x);
    * ``col_sum[l]`` [d_g] = 1^T (C W_g^l) of the rounded block (what of the mean its
      rounding lets through) and ``shift[l]`` = beta^l W_down^l (eq. 7-8 folded);
    * ``pair[l]`` [d_g, 4 d_g] (eq. 9, :func:`~dagmoe_jax.families.moe.dag.equations.dag_pair_weights`)
      and ``up`` [L d_g, d] = [W_up^1; ..; W_up^L] (eq. 11-12), in ``dtype``.

    W_g^l enters centred, C W_g^l with C = I - 1 1^T / d: x C W_g = (x - mu 1) W_g, so the
    nodes' product holds no mean to cancel (it can be rounded to ``dtype``), and mu 1^T
    (C W_g) takes out what rounding the block to ``dtype`` left of it. The products of the
    weights are float32 and formed from the weights rounded to ``dtype``, as the nodes'
    products take them.
    """
    at = (lambda l: weights) if shared else (lambda l: {n: w[l] for n, w in weights.items()})
    its = [at(l) for l in range(num_iters)]
    w_g = [it["ln_scale"].astype(F32)[:, None] * it["w_down"].astype(F32)
           for it in its]                                                # diag(gamma) W_down
    w_g = [(w - jnp.mean(w, axis=0)).astype(dtype) for w in w_g]        # C W_g, centred
    w_up = [it["w_up"].astype(dtype) for it in its]
    blocks, z, q = [], [], []
    for l in range(num_iters):
        if shared and l:
            z.append(z[0])
        else:
            z.append(len(blocks))
            blocks.append(w_g[l])
    for l in range(num_iters - 1):
        if shared and l:
            q.append(q[0])
        else:
            q.append(len(blocks))
            blocks.append(w_up[l].T)
    q.append(None)
    g32, u32 = [w.astype(F32) for w in w_g], [w.astype(F32) for w in w_up]
    cross, gram, up_sum = [None], [None], [None]
    for l in range(1, num_iters):
        ups = jnp.concatenate(u32[:l])                                       # [(l) d_g, d]
        cross.append(ups @ g32[l])
        gram.append(ups @ ups.T)
        up_sum.append(jnp.sum(ups, axis=1))
    return {
        "columns": jnp.concatenate(blocks, axis=1), "z": z, "q": q, "cross": cross,
        "gram": gram, "up_sum": up_sum, "col_sum": [jnp.sum(w, axis=0) for w in g32],
        "shift": [it["ln_bias"].astype(F32) @ it["w_down"].astype(F32) for it in its],
        "pair": [dag_pair_weights(it["w_edge"], it["w_node"]).astype(dtype) for it in its],
        "up": jnp.concatenate(w_up),
    }


def bottleneck_node_terms(x: jax.Array, gates: jax.Array, expert_out: jax.Array,
                          columns: jax.Array):
    """Eq. 6's nodes x_i^0 = g_i E_i + x / K seen through the columns [d, C] and the
    LayerNorm's statistics, without building them: (x^0 columns [T, K, C], sum(x_i^0) [T, K],
    ||x_i^0||^2 [T, K]), float32. The products and sums read E once ([T, K, d], its dtype);
    x's share is taken on the T tokens."""
    k = expert_out.shape[1]
    g = gates.astype(F32)
    e32 = expert_out.astype(F32)
    x32 = x.astype(expert_out.dtype).astype(F32)
    e_sum = jnp.sum(e32, axis=-1)                                    # sum(E_i)
    e_sq = jnp.sum(jnp.square(e32), axis=-1)                         # ||E_i||^2
    e_x = jnp.einsum("tkd,td->tk", e32, x32)                         # E_i . x
    # kept by remat='dots' (SAVED_NAMES): the gates' gradient reads them again
    e_sum, e_sq, e_x = checkpoint_name((e_sum, e_sq, e_x), SAVED_NAMES[0])
    # x's share through columns / K: a weight of its own, so XLA does not merge the two
    # products into one over [T K + T] rows whose output and gradient its consumers slice
    per_token = (columns.astype(F32) / k).astype(columns.dtype)
    proj = g[..., None] * _dot(expert_out, columns) \
        + _dot(x.astype(expert_out.dtype), per_token)[:, None, :]
    total = g * e_sum + jnp.sum(x32, axis=-1, keepdims=True) / k
    square = (jnp.square(g) * e_sq + 2.0 * g * e_x / k
              + jnp.sum(jnp.square(x32), axis=-1, keepdims=True) / (k * k))
    return proj, total, square


def bottleneck_norm_projection(proj_l: jax.Array, total: jax.Array, square: jax.Array,
                               history, w: dict, l: int, d: int, eps: float) -> jax.Array:
    """DAG-MoE eq. 7-8 of iteration l (0-based) in d_g: u_i = LN(x_i^(l-1)) W_down^l [T, K, d_g]
    float32, from x_i^0 C W_g^l (``proj_l``), the statistics of x_i^0 (``total``, ``square``) and
    the earlier messages ``history`` [T, K, l d_g] (None at l = 0) with their x_i^0 W_up^T
    projections (``history[1]``), through the weight products of :func:`bottleneck_weights`."""
    s, tot, sq = proj_l, total, square
    if history is not None:
        msgs, ups = history                                          # [T, K, l d_g] each
        m32 = msgs.astype(F32)
        s = s + _dot(msgs, w["cross"][l])
        tot = tot + m32 @ w["up_sum"][l]
        sq = sq + jnp.sum(m32 * (2.0 * ups + _dot(msgs, w["gram"][l])), axis=-1)
    mean = tot / d
    var = jnp.maximum(sq / d - jnp.square(mean), 0.0)
    rstd = jax.lax.rsqrt(var + eps)
    return rstd[..., None] * s + w["shift"][l]


def bottleneck_dag(x: jax.Array, gates: jax.Array, expert_out: jax.Array, weights: dict,
                   num_iters: int, shared: bool, edges: str, edge_act: str,
                   eps: float) -> jax.Array:
    """DAG-MoE eq. 6-12 in d_g: sum_i r_i^L [T, d] (= sum_i x_i^L - x, eq. 12 but the
    residual's count, :func:`~dagmoe_jax.families.moe.dag.equations.dag_block_output`) for the
    block's input ``x`` [T, d], ``gates`` [T, K] and the experts' outputs [T, K, d], in the
    experts' dtype; ``weights`` by name, stacked [L, ...] unless ``shared`` (module
    docstring)."""
    dtype, d = expert_out.dtype, expert_out.shape[-1]
    w = bottleneck_weights(weights, num_iters, shared, dtype)
    dg = w["pair"][0].shape[0]
    proj, total, square = bottleneck_node_terms(x, gates, expert_out, w["columns"])
    mean0 = total / d                                                      # of x_i^0
    block = lambda b: proj[..., b * dg:(b + 1) * dg]                          # noqa: E731
    msgs, ups, summed = [], [], []
    for l in range(num_iters):
        history = ((jnp.concatenate(msgs, -1), jnp.concatenate(ups, -1)) if l else None)
        centred = block(w["z"][l]) - mean0[..., None] * w["col_sum"][l]     # x^0 C W_g^l
        u = bottleneck_norm_projection(centred, total, square, history, w, l, d,
                                       eps)                                       # eq. 7-8
        m = pair_messages(u.astype(dtype), w["pair"][l], edge_act, edges)        # eq. 9-10
        m = checkpoint_name(m, SAVED_NAMES[1])
        msgs.append(m)
        if w["q"][l] is not None:
            ups.append(block(w["q"][l]))
        summed.append(jnp.sum(m, axis=1))
    readout = jnp.einsum("tkd,tk->td", expert_out, gates.astype(dtype))      # sum_i g_i E_i
    up = jnp.concatenate(summed, -1) @ w["up"]                               # eq. 11-12
    return (readout.astype(F32) + up.astype(F32)).astype(dtype)
