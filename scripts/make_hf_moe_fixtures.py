"""Write tests/fixtures/hf_moe/: a tiny Mixtral, OLMoE, Qwen3-MoE, DeepSeek-V2 and DeepSeek-V3
made by transformers.

    pip install torch transformers safetensors     # any Python: not the library's environment
    python scripts/make_hf_moe_fixtures.py [FAMILY ...]     # default: all of them

For each family: a random model built with transformers' own class and saved with
``save_pretrained`` (``config.json``, ``model.safetensors``), and ``logits.npy``: its float32
logits for the ids in ``ids.npy``. ``tests/test_hf_moe.py`` imports each folder and compares
the library's logits with these, so the mapping is checked in CI without torch (the same
comparison against transformers itself, where torch is installed, is in
``tests/test_hf_transformers.py``). Made with torch 2.13.0 (CPU) and transformers 5.23.0; the
two DeepSeek folders with torch 2.15.0, each from its own seed, their routers' weights and V3's
correction bias drawn large enough that the groups and the bias decide the routing, and YaRN
RoPE (tests/test_hf_deepseek.py; tests/test_hf_deepseek_transformers.py in-process).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

OUT = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "hf_moe"
COMMON = dict(vocab_size=259, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
              num_key_value_heads=1, max_position_embeddings=64, rms_norm_eps=1e-6,
              bos_token_id=None, eos_token_id=None, pad_token_id=None)
IDS = np.array([[5, 17, 200, 3, 9, 258, 0, 25, 7, 12], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]], np.int64)


def families():
    from transformers import (MixtralConfig, MixtralForCausalLM, OlmoeConfig, OlmoeForCausalLM,
                              Qwen3MoeConfig, Qwen3MoeForCausalLM)
    return {
        "mixtral": (MixtralForCausalLM, MixtralConfig(
            **COMMON, intermediate_size=8, num_local_experts=4, num_experts_per_tok=2)),
        "olmoe": (OlmoeForCausalLM, OlmoeConfig(
            **COMMON, intermediate_size=8, num_experts=4, num_experts_per_tok=2,
            norm_topk_prob=False)),
        "qwen3_moe": (Qwen3MoeForCausalLM, Qwen3MoeConfig(
            **COMMON, head_dim=8, intermediate_size=24, moe_intermediate_size=8, num_experts=4,
            num_experts_per_tok=2, norm_topk_prob=True)),
    }


DEEPSEEK = dict(COMMON, num_hidden_layers=3, num_key_value_heads=2, first_k_dense_replace=1,
                intermediate_size=24, moe_intermediate_size=8, n_routed_experts=8,
                n_shared_experts=2, num_experts_per_tok=2, n_group=4, topk_group=2,
                kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6)


def deepseek_families():
    from transformers import (DeepseekV2Config, DeepseekV2ForCausalLM, DeepseekV3Config,
                              DeepseekV3ForCausalLM)
    yarn = dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=16,
                beta_fast=4.0, beta_slow=0.5, rope_theta=10000.0)
    return {    # V2: no query compression (V2-Lite); V3: queries through their latent
        "deepseek_v2": (DeepseekV2ForCausalLM, DeepseekV2Config(
            **DEEPSEEK, q_lora_rank=None, topk_method="group_limited_greedy",
            routed_scaling_factor=1.5, rope_parameters=dict(yarn, mscale=0.707,
                                                            mscale_all_dim=0.707))),
        "deepseek_v3": (DeepseekV3ForCausalLM, DeepseekV3Config(
            **DEEPSEEK, q_lora_rank=12, routed_scaling_factor=2.5, norm_topk_prob=True,
            rope_parameters=dict(yarn, mscale=1.0, mscale_all_dim=1.0))),
    }


def perturb(model, deepseek: bool) -> None:
    """Norm scales away from 1 (so their mapping is tested); DeepSeek's router weights of
    unit scale and V3's correction bias at 0.2 (so the groups and the bias pick experts)."""
    import torch
    with torch.no_grad():
        for pname, param in model.named_parameters():
            if "norm" in pname:
                param.uniform_(0.5, 1.5)
            elif deepseek and pname.endswith("mlp.gate.weight"):
                param.normal_(0.0, 1.0)
        for bname, buffer in model.named_buffers():
            if bname.endswith("e_score_correction_bias"):
                buffer.normal_(0.0, 0.2)


def main() -> int:
    import torch

    wanted = set(sys.argv[1:])
    torch.manual_seed(0)
    made = {**families(), **deepseek_families()}
    for seed, (name, (cls, config)) in enumerate(made.items()):
        if wanted and name not in wanted:
            continue
        if name.startswith("deepseek"):     # its own seed: the others' stream stays as made
            torch.manual_seed(seed)
        model = cls(config).eval()
        perturb(model, name.startswith("deepseek"))
        with torch.no_grad():
            logits = model(torch.tensor(IDS)).logits.numpy().astype(np.float32)
        folder = OUT / name
        model.save_pretrained(folder)
        np.save(folder / "logits.npy", logits)
        np.save(OUT / "ids.npy", IDS)
        print(f"{folder}: logits {logits.shape}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
