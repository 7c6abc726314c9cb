"""The CPU grouped matmul (dagmoe_jax/kernels/grouped_matmul.cc): values and both gradients
against a float64 NumPy oracle (per-group x_g @ W_g), empty and ragged groups, bfloat16,
the dropless MoE model with it against the every-expert einsum, where 'auto' picks it, and its
errors; the dense product whose weight gradient runs in the same kernel file (``cpu_dense_matmul``).

The kernel needs a C++ compiler; where none is installed these tests skip, and dropless
dispatch keeps running on ``jax.lax.ragged_dot`` (test_dispatch.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import make_model, tiny_config
from dagmoe_jax.kernels import build as kbuild
from dagmoe_jax.kernels import grouped_matmul as kgmm
from dagmoe_jax.kernels.grouped_matmul import (cpu_dense_matmul, cpu_grouped_matmul,
                                               grouped_matmul_unavailable)
from dagmoe_jax.parallel import MeshConfig, make_mesh
from dagmoe_jax.parallel.axes import MeshLayout
from dagmoe_jax.config import ExecutionConfig
from dagmoe_jax.model.settle import settle, settle_grouped_matmul

pytestmark = pytest.mark.skipif(kbuild.compiler() is None,
                                reason="no C++ compiler: the grouped matmul cannot be built")


def np_grouped(x, w, sizes, dy):
    """Oracle in float64: out_g = x_g @ w[g], and the VJP of <out, dy>: dx_g = dy_g @ w[g]^T,
    dw[g] = x_g^T @ dy_g; rows past sum(sizes) give zero output and zero dx."""
    x, w, dy = (np.asarray(a, np.float64) for a in (x, w, dy))
    out, dx, dw = np.zeros((x.shape[0], w.shape[2])), np.zeros_like(x), np.zeros_like(w)
    start = 0
    for g, size in enumerate(int(s) for s in sizes):
        rows = slice(start, start + size)
        out[rows] = x[rows] @ w[g]
        dx[rows] = dy[rows] @ w[g].T
        dw[g] = x[rows].T @ dy[rows]
        start += size
    return out, dx, dw


def kernel_vjp(x, w, sizes, dy):
    out, vjp = jax.vjp(lambda x, w: cpu_grouped_matmul(x, w, jnp.asarray(sizes, jnp.int32)),
                       x, w)
    return (out, *vjp(dy))


def random_operands(seed, m, k, n, groups, dtype=jnp.float32):
    r = np.random.default_rng(seed)
    shapes = ((m, k), (groups, k, n), (m, n))
    return tuple(jnp.asarray(r.standard_normal(s), dtype) for s in shapes)


def test_kernel_builds():
    assert grouped_matmul_unavailable("cpu") is None


# (M, K, N, sizes): ragged groups across the kernel's 8-row and 32-column tiles and their
# tails, empty groups first, last and between, every row in one group, rows past sum(sizes),
# every group empty.
CASES = [
    (37, 19, 45, [5, 0, 20, 3]),
    (64, 32, 32, [0, 64, 0, 0]),
    (100, 64, 70, [17, 31, 0, 9, 43]),
    (9, 8, 16, [0, 0, 0]),
    (200, 40, 96, [1, 7, 8, 9, 63, 64, 48, 0]),
    # 40 groups: the weight gradient's one-item-per-group path (at least 4 groups a thread)
    (700, 24, 40, [0, 3, 31, 0, 17, 1] * 6 + [300, 0, 0, 5]),
]


@pytest.mark.parametrize("m,k,n,sizes", CASES)
def test_values_and_gradients_match_numpy(m, k, n, sizes):
    x, w, dy = random_operands(m + k + n, m, k, n, len(sizes))
    got = jax.jit(kernel_vjp, static_argnums=2)(x, w, tuple(sizes), dy)
    want = np_grouped(x, w, sizes, dy)
    for name, a, b in zip(("out", "dlhs", "drhs"), got, want):
        assert a.shape == b.shape and a.dtype == jnp.float32, name
        np.testing.assert_allclose(np.asarray(a), b, rtol=1e-5, atol=1e-4, err_msg=name)
    past = sum(sizes)
    assert not np.any(np.asarray(got[0])[past:]) and not np.any(np.asarray(got[1])[past:])
    for g, size in enumerate(sizes):
        if size == 0:
            assert not np.any(np.asarray(got[2][g])), f"empty group {g} has a weight gradient"


def test_equals_ragged_dot_under_jit_and_vmap():
    x, w, _ = random_operands(1, 24, 16, 40, 3)
    sizes = jnp.asarray([[10, 0, 14], [3, 20, 1]], jnp.int32)
    got = jax.jit(jax.vmap(cpu_grouped_matmul, in_axes=(None, None, 0)))(x, w, sizes)
    for i in range(2):
        np.testing.assert_allclose(np.asarray(got[i]),
                                   np.asarray(jax.lax.ragged_dot(x, w, sizes[i])),
                                   rtol=1e-5, atol=1e-5)


def test_bfloat16_operands():
    sizes = [6, 0, 19, 7]
    x, w, dy = random_operands(2, 40, 24, 33, len(sizes), jnp.bfloat16)
    got = kernel_vjp(x, w, sizes, dy)
    want = np_grouped(x, w, sizes, dy)          # exact products of the bfloat16 values
    for name, a, b in zip(("out", "dlhs", "drhs"), got, want):
        assert a.dtype == jnp.bfloat16, name
        # float32 accumulation, one rounding to bfloat16 (8 bits of mantissa)
        np.testing.assert_allclose(np.asarray(a, np.float32), b, rtol=2e-2,
                                   atol=2e-2 * np.abs(b).max(), err_msg=name)


# (T, K, N): contractions shorter than, equal to and across the kernel's 256-row blocks (one
# range per thread), K off its 8-row tiles, N off its 32-column panels.
DENSE_CASES = [(1, 3, 5), (37, 19, 45), (256, 8, 32), (300, 13, 45), (1000, 77, 100),
               (2049, 128, 64)]


@pytest.mark.parametrize("t,k,n", DENSE_CASES)
def test_dense_matmul_weight_gradient_matches_numpy(t, k, n):
    """cpu_dense_matmul: x @ w and both gradients against float64 NumPy; the weight gradient
    x^T dy is the kernel's (DagmoeWgrad), the rest XLA's."""
    r = np.random.default_rng(t + k + n)
    x, w, dy = (jnp.asarray(r.standard_normal(s), jnp.float32) for s in ((t, k), (k, n), (t, n)))
    out, vjp = jax.vjp(jax.jit(cpu_dense_matmul), x, w)
    dx, dw = jax.jit(vjp)(dy)
    x64, w64, dy64 = (np.asarray(a, np.float64) for a in (x, w, dy))
    for name, a, b in (("out", out, x64 @ w64), ("dx", dx, dy64 @ w64.T), ("dw", dw, x64.T @ dy64)):
        assert a.shape == b.shape and a.dtype == jnp.float32, name
        np.testing.assert_allclose(np.asarray(a), b, rtol=1e-5, atol=2e-5 * np.sqrt(t),
                                   err_msg=name)


def test_dense_matmul_bfloat16_and_errors():
    r = np.random.default_rng(0)
    x, w = (jnp.asarray(r.standard_normal(s), jnp.bfloat16) for s in ((300, 24), (24, 40)))
    dw = jax.grad(lambda w: jnp.sum(cpu_dense_matmul(x, w).astype(jnp.float32)))(w)
    assert dw.dtype == jnp.bfloat16
    want = np.asarray(x, np.float64).T @ np.ones((300, 40))
    np.testing.assert_allclose(np.asarray(dw, np.float32), want, rtol=2e-2, atol=0.3)
    with pytest.raises(ValueError, match="dense matmul: expected x"):
        cpu_dense_matmul(x, w.T)


def test_dropless_model_with_the_kernel_equals_dense_dispatch():
    """The whole decoder, logits and every parameter gradient: dropless dispatch through the
    kernel against dense dispatch (every expert on every token), the oracle."""
    tokens = jax.random.randint(jax.random.key(0), (2, 24), 0, 64)
    results = {}
    def loss(m):
        logits = m(tokens)[0]
        return jnp.mean(logits ** 2), logits

    for mode, gm in (("dropless", "cpu_gmm"), ("dense", "einsum")):
        model = make_model(tiny_config("moe", "sum", init_std=0.2), grouped_matmul=gm)
        assert model.execution.grouped_matmul == gm
        (_, logits), grads = nnx.jit(nnx.value_and_grad(loss, has_aux=True))(model)
        results[mode] = (np.asarray(logits), jax.tree.leaves(nnx.state(grads)))
    (la, ga), (lb, gb) = results["dropless"], results["dense"]
    assert np.abs(lb).max() > 0.1
    np.testing.assert_allclose(la, lb, rtol=1e-5, atol=1e-5 * np.abs(lb).max())
    assert len(ga) == len(gb)
    for a, b in zip(ga, gb):
        a, b = np.asarray(a), np.asarray(b)
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5 * max(np.abs(b).max(), 1e-6))
    assert any(np.abs(np.asarray(g)).max() > 0 for g in ga)


def test_auto_picks_the_kernel_on_cpu_off_mesh_only():
    assert settle_grouped_matmul("auto", "cpu", 32, 32) == "cpu_gmm"
    assert settle_grouped_matmul("ragged_dot", "cpu", 32, 32) == "ragged_dot"
    assert settle_grouped_matmul("auto", "gpu", 32, 32) == "ragged_dot"
    assert settle_grouped_matmul("auto", "tpu", 128, 256) == "gmm"
    assert settle(tiny_config()).grouped_matmul == "cpu_gmm"
    layout = MeshLayout.of(make_mesh(MeshConfig(data=2), jax.devices()[:2]))
    assert settle(tiny_config(), layout=layout).grouped_matmul == "ragged_dot"
    with pytest.raises(ValueError, match="^ExecutionConfig.grouped_matmul='cpu_gmm' runs on a "
                                         "single device only"):
        settle(tiny_config(), ExecutionConfig(grouped_matmul="cpu_gmm"), layout=layout)


def test_auto_falls_back_when_the_kernel_cannot_build(monkeypatch):
    monkeypatch.setattr(kgmm, "_load", lambda: "no C++ compiler found (install g++ or set CXX)")
    assert settle_grouped_matmul("auto", "cpu", 32, 32) == "ragged_dot"
    x, w, _ = random_operands(3, 8, 4, 4, 2)
    with pytest.raises(ValueError, match="^no C\\+\\+ compiler.*use ExecutionConfig."
                                         "grouped_matmul='ragged_dot' instead$"):
        cpu_grouped_matmul(x, w, jnp.asarray([4, 4], jnp.int32))


@pytest.mark.parametrize("shapes,dtypes,match", [
    (((8, 4), (2, 5, 3), (2,)), (jnp.float32, jnp.float32, jnp.int32), "expected lhs"),
    (((8, 4), (2, 4, 3), (3,)), (jnp.float32, jnp.float32, jnp.int32), "sizes must be"),
    (((8, 4), (2, 4, 3), (2,)), (jnp.float32, jnp.float32, jnp.float32), "sizes must be"),
    (((8, 4), (2, 4, 3), (2,)), (jnp.float16, jnp.float32, jnp.int32), "float32 or bfloat16"),
])
def test_bad_operands_are_one_line_errors(shapes, dtypes, match):
    args = [jnp.zeros(s, d) for s, d in zip(shapes, dtypes)]
    with pytest.raises(ValueError, match=match) as err:
        cpu_grouped_matmul(*args)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("sizes,match", [([5, 4], "sum to more than"), ([-1, 3], "negative")])
def test_bad_group_sizes_fail_the_call(sizes, match):
    x, w, _ = random_operands(4, 8, 4, 4, 2)
    with pytest.raises(Exception, match=match):
        jax.block_until_ready(cpu_grouped_matmul(x, w, jnp.asarray(sizes, jnp.int32)))


def test_benchmark_prints_its_table(capsys):
    """benchmarks/grouped_matmul.py's table 1 on a tiny shape, in this process."""
    from benchmarks import grouped_matmul as bench
    bench.main(["--tokens", "64", "--top_k", "2", "--experts", "4", "--d_model", "16",
                "--hidden", "24", "--repeats", "1", "--ragged_dot"])
    table_1 = capsys.readouterr().out.split("\n\n")[0]
    rows = [line.split() for line in table_1.splitlines()
            if line.endswith("x") and not line.startswith("route")]
    assert [r[0] for r in rows] == ["cpu_gmm", "einsum,", "einsum,", "ragged_dot"]
    assert rows[0][-1] == "1.00x" and all(float(r[-1][:-1]) > 0 for r in rows)
