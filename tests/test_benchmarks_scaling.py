"""benchmarks/scaling.py: its layouts, HLO parsing and profiler-trace reading (no model compiled).

The profile test runs a small ``shard_map`` program with one all-gather and one all-reduce on
four of conftest's eight simulated devices under ``jax.profiler.trace``, so a change in the
trace XLA:CPU writes (event names, ``hlo_op`` arguments) shows up here, not as a silent "-" in
the benchmark's table.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from benchmarks import scaling
from conftest import tiny_config


def test_layouts_fit_their_device_counts():
    assert [name for name, _ in scaling.layouts(1)] == ["1 device"]
    assert [name for name, _ in scaling.layouts(2)] == ["dp 2", "ep 2"]
    names = [name for name, _ in scaling.layouts(8)]
    assert names == ["dp 8", "ep 8", "dp 2 x ep 4", "fsdp 2 x ep 2 x tp 2"]
    for n in (1, 2, 4, 8):
        for _, cfg in scaling.layouts(n):
            assert np.prod(cfg.resolve(n)) == n
    cfg = tiny_config("moe", "dag")                      # 4 experts, 4 heads, 2 kv heads
    assert scaling.misfit(cfg, scaling.layouts(8)[1][1], batch=8) == "experts 4 not divisible by 8"
    assert scaling.misfit(cfg, scaling.layouts(8)[0][1], batch=4) == \
        "batch rows 4 not divisible by 8"
    assert scaling.misfit(cfg, scaling.layouts(8)[3][1], batch=8) is None


def test_hlo_instructions_and_kinds():
    text = """
  %all-to-all.3 = f32[8,40,64]{2,1,0} all-to-all(f32[8,40,64]{2,1,0} %x), dimensions={0}
  %all-reduce.1 = (f32[64]{0}, bf16[2,3]{1,0}) all-reduce(f32[64]{0} %a, bf16[2,3]{1,0} %b)
  ROOT %ag-start = (f32[4]{0}, f32[16]{0}) all-gather-start(f32[4]{0} %c), dimensions={0}
  %fusion.2 = f32[] fusion(f32[4]{0} %c), kind=kLoop, calls=%fused
"""
    ins = scaling.hlo_instructions(text)
    assert ins["all-to-all.3"] == ("all-to-all", 8 * 40 * 64 * 4)
    assert ins["all-reduce.1"] == ("all-reduce", 64 * 4 + 6 * 2)
    assert ins["ag-start"] == ("all-gather-start", 80)
    assert ins["fusion.2"] == ("fusion", 4)
    assert scaling.collective_kind("all-gather-start") == "all-gather"
    assert scaling.collective_kind("reduce-scatter") == "reduce-scatter"
    assert scaling.collective_kind("fusion") is None
    assert scaling.static_collectives(text) == {"all-to-all": (1, 8 * 40 * 64 * 4),
                                                "all-reduce": (1, 268), "all-gather": (1, 80)}
    assert scaling._union([(0, 2), (1, 3), (5, 6), (5.5, 5.7)]) == 4


@pytest.mark.skipif(jax.device_count() < 4, reason="needs 4 (simulated) devices")
def test_profile_reads_collectives_off_the_trace():
    mesh = jax.make_mesh((4,), ("x",), axis_types=(AxisType.Auto,), devices=jax.devices()[:4])

    def body(a):
        full = jax.lax.all_gather(a, "x", tiled=True)                   # [256, 64]
        return jax.lax.psum(jnp.tanh(full @ full.T).sum(0, keepdims=True), "x")

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x", None), out_specs=P(None, None)))
    a = jax.device_put(jnp.ones((256, 64)), NamedSharding(mesh, P("x", None)))
    jax.block_until_ready(f(a))
    hlo = f.lower(a).compile().as_text()
    prof = scaling.profile_collectives(lambda: jax.block_until_ready(f(a)), hlo, steps=2)
    assert prof.count["all-gather"] == 1 and prof.count["all-reduce"] == 1
    assert prof.nbytes["all-gather"] == 256 * 64 * 4 and prof.nbytes["all-reduce"] == 256 * 4
    assert 0 < prof.share <= 1 and 0 <= prof.wait_share <= prof.share + 1e-9
    assert prof.by_kind["all-gather"] > 0 and prof.by_kind["all-reduce"] > 0
