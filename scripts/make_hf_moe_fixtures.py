"""Write tests/fixtures/hf_moe/: a tiny Mixtral, OLMoE and Qwen3-MoE made by transformers.

    pip install torch transformers safetensors     # any Python: not the library's environment
    python scripts/make_hf_moe_fixtures.py

For each family: a random model built with transformers' own class and saved with
``save_pretrained`` (``config.json``, ``model.safetensors``), and ``logits.npy``: its float32
logits for the ids in ``ids.npy``. ``tests/test_hf_moe.py`` imports each folder and compares
the library's logits with these, so the mapping is checked in CI without torch (the same
comparison against transformers itself, where torch is installed, is in
``tests/test_hf_transformers.py``). Made with torch 2.13.0 (CPU) and transformers 5.23.0.
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


def main() -> int:
    import torch

    torch.manual_seed(0)
    for name, (cls, config) in families().items():
        model = cls(config).eval()
        with torch.no_grad():      # norms away from 1, so the q/k norm mapping is tested
            for pname, param in model.named_parameters():
                if "norm" in pname:
                    param.uniform_(0.5, 1.5)
            logits = model(torch.tensor(IDS)).logits.numpy().astype(np.float32)
        folder = OUT / name
        model.save_pretrained(folder)
        np.save(folder / "logits.npy", logits)
        np.save(OUT / "ids.npy", IDS)
        print(f"{folder}: logits {logits.shape}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
