"""The fused C++ causal attention kernel (dagmoe_jax/kernels): exactness against a NumPy oracle
and the XLA references (values and gradients), causality, where 'auto' picks it, its errors, and
the on-disk build cache.

The kernel needs a C++ compiler; where none is installed these tests skip, and the blockwise
attention they would compare against is still tested in test_model.py.
"""

from __future__ import annotations

import hashlib
import os
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import benchmark_command, make_model, tiny_config
from dagmoe_jax.config import ExecutionConfig
from dagmoe_jax.kernels import build as kbuild
from dagmoe_jax.kernels import attention as kattn
from dagmoe_jax.kernels import fused_attention_unavailable, fused_causal_attention
from dagmoe_jax.model.attention import blockwise_causal_attention, causal_attention_reference
from dagmoe_jax.parallel import MeshConfig, make_mesh
from dagmoe_jax.parallel.axes import MeshLayout
from dagmoe_jax.model.settle import describe as describe_settled
from dagmoe_jax.model.settle import settle, settle_attention

pytestmark = pytest.mark.skipif(kbuild.compiler() is None,
                                reason="no C++ compiler: the fused kernel cannot be built")


def numpy_attention(q, k, v):
    """Causal GQA softmax attention in float64 NumPy: query head j reads KV head j // (H / KV)."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    b, s, h, d = q.shape
    group = h // k.shape[2]
    out = np.zeros_like(q)
    visible = np.tril(np.ones((s, s), bool))
    for bi in range(b):
        for j in range(h):
            scores = q[bi, :, j] @ k[bi, :, j // group].T / np.sqrt(d)
            scores = np.where(visible, scores, -np.inf)
            p = np.exp(scores - scores.max(-1, keepdims=True))
            out[bi, :, j] = (p / p.sum(-1, keepdims=True)) @ v[bi, :, j // group]
    return out


def random_qkv(seed, b, s, h, kv, d):
    kq, kk, kv_ = jax.random.split(jax.random.key(seed), 3)
    return (jax.random.normal(kq, (b, s, h, d)), jax.random.normal(kk, (b, s, kv, d)),
            jax.random.normal(kv_, (b, s, kv, d)))


def test_kernel_builds():
    assert fused_attention_unavailable((1, 1, 1, 16)) is None


# Sequence lengths below, at and across the 16- and 64-key vector blocks; every GQA group size
# up to 4, and 6 (a run of four heads taken together, then two alone); each head-dim code path
# (8: tiles, 16 / 32 / 64: contiguous rows, four heads at a time; 128: two at a time).
SHAPES = [
    (2, 5, 4, 2, 8),
    (2, 16, 2, 2, 16),
    (1, 37, 4, 1, 16),
    (2, 64, 6, 3, 32),
    (1, 83, 8, 2, 64),
    (1, 40, 6, 1, 16),
    (1, 21, 4, 1, 128),
]


@pytest.mark.parametrize("b,s,h,kv,d", SHAPES)
def test_fused_matches_numpy_and_reference(b, s, h, kv, d):
    q, k, v = random_qkv(s * d, b, s, h, kv, d)
    got = np.asarray(jax.jit(fused_causal_attention)(q, k, v))
    np.testing.assert_allclose(got, numpy_attention(q, k, v), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got, np.asarray(causal_attention_reference(q, k, v)),
                               rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("b,s,h,kv,d", SHAPES)
def test_fused_gradients_match_reference(b, s, h, kv, d):
    q, k, v = random_qkv(s + d, b, s, h, kv, d)
    cot = jax.random.normal(jax.random.key(7), q.shape)
    grad_of = lambda f: jax.jit(jax.grad(lambda q, k, v: jnp.sum(f(q, k, v) * cot),
                                         argnums=(0, 1, 2)))(q, k, v)
    fused = grad_of(fused_causal_attention)
    ref = grad_of(causal_attention_reference)
    block = grad_of(lambda q, k, v: blockwise_causal_attention(q, k, v, 8))
    for name, a, r, bl in zip("qkv", fused, ref, block):
        scale = float(np.max(np.abs(np.asarray(r))))
        assert scale > 0
        np.testing.assert_allclose(np.asarray(a), np.asarray(r), rtol=1e-5, atol=1e-6 * scale,
                                   err_msg=f"d{name}")
        np.testing.assert_allclose(np.asarray(a), np.asarray(bl), rtol=1e-5,
                                   atol=1e-6 * scale, err_msg=f"d{name} vs blockwise")


def test_fused_is_causal_and_gradients_stay_causal():
    b, s, h, kv, d = 1, 40, 4, 2, 16
    q, k, v = random_qkv(3, b, s, h, kv, d)
    t = 23
    k2 = k.at[:, t:].add(5.0)
    v2 = v.at[:, t:].add(-3.0)
    out, out2 = fused_causal_attention(q, k, v), fused_causal_attention(q, k2, v2)
    np.testing.assert_array_equal(np.asarray(out[:, :t]), np.asarray(out2[:, :t]))
    assert not np.allclose(np.asarray(out[:, t:]), np.asarray(out2[:, t:]))
    # A loss on position t - 1 has no gradient with respect to keys and values from t on.
    dk, dv = jax.grad(lambda k, v: jnp.sum(fused_causal_attention(q, k, v)[:, t - 1] ** 2),
                      argnums=(0, 1))(k, v)
    assert np.all(np.asarray(dk[:, t:]) == 0) and np.all(np.asarray(dv[:, t:]) == 0)
    assert np.any(np.asarray(dk[:, :t]) != 0) and np.any(np.asarray(dv[:, :t]) != 0)


def test_fused_is_permutation_sensitive_in_keys():
    """Attention over a prefix is order-free, but causality makes the whole output depend on
    the order of keys: swapping two positions changes the rows in between."""
    q, k, v = random_qkv(11, 1, 12, 2, 1, 8)
    perm = np.arange(12)
    perm[[2, 9]] = perm[[9, 2]]
    out = np.asarray(fused_causal_attention(q, k, v))
    out_p = np.asarray(fused_causal_attention(q, k[:, perm], v[:, perm]))
    np.testing.assert_array_equal(out[:, :2], out_p[:, :2])
    assert not np.allclose(out[:, 2:9], out_p[:, 2:9])


def test_fused_under_vmap_and_on_sharded_inputs():
    q, k, v = random_qkv(5, 4, 24, 4, 2, 16)
    stacked = jax.vmap(fused_causal_attention)(q[:, None], k[:, None], v[:, None])[:, 0]
    np.testing.assert_allclose(np.asarray(stacked), numpy_attention(q, k, v), rtol=1e-5,
                               atol=1e-6)
    # Batch-sharded inputs outside activate(): XLA may move the data, the answer is the same.
    mesh = jax.make_mesh((2,), ("data",))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
    sharded = [jax.device_put(a, sharding) for a in (q, k, v)]
    out = jax.jit(fused_causal_attention)(*sharded)
    np.testing.assert_allclose(np.asarray(out), numpy_attention(q, k, v), rtol=1e-5, atol=1e-6)


def test_auto_picks_fused_off_mesh_and_blockwise_on_a_mesh():
    f32, bf16 = jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)
    assert settle_attention("auto", "cpu", f32, 16, None) == ("fused", "")
    assert settle_attention("auto", "cpu", bf16, 16, None)[0] == "blockwise"
    assert settle_attention("auto", "cpu", f32, 12, None)[0] == "blockwise"
    assert settle_attention("blockwise", "cpu", f32, 16, None) == ("blockwise", "")
    assert settle_attention("auto", "gpu", bf16, 16, None) == ("cudnn", "")
    assert settle_attention("auto", "gpu", f32, 16, None)[0] == "xla"
    assert settle_attention("auto", "tpu", bf16, 16, None) == ("splash", "")
    assert settle(tiny_config()).attention == "fused"
    assert settle(tiny_config(), ExecutionConfig(attention="xla")).attention == "xla"
    bf16_cfg = tiny_config(compute_dtype="bfloat16")
    assert describe_settled(bf16_cfg, settle(bf16_cfg), ExecutionConfig()).startswith(
        "attention blockwise (the fused attention kernel takes float32 only (got bfloat16))")
    layout = MeshLayout.of(make_mesh(MeshConfig(data=2), jax.devices()[:2]))
    assert settle(tiny_config(), layout=layout).attention == "blockwise"
    with pytest.raises(ValueError, match="single device only"):
        settle(tiny_config(), ExecutionConfig(attention="fused"), layout=layout)


def test_auto_falls_back_when_the_kernel_cannot_build(monkeypatch):
    monkeypatch.setattr(kattn, "_load", lambda: "no C++ compiler found (install g++ or set CXX)")
    assert settle_attention("auto", "cpu", jnp.dtype(jnp.float32), 16, None) == (
        "blockwise", "no C++ compiler found (install g++ or set CXX)")
    cfg = tiny_config()
    assert describe_settled(cfg, settle(cfg), ExecutionConfig()).startswith(
        "attention blockwise (no C++ compiler found (install g++ or set CXX))")
    q, k, v = random_qkv(2, 1, 8, 2, 1, 8)
    with pytest.raises(ValueError, match="no C\\+\\+ compiler.*use ExecutionConfig.attention="
                                         "'blockwise'"):
        fused_causal_attention(q, k, v)


@pytest.mark.parametrize("q_shape,dtype,backend,match", [
    ((1, 4, 2, 12), jnp.float32, "cpu", "head_dim in"),
    ((1, 4, 2, 16), jnp.bfloat16, "cpu", "float32 only"),
    ((1, 4, 2, 16), jnp.float32, "gpu", "CPU only"),
])
def test_unavailable_reasons(q_shape, dtype, backend, match):
    reason = fused_attention_unavailable(q_shape, dtype, backend)
    assert reason is not None and match in reason


def test_unsupported_head_dim_raises_a_clear_error():
    q, k, v = random_qkv(4, 1, 8, 2, 1, 12)
    with pytest.raises(ValueError, match="head_dim in .* use ExecutionConfig.attention='blockwise'"):
        fused_causal_attention(q, k, v)


def test_model_with_fused_attention_matches_blockwise():
    """The whole decoder, logits and parameter gradients, with either attention."""
    tokens = jax.random.randint(jax.random.key(0), (2, 24), 0, 64)
    results = {}
    for impl in ("fused", "blockwise"):
        model = make_model(tiny_config("moe", "dag", experts=dict(capacity_factor=4.0)),
                           attention=impl)
        loss = lambda m: jnp.mean(m(tokens)[0] ** 2)
        value, grads = nnx.jit(nnx.value_and_grad(loss))(model)
        results[impl] = (float(value), jax.tree.leaves(nnx.state(grads)))
    np.testing.assert_allclose(results["fused"][0], results["blockwise"][0], rtol=1e-5)
    for a, b in zip(results["fused"][1], results["blockwise"][1]):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)


def test_build_cache_is_reused_and_keyed_on_the_source(tmp_path, monkeypatch):
    monkeypatch.setenv("DAGMOE_KERNEL_CACHE", str(tmp_path))
    src = tmp_path / "tiny_kernel.cc"
    src.write_text('extern "C" int dagmoe_answer() { return 42; }\n')
    first = kbuild.build(src)
    assert first.parent == tmp_path and first.stat().st_size > 0
    stamp = first.stat().st_mtime_ns
    assert kbuild.build(src) == first and first.stat().st_mtime_ns == stamp
    import ctypes
    assert ctypes.cdll.LoadLibrary(str(first)).dagmoe_answer() == 42
    src.write_text('extern "C" int dagmoe_answer() { return 43; }\n')
    second = kbuild.build(src)
    assert second != first
    assert ctypes.cdll.LoadLibrary(str(second)).dagmoe_answer() == 43
    # No temporary files left behind: each library and the digest recorded beside it.
    assert sorted(p.suffix for p in tmp_path.iterdir()) == [".cc", ".sha256", ".sha256", ".so",
                                                            ".so"]


def test_the_cache_loads_only_what_this_user_built(tmp_path, monkeypatch):
    """A library planted under the expected name (no digest, or a wrong one) is rebuilt over,
    never returned; a cache others can write to is refused in one line."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("DAGMOE_KERNEL_CACHE", str(cache))
    src = tmp_path / "tiny_kernel.cc"
    src.write_text('extern "C" int dagmoe_answer() { return 42; }\n')
    target = kbuild.target_path(src, kbuild.compiler())
    cache.mkdir(mode=0o700)
    target.write_bytes(b"planted: not the library this user built")
    built = kbuild.build(src)
    assert built == target and b"planted" not in built.read_bytes()
    import ctypes
    assert ctypes.cdll.LoadLibrary(str(built)).dagmoe_answer() == 42
    # a library swapped after the build (digest no longer matches) is rebuilt too; swapped by
    # a rename, as an attacker would: writing into the file this process has mapped would
    # crash it
    stamp = built.stat().st_mtime_ns
    swapped = built.with_name("swapped.tmp")
    swapped.write_bytes(built.read_bytes() + b"\0")
    os.replace(swapped, built)
    assert kbuild.build(src) == target and target.stat().st_mtime_ns != stamp
    assert (target.with_name(target.name + ".sha256").read_text().strip()
            == hashlib.sha256(target.read_bytes()).hexdigest())
    os.chmod(cache, 0o777)
    with pytest.raises(kbuild.KernelBuildError, match=r"is writable by other users: run "
                                                      r"'chmod go-w .*'") as err:
        kbuild.build(src)
    assert "\n" not in str(err.value)
    os.chmod(cache, 0o700)


def test_build_errors_are_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("DAGMOE_KERNEL_CACHE", str(tmp_path))
    bad = tmp_path / "broken.cc"
    bad.write_text("this is not C++\n")
    with pytest.raises(kbuild.KernelBuildError, match="failed on broken.cc") as err:
        kbuild.build(bad)
    assert "\n" not in str(err.value)
    assert [p.name for p in tmp_path.iterdir()] == ["broken.cc"]
    monkeypatch.setenv("CXX", os.path.join(str(tmp_path), "no-such-compiler"))
    with pytest.raises(kbuild.KernelBuildError, match="no C\\+\\+ compiler"):
        kbuild.build(bad)


@pytest.mark.slow
def test_attention_benchmark_prints_its_table():
    import subprocess
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["DAGMOE_TCMALLOC"] = "0"
    out = subprocess.run(benchmark_command("attention_kernel", "--batch", "1", "--seq", "40",
                                           "--heads", "4", "--kv", "2", "--rounds", "1",
                                           "--block", "16"),
                         env=env, text=True, capture_output=True, timeout=300)
    assert out.returncode == 0, out.stderr
    rows = [line.split("|") for line in out.stdout.splitlines()
            if line.startswith("| ") and line.endswith("x |")]
    assert [r[1].strip() for r in rows] == ["fused", "blockwise", "xla"]
    assert all(float(r[2]) > 0 and float(r[3]) > 0 for r in rows)
    assert rows[0][4].strip() == "1.00x"
