"""Router: scores, top-K order and ties, renormalisation, and the two router losses.

The loss definitions: balance = N * sum_i f_i P_i, in two conventions for f_i: 'tokens' (the
share of tokens that chose expert i, summing to K: Hugging Face's ``load_balancing_loss_func``,
the DAG-MoE paper's training stack, the default) and 'slots' (the share of the T*K routing
slots, summing to 1); P_i the mean over tokens of softmax(z)_i ('softmax', the default) or of
s_i / sum_j s_j ('score_share'); z-loss = mean_t (logsumexp_i z_ti)^2.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dagmoe_jax.config import RouterConfig
from dagmoe_jax.model.routed.router import (Router, balance_fraction, balance_loss, balance_probs,
                                            expert_load, router_scores, select_top_k, z_loss)

# 4 tokens, 3 experts. Top-2 by hand (sigmoid and softmax are both monotonic in z):
#   t0 [2, 1, 0] -> experts 0, 1     t1 [0, 3, 1] -> 1, 2
#   t2 [1, 0, 2] -> 2, 0             t3 [3, 2, 1] -> 0, 1
LOGITS = np.array([[2.0, 1.0, 0.0],
                   [0.0, 3.0, 1.0],
                   [1.0, 0.0, 2.0],
                   [3.0, 2.0, 1.0]], np.float32)
TOP2 = np.array([[0, 1], [1, 2], [2, 0], [0, 1]])
# f_i by counting the 8 slots above: expert 0 three times, expert 1 three times, expert 2 twice.
F = np.array([3, 3, 2]) / 8.0
# ... and by counting tokens: expert 0 is chosen by t0, t2, t3; expert 1 by t0, t1, t3; expert 2
# by t1, t2: 3, 3 and 2 of the 4 tokens (sums to K = 2).
F_TOKENS = np.array([3, 3, 2]) / 4.0


def hand_scores(score_fn):
    z = LOGITS.astype(np.float64)
    if score_fn == "softmax":
        e = np.exp(z)
        return e / e.sum(axis=1, keepdims=True)
    return 1.0 / (1.0 + np.exp(-z))


def hand_balance(score_fn, load="tokens", prob="softmax"):
    if prob == "softmax":                       # softmax of the logits whatever score_fn is
        p = hand_scores("softmax")
    else:
        s = hand_scores(score_fn)
        p = s / s.sum(axis=1, keepdims=True)    # a no-op for softmax; s_i / sum_j s_j for sigmoid
    f = F_TOKENS if load == "tokens" else F
    return 3 * np.sum(f * p.mean(axis=0))


def hand_z_loss():
    lse = np.log(np.exp(LOGITS.astype(np.float64)).sum(axis=1))
    return np.mean(lse ** 2)


def test_hand_example_values():
    # Spot-check the hand arithmetic itself on token 0 (logits 2, 1, 0).
    e = np.exp([2.0, 1.0, 0.0])
    np.testing.assert_allclose(hand_scores("softmax")[0], e / e.sum())
    np.testing.assert_allclose(hand_z_loss(),
                               np.mean([np.log(np.exp([2, 1, 0]).sum()) ** 2,
                                        np.log(np.exp([0, 3, 1]).sum()) ** 2,
                                        np.log(np.exp([1, 0, 2]).sum()) ** 2,
                                        np.log(np.exp([3, 2, 1]).sum()) ** 2]))


def test_hand_balance_conventions_differ_by_k():
    # The same routing in the two conventions: f over tokens is K = 2 times f over slots.
    np.testing.assert_allclose(F_TOKENS, 2 * F)
    np.testing.assert_allclose(hand_balance("sigmoid", "tokens", "score_share"),
                               2 * hand_balance("sigmoid", "slots", "score_share"))
    # Spot-check one number: softmax P, tokens f, written out term by term.
    p = hand_scores("softmax").mean(axis=0)
    np.testing.assert_allclose(hand_balance("sigmoid"),
                               3 * (0.75 * p[0] + 0.75 * p[1] + 0.5 * p[2]))


@pytest.mark.parametrize("score_fn", ["softmax", "sigmoid"])
def test_losses_against_hand_computation(score_fn):
    scores = router_scores(jnp.asarray(LOGITS), score_fn)
    np.testing.assert_allclose(np.asarray(scores), hand_scores(score_fn), rtol=1e-6)
    gates, indices = select_top_k(scores, 2, renormalize=False)
    np.testing.assert_array_equal(np.asarray(indices), TOP2)
    np.testing.assert_allclose(np.asarray(gates),
                               np.take_along_axis(hand_scores(score_fn), TOP2, axis=1), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(expert_load(indices, 3)), F, rtol=1e-7)
    np.testing.assert_allclose(np.asarray(balance_fraction(indices, 3, "tokens")), F_TOKENS,
                               rtol=1e-7)
    np.testing.assert_allclose(np.asarray(balance_fraction(indices, 3, "slots")), F, rtol=1e-7)
    for load in ("tokens", "slots"):
        for prob in ("softmax", "score_share"):
            probs = balance_probs(jnp.asarray(LOGITS), scores, prob)
            np.testing.assert_allclose(float(balance_loss(probs, indices, load)),
                                       hand_balance(score_fn, load, prob), rtol=1e-6,
                                       err_msg=f"{load} {prob}")
    np.testing.assert_allclose(float(z_loss(jnp.asarray(LOGITS))), hand_z_loss(), rtol=1e-6)


@pytest.mark.parametrize("score_fn", ["softmax", "sigmoid"])
def test_router_module_end_to_end(score_fn):
    # x = identity rows and w_router = LOGITS make the router's logits exactly LOGITS.
    router = Router(RouterConfig(top_k=2, score_fn=score_fn), 4, 3, std=0.02, rngs=nnx.Rngs(0))
    router.w_router[...] = jnp.asarray(LOGITS)
    routing = router(jnp.eye(4, dtype=jnp.float32))
    np.testing.assert_allclose(np.asarray(routing.logits), LOGITS)
    np.testing.assert_array_equal(np.asarray(routing.indices), TOP2)
    losses = router.losses(routing)                      # the defaults: tokens, softmax
    np.testing.assert_allclose(float(losses["balance_loss"]), hand_balance(score_fn), rtol=1e-6)
    other = Router(RouterConfig(top_k=2, score_fn=score_fn, balance_load="slots",
                                balance_prob="score_share"), 4, 3, std=0.02, rngs=nnx.Rngs(0))
    slots = other.losses(routing)
    np.testing.assert_allclose(float(slots["balance_loss"]),
                               hand_balance(score_fn, "slots", "score_share"), rtol=1e-6)
    np.testing.assert_allclose(float(losses["z_loss"]), hand_z_loss(), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(losses["expert_load"]), F, rtol=1e-7)


def test_balance_loss_is_k_when_uniform_over_tokens_and_one_over_slots():
    # Equal logits: P_i = 1/N; a perfectly balanced assignment gives f_i = K/N over tokens
    # (N * N * K/N * 1/N = K = 2) and f_i = 1/N over slots (1).
    logits = jnp.zeros((4, 4), jnp.float32)
    indices = jnp.asarray([[0, 1], [2, 3], [1, 0], [3, 2]])
    for fn in ("softmax", "sigmoid"):
        for prob in ("softmax", "score_share"):
            probs = balance_probs(logits, router_scores(logits, fn), prob)
            np.testing.assert_allclose(float(balance_loss(probs, indices, "tokens")), 2.0,
                                       rtol=1e-6)
            np.testing.assert_allclose(float(balance_loss(probs, indices, "slots")), 1.0,
                                       rtol=1e-6)
    # All slots on one expert with P uniform: N * 1 * 1/N = 1 too; concentrated P makes it N.
    collapsed = jnp.zeros((4, 1), jnp.int32)
    uniform = balance_probs(logits, router_scores(logits, "softmax"), "softmax")
    np.testing.assert_allclose(float(balance_loss(uniform, collapsed, "slots")), 1.0, rtol=1e-6)
    peaked = jnp.asarray(np.tile([50.0, 0, 0, 0], (4, 1)), jnp.float32)
    peaked_p = balance_probs(peaked, router_scores(peaked, "softmax"), "softmax")
    np.testing.assert_allclose(float(balance_loss(peaked_p, collapsed, "slots")), 4.0, rtol=1e-5)
    # With K = 1 the two conventions coincide.
    np.testing.assert_allclose(float(balance_loss(peaked_p, collapsed, "tokens")), 4.0, rtol=1e-5)


def test_top_k_descending_and_ties_to_lower_index():
    rng = np.random.default_rng(0)
    scores = rng.uniform(size=(50, 8)).astype(np.float32)
    gates, indices = select_top_k(jnp.asarray(scores), 3, renormalize=False)
    gates, indices = np.asarray(gates), np.asarray(indices)
    assert np.all(np.diff(gates, axis=1) <= 0)
    np.testing.assert_array_equal(indices, np.argsort(-scores, axis=1, kind="stable")[:, :3])
    np.testing.assert_array_equal(gates, np.take_along_axis(scores, indices, axis=1))

    tied = jnp.asarray([[0.5, 0.7, 0.7, 0.1],
                        [0.3, 0.3, 0.3, 0.3],
                        [0.2, 0.9, 0.2, 0.9],
                        [0.4, 0.1, 0.4, 0.4]], jnp.float32)
    _, idx = select_top_k(tied, 3, renormalize=False)
    np.testing.assert_array_equal(np.asarray(idx), [[1, 2, 0], [0, 1, 2], [1, 3, 0], [0, 2, 3]])


@pytest.mark.parametrize("score_fn", ["softmax", "sigmoid"])
def test_renormalize_and_expert_load_sum_to_one(score_fn):
    logits = jax.random.normal(jax.random.key(0), (32, 8)) * 2
    scores = router_scores(logits, score_fn)
    raw, idx = select_top_k(scores, 3, renormalize=False)
    gates, idx2 = select_top_k(scores, 3, renormalize=True)
    np.testing.assert_array_equal(np.asarray(idx), np.asarray(idx2))
    np.testing.assert_allclose(np.asarray(gates.sum(axis=1)), 1.0, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(gates),
                               np.asarray(raw / raw.sum(axis=1, keepdims=True)), rtol=1e-6)
    if score_fn == "sigmoid":   # without renormalisation sigmoid gates do not sum to 1
        assert not np.allclose(np.asarray(raw.sum(axis=1)), 1.0)
    load = np.asarray(expert_load(idx, 8))
    assert load.shape == (8,)
    np.testing.assert_allclose(load.sum(), 1.0, rtol=1e-6)
    np.testing.assert_allclose(load, np.bincount(np.asarray(idx).ravel(), minlength=8) / (32 * 3))


def test_router_logits_are_float32_for_bfloat16_inputs():
    router = Router(RouterConfig(top_k=2), 8, 4, std=0.5, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (6, 8)).astype(jnp.bfloat16)
    routing = router(x)
    assert routing.logits.dtype == jnp.float32
    assert routing.gates.dtype == jnp.bfloat16          # gates follow the activations
    expected = np.asarray(x, np.float32) @ np.asarray(router.w_router[...], np.float32)
    np.testing.assert_allclose(np.asarray(routing.logits), expected, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------- DeepSeek: groups, scaling, correction bias

def deepseek_gates_reference(scores, bias, k, n_group, topk_group, group_score, norm, scale):
    """DeepSeek-V2's group-limited greedy and V3's node-limited selection, token by token in
    plain Python (DeepSeek-V2 sec. 2.2.2, V3 sec. 2.1.2): rank by s + b, keep the topk_group
    groups of best group score (max, or sum of the top two), take the K best of their experts;
    gates are the unbiased s, renormalised if ``norm``, times ``scale``. Returns one
    {expert: gate} per token."""
    out = []
    n = scores.shape[1]
    size = n // n_group
    for s in np.asarray(scores, np.float64):
        choice = s + (0.0 if bias is None else np.asarray(bias, np.float64))
        group_scores = []
        for g in range(n_group):
            members = sorted(choice[g * size:(g + 1) * size], reverse=True)
            group_scores.append(members[0] if group_score == "max" else members[0] + members[1])
        groups = sorted(range(n_group), key=lambda g: -group_scores[g])[:topk_group]
        eligible = [i for i in range(n) if i // size in groups]
        chosen = sorted(eligible, key=lambda i: -choice[i])[:k]
        total = sum(s[i] for i in chosen)
        out.append({i: (s[i] / total if norm else s[i]) * scale for i in chosen})
    return out


@pytest.mark.parametrize("group_score, biased, norm, scale", [
    ("max", False, False, 16.0),       # DeepSeek-V2: softmax scores, group-limited greedy
    ("top2_sum", True, True, 2.5),     # DeepSeek-V3: sigmoid scores, correction bias
    ("top2_sum", False, True, 1.0)])
def test_group_limited_selection_equals_its_transcription(group_score, biased, norm, scale):
    rng = np.random.default_rng(0)
    scores = jax.nn.sigmoid(jnp.asarray(rng.standard_normal((64, 16)), jnp.float32))
    bias = jnp.asarray(0.3 * rng.standard_normal(16), jnp.float32) if biased else None
    gates, indices = select_top_k(scores, 4, norm, bias, n_group=4, topk_group=2,
                                  group_score=group_score, scale=scale)
    want = deepseek_gates_reference(scores, bias, 4, 4, 2, group_score, norm, scale)
    for t, expected in enumerate(want):
        got = dict(zip(np.asarray(indices[t]).tolist(), np.asarray(gates[t]).tolist()))
        assert got.keys() == expected.keys(), (t, got, expected)
        np.testing.assert_allclose([got[i] for i in expected], list(expected.values()),
                                   rtol=1e-6)
        assert len({i // 4 for i in got}) <= 2                    # at most topk_group groups
    # the limit binds: without groups some token takes an expert of a third group
    _, free = select_top_k(scores, 4, norm, bias)
    assert any(len({int(i) // 4 for i in row}) > 2 for row in np.asarray(free))


def test_one_group_and_unit_scale_are_the_plain_router():
    rng = np.random.default_rng(1)
    scores = jax.nn.softmax(jnp.asarray(rng.standard_normal((32, 8)), jnp.float32))
    bias = jnp.asarray(0.1 * rng.standard_normal(8), jnp.float32)
    for b in (None, bias):
        plain = select_top_k(scores, 3, True, b)
        grouped = select_top_k(scores, 3, True, b, n_group=1, topk_group=1, scale=1.0)
        every = select_top_k(scores, 3, True, b, n_group=4, topk_group=4)    # all groups kept
        for other in (grouped, every):
            np.testing.assert_array_equal(np.asarray(other[1]), np.asarray(plain[1]))
            np.testing.assert_allclose(np.asarray(other[0]), np.asarray(plain[0]), rtol=1e-6)
    scaled = select_top_k(scores, 3, True, bias, scale=2.5)
    np.testing.assert_allclose(np.asarray(scaled[0]), 2.5 * np.asarray(plain[0]), rtol=1e-6)


def test_the_router_module_routes_within_groups_and_its_gradient_flows():
    cfg = RouterConfig(top_k=2, score_fn="sigmoid", renormalize=True, n_group=4, topk_group=1,
                       group_score="top2_sum", routed_scaling_factor=2.0)
    router = Router(cfg, 8, 8, std=0.5, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(0), (16, 8))
    routing = router(x)
    groups = np.asarray(routing.indices) // 2
    assert np.all(groups[:, 0] == groups[:, 1])                  # both from the one group kept
    np.testing.assert_allclose(np.asarray(routing.gates).sum(-1), 2.0, rtol=1e-6)

    def loss(r):
        return jnp.sum(r(x).gates[:, 0] ** 2)
    grad = nnx.grad(loss)(router)
    assert float(jnp.max(jnp.abs(grad["w_router"][...]))) > 0


@pytest.mark.parametrize("change, needle", [
    (dict(n_group=3), "n_group=3 is invalid: expected a divisor of num_experts=8"),
    (dict(n_group=4, topk_group=5), "topk_group=5 is invalid"),
    (dict(n_group=8, topk_group=1, top_k=2), "enough groups for top_k=2"),
    (dict(n_group=8, topk_group=4, group_score="top2_sum"), "'max' for groups of one expert"),
    (dict(routed_scaling_factor=0.0), "routed_scaling_factor=0.0 is invalid"),
    (dict(group_score="sum"), "group_score='sum' is invalid")])
def test_groups_that_do_not_fit_are_one_line(change, needle):
    from dagmoe_jax.config import ExpertConfig
    from dagmoe_jax.families.moe.config import MoEConfig
    with pytest.raises(ValueError, match=needle.replace("(", r"\(").replace("[", r"\[")):
        top_k = change.pop("top_k", 2)
        MoEConfig(router=RouterConfig(top_k=top_k, **change),
                  experts=ExpertConfig(num_experts=8))


def test_group_limited_routing_under_capacity_dispatch_equals_dropless():
    """A capacity that drops nothing computes what dropless dispatch does, with DeepSeek-V3's
    routing (groups, selection bias, scaled gates) in front of both."""
    from conftest import make_model, tiny_config
    router = dict(score_fn="sigmoid", n_group=4, topk_group=2, group_score="top2_sum",
                  renormalize=True, routed_scaling_factor=2.5, aux_free_bias_rate=0.001)
    tokens = jnp.asarray(np.random.default_rng(4).integers(0, 64, (2, 12)))
    logits = []
    for experts in (dict(num_experts=8, num_shared=1, dispatch="dropless"),
                    dict(num_experts=8, num_shared=1, dispatch="capacity", capacity_factor=8)):
        model = make_model(tiny_config("moe", "sum", router=router, experts=experts))
        model.layers.block.router.selection_bias[...] = jnp.linspace(-0.2, 0.2, 8)[None]
        out, aux = model(tokens)
        assert float(jnp.max(aux["dropped_fraction"])) == 0.0
        logits.append(np.asarray(out))
    np.testing.assert_allclose(logits[1], logits[0], rtol=1e-5, atol=1e-6)
