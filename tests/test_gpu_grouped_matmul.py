"""The GPU grouped matmuls (dagmoe_jax/kernels/gpu_grouped_matmul.py) in their interpreters on
CPU, against ``jax.lax.ragged_dot`` and a NumPy transcription: forward, input gradient and
weight gradient, at skewed group sizes with an empty group, groups that cross row tiles, and
rows past ``sum(sizes)`` (zeros, no gradient); and where 'auto' settles them.

The Mosaic GPU kernels' interpreter in jax 0.10 runs the forward kernel only; their backward
tests run from jax 0.11 on (skipped with that reason before).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import np_grouped_matmul, tiny_config
from dagmoe_jax.kernels import gpu_grouped_matmul as gpu
from dagmoe_jax.model.routed import dispatch as dispatch_lib
from dagmoe_jax.model.settle import (describe, settle, settle_gpu_grouped_matmul,
                                   settle_grouped_matmul)

JAX_0_11 = tuple(int(p) for p in jax.__version__.split(".")[:2]) >= (0, 11)


def np_weight_grad(lhs, dy, sizes):
    """[G, K, N]: lhs_g^T dy_g per group in NumPy."""
    out = np.zeros((len(sizes), lhs.shape[1], dy.shape[1]))
    start = 0
    for g, size in enumerate(sizes):
        rows = slice(start, start + size)
        out[g] = lhs[rows].astype(np.float64).T @ dy[rows].astype(np.float64)
        start += size
    return out


def check_against_ragged_dot(fn, sizes, k, n, dtype, tol, extra_rows, grads=True, seed=0):
    """``fn`` (interpret mode) equals ragged_dot and NumPy: output, both gradients, zeros past
    the groups and no gradient there, zero weight gradient for the empty groups."""
    rng = np.random.default_rng(seed)
    sizes = np.asarray(sizes, np.int32)
    m = int(sizes.sum()) + extra_rows
    lhs = jnp.asarray(rng.normal(size=(m, k)), dtype)
    rhs = jnp.asarray(rng.normal(size=(len(sizes), k, n)), dtype)
    probe = jnp.asarray(rng.normal(size=(m, n)), dtype)
    gsizes = jnp.asarray(sizes)
    f64 = lambda x: np.asarray(jnp.asarray(x, jnp.float32), np.float64)  # noqa: E731
    scale = np.sqrt(k)

    out = jax.jit(fn)(lhs, rhs, gsizes)
    assert out.shape == (m, n) and out.dtype == dtype
    np.testing.assert_allclose(f64(out) / scale, np_grouped_matmul(f64(lhs), f64(rhs), sizes)
                               / scale, atol=tol)
    if extra_rows:
        assert np.all(f64(out)[-extra_rows:] == 0)
    if not grads:
        return
    _, vjp = jax.vjp(lambda a, b: fn(a, b, gsizes), lhs, rhs)
    dlhs, drhs = jax.jit(vjp)(probe)
    _, ref_vjp = jax.vjp(lambda a, b: jax.lax.ragged_dot(
        a, b, gsizes, preferred_element_type=jnp.float32).astype(dtype), lhs, rhs)
    ref_dlhs, ref_drhs = ref_vjp(probe)
    assert dlhs.dtype == dtype and drhs.dtype == dtype
    np.testing.assert_allclose(f64(dlhs) / np.sqrt(n), f64(ref_dlhs) / np.sqrt(n), atol=tol)
    np.testing.assert_allclose(f64(drhs), np_weight_grad(f64(lhs), f64(probe), sizes),
                               atol=tol * np.sqrt(sizes.max()) * 4)
    if extra_rows:
        assert np.all(f64(dlhs)[-extra_rows:] == 0)
    for g in np.flatnonzero(sizes == 0):
        assert np.all(f64(drhs)[g] == 0)


# skewed routing: one expert takes most rows, one none, groups that cross row tiles
SKEWED = [3, 0, 150, 29, 1, 45]


@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 2e-2)],
                         ids=["float32", "bfloat16"])
def test_triton_kernels_equal_ragged_dot(dtype, tol):
    fn = functools.partial(gpu.triton_grouped_matmul, interpret=True)
    check_against_ragged_dot(fn, SKEWED, 32, 48, dtype, tol, extra_rows=13)


def test_triton_row_tiles_cover_every_group():
    """A row count that is a multiple of the tile, groups ending exactly on tile boundaries
    and one group taking every row."""
    fn = functools.partial(gpu.triton_grouped_matmul, interpret=True)
    check_against_ragged_dot(fn, [64, 0, 64], 16, 16, jnp.float32, 1e-5, extra_rows=0,
                             seed=1)
    check_against_ragged_dot(fn, [0, 100, 0], 16, 32, jnp.float32, 1e-5, extra_rows=28,
                             seed=2)


def test_mgpu_forward_equals_ragged_dot():
    fn = functools.partial(gpu.mgpu_grouped_matmul, interpret=True)
    check_against_ragged_dot(fn, [70, 0, 100, 58], 128, 128, jnp.bfloat16, 2e-2,
                             extra_rows=28, grads=False)


@pytest.mark.skipif(not JAX_0_11, reason="Mosaic GPU's interpreter runs the backward kernels "
                                        "from jax 0.11 on (this is jax " + jax.__version__ + ")")
def test_mgpu_gradients_equal_ragged_dot():
    fn = functools.partial(gpu.mgpu_grouped_matmul, interpret=True)
    check_against_ragged_dot(fn, [70, 0, 100, 58], 128, 128, jnp.bfloat16, 2e-2,
                             extra_rows=28)


@pytest.mark.skipif(not JAX_0_11, reason="Mosaic GPU's interpreter runs the backward kernels "
                                        "from jax 0.11 on (this is jax " + jax.__version__ + ")")
def test_mgpu_wide_tiles_equal_ragged_dot():
    """The table's tiles for many rows (64 x 256 output tiles, the H200's fastest at MoE-l):
    1,024 rows, N 256, groups crossing row tiles, an empty one and padding rows."""
    assert gpu.mgpu_blocks(1024, 64, 256).block_n == 256
    fn = functools.partial(gpu.mgpu_grouped_matmul, interpret=True)
    check_against_ragged_dot(fn, [500, 0, 333, 167], 64, 256, jnp.bfloat16, 2e-2,
                             extra_rows=24, seed=3)


def test_kernels_refuse_what_they_cannot_take():
    x, w = jnp.zeros((8, 96), jnp.bfloat16), jnp.zeros((2, 96, 64), jnp.bfloat16)
    sizes = jnp.array([4, 4], jnp.int32)
    with pytest.raises(ValueError, match="multiples of 64.*ragged_dot"):
        gpu.mgpu_grouped_matmul(x, w, sizes)
    with pytest.raises(ValueError, match="16-bit"):
        gpu.mgpu_grouped_matmul(x.astype(jnp.float32), w, sizes)
    with pytest.raises(ValueError, match="multiples of 16"):
        gpu.triton_grouped_matmul(x[:, :40], w[:, :40], sizes)
    with pytest.raises(ValueError, match="sizes must be integer"):
        gpu.triton_grouped_matmul(x, w, sizes.astype(jnp.float32))


def test_block_tables_divide_their_dims():
    for m, k, n in ((65536, 1024, 512), (16384, 512, 256), (4096, 256, 512)):
        b = gpu.mgpu_blocks(m, k, n)
        assert k % b.block_k == 0 and n % b.block_n == 0
        w = gpu.mgpu_weight_blocks(k, n)
        assert k % w.block_m == 0 and n % w.block_n == 0
        t = gpu.triton_blocks(m, k, n, 2)
        assert k % t.block_k == 0 and n % t.block_n == 0
    assert gpu.triton_blocks(100, 48, 80, 4).block_n == 16


def test_dropless_dispatch_through_triton_equals_the_oracle(monkeypatch):
    monkeypatch.setitem(dispatch_lib.GROUPED_MATMUL, "triton",
                        functools.partial(gpu.triton_grouped_matmul, interpret=True))
    rng = np.random.default_rng(3)
    t, k, d, h, n = 40, 2, 32, 16, 4
    x = jnp.asarray(rng.normal(size=(t, d)), jnp.float32)
    indices = np.stack([rng.permutation(3)[:k] for _ in range(t)]).astype(np.int32)  # 3 of 4
    weights = tuple(jnp.asarray(rng.normal(size=s) / np.sqrt(s[1]), jnp.float32)
                    for s in ((n, d, h), (n, d, h), (n, h, d)))
    out, keep = jax.jit(functools.partial(dispatch_lib.dropless_dispatch,
                                          grouped_matmul="triton"))(x, jnp.asarray(indices),
                                                                    weights)
    ref, _ = dispatch_lib.dense_dispatch(x, jnp.asarray(indices), weights)
    assert bool(jnp.all(keep))
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)


def test_auto_settles_the_gpu_kernels():
    bf16, f32 = jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)
    hopper, ampere = (9, 0), (8, 0)
    assert settle_grouped_matmul("auto", "gpu", 512, 256, None, bf16, hopper) == "mgpu"
    assert settle_grouped_matmul("auto", "gpu", 512, 256, None, bf16, ampere) == "triton"
    assert settle_grouped_matmul("auto", "gpu", 512, 256, None, bf16, (8, 9)) == "triton"
    assert settle_grouped_matmul("auto", "gpu", 512, 256, None, bf16, (10, 0)) == "triton"
    # float32 on Hopper: the Mosaic GPU kernels take 16-bit only, Triton takes it
    assert settle_grouped_matmul("auto", "gpu", 512, 256, None, f32, hopper) == "triton"
    # dims the Mosaic tiles do not divide, but Triton's do
    assert settle_grouped_matmul("auto", "gpu", 512, 80, None, bf16, hopper) == "triton"
    name, why = settle_gpu_grouped_matmul((7, 5), 512, 256, bf16)
    assert name == "ragged_dot" and "8.0 or newer" in why
    name, why = settle_gpu_grouped_matmul(hopper, 520, 256, bf16)
    assert name == "ragged_dot" and "multiples of 64" in why and "multiples of 16" in why
    assert settle_gpu_grouped_matmul(None, 512, 256, bf16)[0] == "ragged_dot"
    assert settle_grouped_matmul("triton", "gpu", 512, 256, None, bf16, hopper) == "triton"
    assert settle_grouped_matmul("auto", "tpu", 512, 256, None, bf16, hopper) == "gmm"


class _Gpu:
    """A stand-in for a GPU device: what settle reads (platform, compute capability)."""

    platform = "gpu"

    def __init__(self, capability: str):
        self.compute_capability = capability


def test_settle_and_describe_read_the_device():
    cfg = tiny_config(d_model=128, compute_dtype="bfloat16",
                      experts=dict(expert_hidden=128, dispatch="dropless"))
    assert settle(cfg, backend="gpu", device=_Gpu("9.0")).grouped_matmul == "mgpu"
    assert settle(cfg, backend="gpu", device=_Gpu("8.0")).grouped_matmul == "triton"
    old = settle(cfg, backend="gpu", device=_Gpu("7.0"))
    assert old.grouped_matmul == "ragged_dot"
    from dagmoe_jax.config import ExecutionConfig
    line = describe(cfg, old, ExecutionConfig(), "gpu", device=_Gpu("7.0"))
    assert "grouped matmul ragged_dot (the GPU kernels need compute capability 8.0" in line
    hopper = settle(cfg, backend="gpu", device=_Gpu("9.0"))
    assert "grouped matmul mgpu" in describe(cfg, hopper, ExecutionConfig(), "gpu",
                                             device=_Gpu("9.0"))
