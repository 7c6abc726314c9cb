"""Token-choice router: scores, top-K gates, the two router losses and auxiliary-loss-free
balancing (docs/design.md section 2)."""

from __future__ import annotations

from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
from flax import nnx

from dagmoe_jax.config import RouterConfig
from dagmoe_jax.model.layers import make_param, normal


class SelectionBias(nnx.Variable):
    """A router's per-expert selection bias b_i [N] (DeepSeek-V3 eq. 16): added to the scores
    for the top-K selection only. Not an ``nnx.Param``: no gradient, no optimizer state, no
    weight decay; the training step moves it (:func:`aux_free_bias_update`) and a checkpoint
    saves it with the model."""


class Routing(NamedTuple):
    """One routing decision for T tokens.

    gates [T, K]: g_k of the selected experts in rank order (highest score first);
    indices [T, K]: their expert ids, the node order of the DAG (DAG-MoE eq. 3, list k);
    logits [T, N] float32 and scores [T, N]: for the losses and for analysis.
    """

    gates: jax.Array
    indices: jax.Array
    logits: jax.Array
    scores: jax.Array


def router_logits(x: jax.Array, w_router: jax.Array, b_router: Optional[jax.Array] = None,
                  temperature: float = 1.0) -> jax.Array:
    """z_i = x . e_i (DAG-MoE sec. 2; Switch router), or DUME's (x W + b) / T (DUME sec. 2.2,
    the router of eq. 4 with the ridge solution's bias row b and temperature T); float32."""
    z = jnp.einsum("td,dn->tn", x.astype(jnp.float32), w_router.astype(jnp.float32))
    if b_router is not None:
        z = z + b_router.astype(jnp.float32)
    return z if temperature == 1.0 else z / temperature


def router_scores(logits: jax.Array, score_fn: str) -> jax.Array:
    """s = sigmoid(z) (DAG-MoE Appendix B.1) or softmax(z) (Switch; CoE eq. 7)."""
    if score_fn == "sigmoid":
        return jax.nn.sigmoid(logits)
    if score_fn == "softmax":
        return jax.nn.softmax(logits, axis=-1)
    raise ValueError(f"router score_fn={score_fn!r} is invalid: expected 'sigmoid' or 'softmax'")


def aux_free_top_k(scores: jax.Array, bias: jax.Array, k: int):
    """Auxiliary-loss-free selection, DeepSeek-V3 eq. 16 (sec. 2.1.2): g_i = s_i if
    s_i + b_i is among the K largest of {s_j + b_j}, else 0. The bias ``b`` [N] decides which
    experts a token goes to, never how much they weigh: the gates are the unbiased scores.

    Returns gates and indices [T, K] in descending order of the *biased* scores (ties to the
    lower expert id), so the gates themselves need not be in descending order.
    """
    _, indices = jax.lax.top_k(scores + bias.astype(scores.dtype), k)
    return jnp.take_along_axis(scores, indices, axis=-1), indices


def group_limited_top_k(choice: jax.Array, k: int, n_group: int, topk_group: int,
                        group_score: str = "max") -> jax.Array:
    """Group-limited selection: DeepSeek-V2 sec. 2.2.2 (device-limited routing, Hugging Face's
    ``topk_method='group_limited_greedy'``) and DeepSeek-V3 sec. 2.1.2 (node-limited routing).

    The N experts of ``choice`` [T, N] (the scores selection ranks by: with a selection bias,
    the biased scores) form ``n_group`` groups of N / n_group consecutive ids. A group's score
    is its highest choice score ('max', V2) or the sum of its two highest ('top2_sum', V3); each
    token keeps its ``topk_group`` best groups and takes the K best experts among theirs, the
    other groups' experts at -inf. Returns the indices [T, K] in descending choice order.
    """
    t, n = choice.shape
    grouped = choice.reshape(t, n_group, n // n_group)
    if group_score == "max":
        per_group = jnp.max(grouped, axis=-1)
    else:
        per_group = jnp.sum(jax.lax.top_k(grouped, 2)[0], axis=-1)
    _, best = jax.lax.top_k(per_group, topk_group)                        # [T, topk_group]
    kept = jnp.any(best[..., None] == jnp.arange(n_group), axis=-2)       # [T, n_group]
    masked = jnp.where(jnp.repeat(kept, n // n_group, axis=-1), choice, -jnp.inf)
    return jax.lax.top_k(masked, k)[1]


def select_top_k(scores: jax.Array, k: int, renormalize: bool,
                 bias: Optional[jax.Array] = None, *, n_group: int = 1, topk_group: int = 1,
                 group_score: str = "max", scale: float = 1.0):
    """Top-K gating, DAG-MoE eq. 1 / CoE eq. 7: g_i = s_i for the K best experts, else 0.

    Returns gates and indices [T, K] in descending score order; ties go to the lower expert id,
    so the node order is deterministic (the DAG's output depends on it only with
    ``dag_edges='ranked'``). ``renormalize`` divides the gates by their sum; at k = 1 that is
    g / g = 1, returned as a constant: autodiff of g / g leaves rounding noise (~1e-10 against
    ~1e-3 at k = 2) that Adam would scale into real router steps. ``bias`` [N]: select by
    the biased scores instead (:func:`aux_free_top_k`; DeepSeek-V3 renormalises those gates).
    ``n_group`` > 1: only among the ``topk_group`` best groups (:func:`group_limited_top_k`,
    ranked by the biased scores where there is a bias). ``scale``: DeepSeek's
    ``routed_scaling_factor``, multiplying the gates last.
    """
    if n_group > 1:
        choice = scores if bias is None else scores + bias.astype(scores.dtype)
        indices = group_limited_top_k(choice, k, n_group, topk_group, group_score)
        gates = jnp.take_along_axis(scores, indices, axis=-1)
    elif bias is None:
        gates, indices = jax.lax.top_k(scores, k)
    else:
        gates, indices = aux_free_top_k(scores, bias, k)
    if renormalize and k == 1:
        gates = jnp.ones_like(gates)
    elif renormalize:
        gates = gates / jnp.maximum(jnp.sum(gates, axis=-1, keepdims=True), 1e-9)
    return (gates if scale == 1.0 else gates * scale), indices


def expert_load(indices: jax.Array, num_experts: int) -> jax.Array:
    """Share of the T * K routing slots that went to each expert ([N] float32, sums to 1)."""
    return expert_counts(indices, num_experts).astype(jnp.float32) / indices.size


def expert_counts(indices: jax.Array, num_experts: int) -> jax.Array:
    """Assignments per expert ([N] int32): how many of the T * K routing slots chose each."""
    return jnp.zeros((num_experts,), jnp.int32).at[indices.reshape(-1)].add(1)


def aux_free_bias_update(bias: jax.Array, counts: jax.Array, rate: float) -> jax.Array:
    """The bias update of auxiliary-loss-free balancing (DeepSeek-V3 sec. 2.1.2; Wang et al.
    2024, Algorithm 1): after each training step, ``b_i <- b_i + rate * sign(mean_j c_j - c_i)``
    with c_i the step's assignments to expert i: an overloaded expert's bias falls by
    ``rate``, an underloaded one's rises by it, an expert at exactly the mean keeps it.

    ``bias`` [..., N] float32, ``counts`` [..., N] integers (``sign(mean - c_i)`` is computed as
    ``sign(sum_j c_j - N c_i)``, exact in integers: shares of a whole in floating point could
    miss "exactly at the mean" by a rounding); ``rate``: gamma, the bias update speed.
    """
    counts = jnp.asarray(counts).astype(jnp.int32)
    n = counts.shape[-1]
    above = jnp.sum(counts, axis=-1, keepdims=True) - n * counts
    return bias + jnp.asarray(rate, bias.dtype) * jnp.sign(above).astype(bias.dtype)


def balance_fraction(indices: jax.Array, num_experts: int, load: str) -> jax.Array:
    """f_i of the balance loss ([N]) for indices [T, K].

    'tokens': share of the T tokens that chose expert i (sums to K; Hugging Face's
    ``load_balancing_loss_func``, the paper's training stack). 'slots': share of the T * K
    routing slots (sums to 1; :func:`expert_load`).
    """
    f = expert_load(indices, num_experts)
    return f * indices.shape[-1] if load == "tokens" else f


def balance_probs(logits: jax.Array, scores: jax.Array, prob: str) -> jax.Array:
    """P of the balance loss per token ([T, N], float32).

    'softmax': softmax of the router logits, whatever the score function (Hugging Face's
    ``load_balancing_loss_func``). 'score_share': s_i / sum_j s_j, the expert's share of the
    token's scores (the softmax itself for softmax scores).
    """
    if prob == "softmax":
        return jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    s = scores.astype(jnp.float32)
    return s / jnp.sum(s, axis=-1, keepdims=True)


def balance_loss(probs: jax.Array, indices: jax.Array, load: str = "tokens") -> jax.Array:
    """Switch balance loss ``N * sum_i f_i * P_i`` (Switch Transformer eq. 4; DAG-MoE sec. 5.1
    "standard balance loss").

    ``probs`` [T, N] from :func:`balance_probs`; f_i is :func:`balance_fraction` and P_i the
    mean of ``probs`` over tokens. At balance (f and P uniform) the loss is K with
    ``load='tokens'`` and 1 with ``load='slots'``.
    """
    n = probs.shape[-1]
    return n * jnp.sum(balance_fraction(indices, n, load) * jnp.mean(probs, axis=0))


def sequence_balance_loss(probs: jax.Array, indices: jax.Array, sequences: int,
                          load: str = "tokens") -> jax.Array:
    """The balance loss within each sequence, averaged over sequences: DeepSeek-V2's
    expert-level balance loss (sec. 2.2.3, ``alpha_1 sum_i f_i P_i`` with f and P counted over
    "the tokens in a sequence") and DeepSeek-V3's complementary sequence-wise balance loss
    (eq. 17-20).

    ``probs`` [T, N] and ``indices`` [T, K] hold ``sequences`` rows of T / sequences tokens one
    after the other (the [B, S] batch flattened); each row's loss is :func:`balance_loss`.
    With ``load='slots'`` and softmax probabilities this is DeepSeek's ``MoEGate.forward``,
    ``seq_aux`` branch (``modeling_deepseek.py`` of deepseek-ai/DeepSeek-V2; the CoE authors'
    ``seq_aux=True``): ``ce[b, i]`` = expert i's count among row b's S * K assignments over
    S * K / N, loss = mean_b sum_i ce[b, i] * mean_t scores[b, t, i]. With the default
    ``load='tokens'`` it is K times that. One sequence: the batch loss.
    """
    t, n = probs.shape
    rows = probs.reshape(sequences, t // sequences, n)
    picks = indices.reshape(sequences, t // sequences, indices.shape[-1])
    return jnp.mean(jax.vmap(lambda p, i: balance_loss(p, i, load))(rows, picks))


def z_loss(logits: jax.Array) -> jax.Array:
    """Router z-loss (ST-MoE): ``mean_t (logsumexp_i z_ti)^2``."""
    return jnp.mean(jnp.square(jax.nn.logsumexp(logits.astype(jnp.float32), axis=-1)))


class Router(nnx.Module):
    """Router keys e_i as a [d, N] matrix; returns a :class:`Routing` for tokens [T, d].

    cfg: the ``RouterConfig`` (score function, renormalisation, group-limited selection and
    the gates' scale (:func:`select_top_k`), the balance loss's conventions
    of :func:`balance_fraction` and :func:`balance_probs` and its scope, a learned
    zero-initialised bias ``b_router`` [N], the temperature of :func:`router_logits`, and with
    ``aux_free_bias_rate`` > 0 a zero-initialised :class:`SelectionBias` ``selection_bias`` [N]
    for :func:`aux_free_top_k`); top_k: experts per token (default ``cfg.top_k``; CoE routes
    K / C per iteration); std: the keys' initialiser.
    """

    def __init__(self, cfg: RouterConfig, d_model: int, num_experts: int, *, std: float,
                 top_k: Optional[int] = None, rngs: nnx.Rngs):
        self.top_k = cfg.top_k if top_k is None else top_k
        self.score_fn, self.renormalize = cfg.score_fn, cfg.renormalize
        self.balance_load, self.balance_prob = cfg.balance_load, cfg.balance_prob
        self.balance_scope = cfg.balance_scope
        self.bias_rate = float(cfg.aux_free_bias_rate)
        self.temperature = float(cfg.temperature)
        # plain Python fields (a dict would make the module's graph definition unhashable)
        self.n_group, self.topk_group = cfg.n_group, cfg.topk_group
        self.group_score, self.scale = cfg.group_score, float(cfg.routed_scaling_factor)
        self.w_router = make_param(rngs, normal(std), (d_model, num_experts), ("embed", None))
        self.b_router = (make_param(rngs, nnx.initializers.zeros, (num_experts,), (None,))
                         if cfg.bias else None)
        self.selection_bias = (SelectionBias(jnp.zeros((num_experts,), jnp.float32),
                                             out_sharding=(None,), eager_sharding=False)
                               if self.bias_rate > 0 else None)

    def __call__(self, x: jax.Array) -> Routing:
        bias = None if self.b_router is None else self.b_router[...]
        logits = router_logits(x, self.w_router[...], bias, self.temperature)
        scores = router_scores(logits, self.score_fn)
        selection = None if self.selection_bias is None else self.selection_bias[...]
        gates, indices = select_top_k(scores, self.top_k, self.renormalize, selection,
                                      n_group=self.n_group, topk_group=self.topk_group,
                                      group_score=self.group_score, scale=self.scale)
        return Routing(gates.astype(x.dtype), indices, logits, scores)

    def losses(self, routing: Routing, sequences: int = 1) -> dict:
        """The unweighted router losses and the slot load of one routing decision over
        ``sequences`` rows of tokens (the balance loss's 'sequence' scope counts within each);
        with a selection bias also the assignments per expert (``expert_counts``, what the
        training step moves the bias by)."""
        n = routing.scores.shape[-1]
        probs = balance_probs(routing.logits, routing.scores, self.balance_prob)
        if self.balance_scope == "sequence":
            balance = sequence_balance_loss(probs, routing.indices, sequences, self.balance_load)
        else:
            balance = balance_loss(probs, routing.indices, self.balance_load)
        out = {"balance_loss": balance, "z_loss": z_loss(routing.logits),
               "expert_load": expert_load(routing.indices, n)}
        if self.selection_bias is not None:
            out["expert_counts"] = expert_counts(routing.indices, n)
        return out

    def update_selection_bias(self, counts: jax.Array) -> None:
        """Move ``selection_bias`` by :func:`aux_free_bias_update` from the step's assignments
        per expert ``counts`` (in place; stacked layers: [layers, N] both)."""
        self.selection_bias[...] = aux_free_bias_update(self.selection_bias[...], counts,
                                                        self.bias_rate)
