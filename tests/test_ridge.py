"""DUME's closed-form routers (dagmoe_jax/upcycle/ridge.py, DUME eqs. 2-7) against NumPy."""

from __future__ import annotations

import numpy as np
import pytest

from dagmoe_jax.upcycle import ridge

L, D, N = 2, 6, 3


def domain_tokens(rng, j, t):
    """Tokens [layers, t, D] of domain j: Gaussian around a domain-specific mean."""
    mean = np.zeros(D)
    mean[j] = 3.0
    return mean + rng.standard_normal((L, t, D))


def direct_solution(xs, lam=ridge.DEFAULT_LAMBDA):
    """W~ per layer from the stacked X~ and one-hot Y (eq. 2), without any accumulation."""
    out = []
    for layer in range(L):
        x = np.concatenate([x[layer] for x in xs])
        xt = np.concatenate([x, np.ones((len(x), 1))], axis=1)
        y = np.concatenate([np.eye(N)[np.full(len(x_j[layer]), j)] for j, x_j in enumerate(xs)])
        out.append(np.linalg.solve(xt.T @ xt + lam * np.eye(D + 1), xt.T @ y))
    return np.stack(out)


def streamed(xs, rng, masked_garbage=False):
    stats = []
    for x in xs:
        s = ridge.DomainStatistics.zeros(L, D)
        cuts = np.sort(rng.choice(np.arange(1, x.shape[1]), size=3, replace=False))
        for part in np.split(x, cuts, axis=1):              # batches of unequal sizes
            if masked_garbage:                               # padding rows that must not count
                pad = 1e3 * rng.standard_normal((L, 4, D))
                part = np.concatenate([part, pad], axis=1)
                mask = np.arange(part.shape[1]) < part.shape[1] - 4
                s.update(part, mask)
            else:
                s.update(part)
        stats.append(s)
    return stats


def test_streaming_equals_one_batch_equals_numpy_solve():
    rng = np.random.default_rng(0)
    xs = [domain_tokens(rng, j, 40 + 10 * j) for j in range(N)]
    want = direct_solution(xs)
    one = []
    for x in xs:
        s = ridge.DomainStatistics.zeros(L, D)
        s.update(x)
        one.append(s)
    got_one = ridge.ridge_solve(*ridge.normal_equations(one))
    got_stream = ridge.ridge_solve(*ridge.normal_equations(streamed(xs, rng)))
    got_masked = ridge.ridge_solve(*ridge.normal_equations(streamed(xs, rng, True)))
    np.testing.assert_allclose(got_one, want, rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(got_stream, want, rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(got_masked, want, rtol=1e-9, atol=1e-12)
    assert [s.tokens for s in streamed(xs, rng, True)] == [x.shape[1] for x in xs]


def test_order_invariance_and_normal_equation_residual():
    rng = np.random.default_rng(1)
    xs = [domain_tokens(rng, j, 50) for j in range(N)]
    forward = ridge.normal_equations(streamed(xs, rng))
    backward = ridge.normal_equations(streamed([x[:, ::-1] for x in xs], rng))
    w1, w2 = ridge.ridge_solve(*forward), ridge.ridge_solve(*backward)
    np.testing.assert_allclose(w1, w2, rtol=1e-9, atol=1e-12)
    a, b = forward
    residual = (a + ridge.DEFAULT_LAMBDA * np.eye(D + 1)) @ w1 - b
    assert np.max(np.abs(residual)) < 1e-9 * np.max(np.abs(b))
    # lambda is absolute (not scaled by the token count): doubling the data changes W~
    doubled = ridge.ridge_solve(2 * a, 2 * b, 10.0)
    assert not np.allclose(doubled, ridge.ridge_solve(a, b, 10.0), rtol=1e-6)


def test_normalisation_gives_unit_columns_and_scales_the_bias_alike():
    rng = np.random.default_rng(2)
    w_tilde = rng.standard_normal((L, D + 1, N))
    w, b = ridge.split_and_normalise(w_tilde)
    np.testing.assert_allclose(np.linalg.norm(w, axis=1), 1.0, rtol=1e-12)
    norm = np.linalg.norm(w_tilde[:, :D], axis=1)
    np.testing.assert_allclose(w * norm[:, None], w_tilde[:, :D], rtol=1e-12)
    np.testing.assert_allclose(b * norm, w_tilde[:, D], rtol=1e-12)


def test_separable_gaussian_clusters_are_routed_to_their_domain():
    rng = np.random.default_rng(3)
    w, b = ridge.solve_routers(streamed([domain_tokens(rng, j, 200) for j in range(N)], rng))
    for j in range(N):
        test = domain_tokens(rng, j, 100)
        pred = np.argmax(np.einsum("ltd,ldn->ltn", test, w) + b[:, None], axis=-1)
        assert np.mean(pred == j) > 0.95


def test_adding_a_domain_equals_a_from_scratch_solve(tmp_path):
    rng = np.random.default_rng(4)
    xs = [domain_tokens(rng, j, 60) for j in range(N)]
    first = streamed(xs[:2], rng)
    paths = [s.save(tmp_path / f"domain{j}.npz") for j, s in enumerate(first)]
    later = [ridge.DomainStatistics.load(p) for p in paths] + streamed(xs[2:], rng)
    w_added, b_added = ridge.solve_routers(later)
    w_scratch, b_scratch = ridge.solve_routers(streamed(xs, rng))
    np.testing.assert_allclose(w_added, w_scratch, rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(b_added, b_scratch, rtol=1e-9, atol=1e-12)
    assert w_added.shape == (L, D, N)


def test_a_domain_without_tokens_is_an_error():
    s = ridge.DomainStatistics.zeros(L, D)
    s.update(np.ones((L, 3, D)), np.zeros(3, bool))
    with pytest.raises(ValueError, match="domain 1 has no tokens"):
        ridge.normal_equations([streamed([np.ones((L, 8, D))], np.random.default_rng(0))[0], s])
