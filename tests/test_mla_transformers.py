"""MLA against transformers' own ``DeepseekV3Attention`` (DeepSeek's interleaved RoPE layout,
YaRN with DeepSeek's mscale) on the same weights: the same outputs to 1e-5. Peer test:
skipped without torch and transformers; tests/test_mla.py checks the same equations against
NumPy on every machine."""

from __future__ import annotations

import numpy as np
import pytest
import jax.numpy as jnp
from flax import nnx

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from conftest import make_model  # noqa: E402
from dagmoe_jax.config import MLAConfig, ModelConfig, RopeScalingConfig  # noqa: E402
from dagmoe_jax.model.attention import rope_angles  # noqa: E402
from dagmoe_jax.model.mla import MLAttention  # noqa: E402

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
        "beta_fast": 4.0, "beta_slow": 0.5, "mscale": 0.9, "mscale_all_dim": 0.9,
        "rope_theta": 10000.0}


def deinterleave(n: int) -> np.ndarray:
    """DeepSeek's RoPE pairs (x0, x1), (x2, x3), ... as the half-split layout's halves:
    the even dimensions, then the odd ones."""
    return np.concatenate([np.arange(0, n, 2), np.arange(1, n, 2)])


def mla_weights(attn, cfg) -> dict:
    """The library's MLA parameters of a transformers ``DeepseekV3Attention``: Linear weights
    transposed, heads split out, every RoPE block de-interleaved."""
    m, h, d = cfg.mla, cfg.num_heads, cfg.d_model
    t = lambda lin: lin.weight.detach().numpy().T       # noqa: E731
    q_perm = np.concatenate([np.arange(m.qk_nope_head_dim),
                             m.qk_nope_head_dim + deinterleave(m.qk_rope_head_dim)])
    out = {"w_kv_a": t(attn.kv_a_proj_with_mqa)[:, np.concatenate([
               np.arange(m.kv_lora_rank), m.kv_lora_rank + deinterleave(m.qk_rope_head_dim)])],
           "kv_a_norm": attn.kv_a_layernorm.weight.detach().numpy(),
           "w_kv_b": t(attn.kv_b_proj).reshape(m.kv_lora_rank, h, -1),
           "w_o": t(attn.o_proj).reshape(h, m.v_head_dim, d)}
    if m.q_lora_rank:
        out.update(w_q_a=t(attn.q_a_proj), q_a_norm=attn.q_a_layernorm.weight.detach().numpy(),
                   w_q_b=t(attn.q_b_proj).reshape(m.q_lora_rank, h, -1)[..., q_perm])
    else:
        out["w_q"] = t(attn.q_proj).reshape(d, h, -1)[..., q_perm]
    return out


@pytest.mark.parametrize("q_lora_rank", [12, None])
def test_mla_equals_transformers_deepseek_v3_attention(q_lora_rank):
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as dsv3
    torch.manual_seed(0)
    hf = transformers.DeepseekV3Config(
        hidden_size=32, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=q_lora_rank,
        kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6,
        max_position_embeddings=64, rope_parameters=YARN, rms_norm_eps=1e-6,
        vocab_size=32, num_hidden_layers=1, attn_implementation="eager")
    attn = dsv3.DeepseekV3Attention(hf, 0).eval()
    with torch.no_grad():
        for name, p in attn.named_parameters():
            p.copy_((1.0 if "layernorm" in name else 0.0) + 0.3 * torch.randn_like(p))
    rotary = dsv3.DeepseekV3RotaryEmbedding(hf)
    x = torch.randn(2, 24, 32)
    positions = torch.arange(24)[None].expand(2, -1)
    mask = torch.full((24, 24), float("-inf")).triu(1)[None, None].expand(2, 1, 24, 24)
    with torch.no_grad():
        want = attn(x, rotary(x, positions), mask)[0].numpy()

    cfg = ModelConfig(vocab_size=32, d_model=32, num_layers=1, num_heads=4, num_kv_heads=4,
                      max_seq_len=64, norm_eps=1e-6, rope_theta=10000.0,
                      rope_scaling=RopeScalingConfig(kind="yarn", factor=4.0,
                                                     original_max_position=16, beta_fast=4.0,
                                                     beta_slow=0.5, mscale=0.9,
                                                     mscale_all_dim=0.9),
                      mla=MLAConfig(kv_lora_rank=16, q_lora_rank=q_lora_rank or 0,
                                    qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6),
                      block="dense")
    ours = MLAttention(cfg, make_model(cfg).execution, rngs=nnx.Rngs(0))
    for name, value in mla_weights(attn, cfg).items():
        getattr(ours, name)[...] = jnp.asarray(value)
    sin, cos = rope_angles(jnp.arange(24)[None], cfg.rope_dim, cfg.rope_theta, cfg.rope_scaling)
    got = np.asarray(ours(jnp.asarray(x.numpy()), sin, cos)[0])
    gap = float(np.max(np.abs(got - want)) / np.max(np.abs(want)))
    assert gap < 1e-5, gap
