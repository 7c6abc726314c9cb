"""``ModelConfig.first_dense_layers`` (DeepSeek-V2/V3's ``first_k_dense_replace``): the first
layers' block is a dense SwiGLU of its own width, the rest the family's; parameters, FLOPs,
statistics, decoding caches and gradients follow."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import make_model, tiny_config
from dagmoe_jax.model.accounting import account
from dagmoe_jax.model.transformer import StackCaches


def deepseek_like(block: str = "moe", **changes):
    return tiny_config(block, "sum", experts=dict(num_shared=1)).replace(
        **{"num_layers": 3, "first_dense_layers": 1, "first_dense_ffn_hidden": 40, **changes})


def test_the_first_layers_are_dense_and_counted():
    cfg = deepseek_like()
    model = make_model(cfg)
    state = dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))
    shapes = {tuple(map(str, k)): v.get_value().shape for k, v in state.items()}
    assert shapes[("dense_layers", "block", "w_gate")] == (1, 32, 40)      # its own width
    assert shapes[("layers", "block", "experts", "w_gate")][0] == 2         # the routed two
    built = sum(int(np.prod(s)) for s in shapes.values())
    acc = account(cfg, 16)
    assert acc.total_params == built
    assert acc.params["dense_ffn"] == 3 * 32 * 40
    assert acc.flops["dense_ffn"] == pytest.approx(3 * 2.0 * 3 * 32 * 40)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 64, (2, 12)))
    logits, aux = model(tokens)
    assert logits.shape == (2, 12, 64) and aux["expert_load"].shape == (2, 4)


def test_the_dense_layers_compute_and_learn():
    cfg = deepseek_like()
    model = make_model(cfg)
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, 64, (2, 12)))
    before = model(tokens)[0]
    w = model.dense_layers.block.w_down
    w[...] = w[...] + 0.5
    assert float(jnp.max(jnp.abs(model(tokens)[0] - before))) > 1e-3

    grads = nnx.grad(lambda m: jnp.mean(m(tokens)[0] ** 2))(model)
    for path, var in nnx.to_flat_state(grads):
        if path[0] == "dense_layers":
            assert float(jnp.max(jnp.abs(var.get_value()))) > 0, path


@pytest.mark.parametrize("mla", [False, True])
def test_decoding_with_both_stacks_equals_the_whole_forward(mla):
    changes = (dict(mla=dict(kv_lora_rank=16, q_lora_rank=0, qk_nope_head_dim=8,
                             qk_rope_head_dim=4, v_head_dim=8)) if mla else {})
    model = make_model(deepseek_like(**changes))
    tokens = jnp.asarray(np.random.default_rng(2).integers(0, 64, (2, 10)))
    full, _ = model(tokens)
    cache = model.init_cache(2, 12)
    assert isinstance(cache, StackCaches)
    assert jax.tree.leaves(cache.dense)[0].shape[0] == 1
    assert jax.tree.leaves(cache.routed)[0].shape[0] == 2
    logits, aux = model(tokens[:, :4], cache=cache)
    pieces, cache = [logits], aux["cache"]
    for i in range(4, 10):
        logits, aux = model(tokens[:, i:i + 1], cache=cache, start=jnp.full((2,), i, jnp.int32))
        pieces.append(logits)
        cache = aux["cache"]
    np.testing.assert_allclose(np.asarray(jnp.concatenate(pieces, axis=1)), np.asarray(full),
                               rtol=1e-4, atol=2e-5)


@pytest.mark.parametrize("changes, needle", [
    (dict(first_dense_layers=3), "first_dense_layers=3 is invalid: expected an integer in "),
    (dict(first_dense_ffn_hidden=0), "first_dense_ffn_hidden=0"),
    (dict(block="dense"), "0 with block='dense'"),
    (dict(block="doe"), "0 with block='doe'")])
def test_dense_layers_that_cannot_be_are_one_line(changes, needle):
    with pytest.raises(ValueError, match=needle.replace("(", r"\(").replace("[", r"\[")):
        deepseek_like(**changes)


def test_a_model_with_dense_layers_is_not_exported_as_mixtral():
    from dagmoe_jax.hf.export import hf_family
    cfg = deepseek_like().replace(block=dict(router=dict(score_fn="softmax", renormalize=True),
                                             experts=dict(num_shared=0, dispatch="dropless")))
    with pytest.raises(ValueError, match="ModelConfig.first_dense_layers=1 cannot be exported"):
        hf_family(cfg)
