"""DeepSeek's routers in transformers (``DeepseekV2TopkRouter``, ``DeepseekV3TopkRouter``)
against :class:`dagmoe_jax.model.routed.router.Router` with the same weights: the same experts and
gates per token (group-limited selection, the correction bias, renormalisation and
``routed_scaling_factor``). Peer test: skipped without torch and transformers
(``benchmarks/requirements-peer.txt``); tests/test_router.py checks the same against a
plain-Python transcription on every machine."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from dagmoe_jax.config import RouterConfig  # noqa: E402
from dagmoe_jax.model.routed.router import Router  # noqa: E402

SIZES = dict(hidden_size=16, num_attention_heads=2, num_key_value_heads=2, vocab_size=32,
             num_hidden_layers=1, n_routed_experts=16, num_experts_per_tok=4, n_group=4,
             topk_group=2)


def peer(version: int):
    """transformers' router of DeepSeek-V2 (softmax, group-limited greedy, scale 16) or V3
    (sigmoid, correction bias, top-2-sum groups, renormalised, scale 2.5), random weights."""
    torch.manual_seed(version)
    if version == 2:
        from transformers.models.deepseek_v2 import modeling_deepseek_v2 as m
        cfg = transformers.DeepseekV2Config(**SIZES, topk_method="group_limited_greedy",
                                            routed_scaling_factor=16.0)
        router = m.DeepseekV2TopkRouter(cfg)
    else:
        from transformers.models.deepseek_v3 import modeling_deepseek_v3 as m
        cfg = transformers.DeepseekV3Config(**SIZES, routed_scaling_factor=2.5,
                                            norm_topk_prob=True)
        router = m.DeepseekV3TopkRouter(cfg)
        with torch.no_grad():
            router.e_score_correction_bias.copy_(0.2 * torch.randn(16))
    with torch.no_grad():
        router.weight.copy_(torch.randn(16, 16))
    return router


def ours(version: int, weight: np.ndarray, bias=None) -> Router:
    cfg = RouterConfig(top_k=4, score_fn="softmax" if version == 2 else "sigmoid",
                       renormalize=version == 3, n_group=4, topk_group=2,
                       group_score="max" if version == 2 else "top2_sum",
                       routed_scaling_factor=16.0 if version == 2 else 2.5,
                       aux_free_bias_rate=0.001 if version == 3 else 0.0)
    router = Router(cfg, 16, 16, std=0.02, rngs=nnx.Rngs(0))
    router.w_router[...] = jnp.asarray(weight.T)
    if bias is not None:
        router.selection_bias[...] = jnp.asarray(bias)
    return router


@pytest.mark.parametrize("version", [2, 3])
def test_deepseek_routers_choose_and_weigh_as_transformers(version):
    theirs = peer(version)
    bias = (theirs.e_score_correction_bias.numpy() if version == 3 else None)
    mine = ours(version, theirs.weight.detach().numpy(), bias)
    x = np.random.default_rng(version).standard_normal((64, 16)).astype(np.float32)
    with torch.no_grad():
        _, weights, indices = theirs(torch.as_tensor(x))
    routing = mine(jnp.asarray(x))
    for t in range(64):
        want = dict(zip(indices[t].tolist(), weights[t].tolist()))
        got = dict(zip(np.asarray(routing.indices[t]).tolist(),
                       np.asarray(routing.gates[t]).tolist()))
        assert got.keys() == want.keys(), (t, got, want)
        np.testing.assert_allclose([got[i] for i in want], list(want.values()), rtol=1e-5)
