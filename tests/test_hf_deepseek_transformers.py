"""DeepSeek-V2 and V3 folders written by transformers itself, imported at its logits and
exported to folders it loads at the same logits. Peer test: skipped without torch and
transformers (``benchmarks/requirements-peer.txt``); tests/test_hf_deepseek.py checks the
same import on transformers-made fixtures in CI."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from dagmoe_jax.hf import export as hf_export, llama as hf_llama  # noqa: E402

SIZES = dict(vocab_size=96, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=4, max_position_embeddings=64, rms_norm_eps=1e-6,
             first_k_dense_replace=1, intermediate_size=40, moe_intermediate_size=12,
             n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=3, n_group=4,
             topk_group=2, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4,
             v_head_dim=8, bos_token_id=None, eos_token_id=None, pad_token_id=None)
YARN = dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=16, beta_fast=4.0,
            beta_slow=0.5, mscale=0.9, mscale_all_dim=0.8, rope_theta=10000.0)
CASES = {
    "v2_greedy": ("DeepseekV2", dict(q_lora_rank=None, topk_method="greedy")),
    "v2_group_limited": ("DeepseekV2", dict(q_lora_rank=12, topk_method="group_limited_greedy",
                                            routed_scaling_factor=16.0, rope_parameters=YARN)),
    "v3": ("DeepseekV3", dict(q_lora_rank=12, routed_scaling_factor=2.5, norm_topk_prob=True,
                              rope_parameters=YARN)),
    "v3_half_split": ("DeepseekV3", dict(q_lora_rank=None, rope_interleave=False,
                                         norm_topk_prob=False)),
}


def made_by_transformers(case: str, folder: Path, seed: int = 0, sizes=None, **save):
    """The case's random model (``sizes``: its config's sizes, default ``SIZES``), its norms,
    router weights and correction bias away from their initial values, saved by
    ``save_pretrained`` (``save``: its options)."""
    torch.manual_seed(seed)
    name, fields = CASES[case]
    config = getattr(transformers, f"{name}Config")(**(sizes or SIZES), **fields,
                                                    attn_implementation="eager")
    model = getattr(transformers, f"{name}ForCausalLM")(config).eval()
    with torch.no_grad():
        for pname, param in model.named_parameters():
            if "norm" in pname:
                param.uniform_(0.5, 1.5)
            elif pname.endswith("mlp.gate.weight"):
                param.normal_(0.0, 1.0)
        for bname, buffer in model.named_buffers():
            if bname.endswith("e_score_correction_bias"):
                buffer.normal_(0.0, 0.2)
    model.save_pretrained(folder, **save)
    return model


def torch_logits(model, tokens: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.as_tensor(tokens)).logits.float().numpy()


def gap(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


@pytest.mark.parametrize("case", list(CASES))
def test_a_deepseek_imports_and_exports_at_transformers_logits(case, tmp_path):
    """Imported: transformers' logits to 1e-5 relative (float32). Exported again: a folder
    transformers loads as the same class with the same logits."""
    model = made_by_transformers(case, tmp_path / "hf")
    ours, _ = hf_llama.load_hf_llama(tmp_path / "hf")
    tokens = np.random.default_rng(0).integers(0, 96, size=(2, 24))
    want = torch_logits(model, tokens)
    got = ours(tokens.astype(np.int32))
    assert gap(np.asarray(got[0] if isinstance(got, tuple) else got), want) < 1e-5
    back = transformers.AutoModelForCausalLM.from_pretrained(
        hf_export.export_hf(ours, tmp_path / "export"), attn_implementation="eager").eval()
    assert type(back) is type(model)
    assert gap(torch_logits(back, tokens), want) < 1e-5


def test_sharded_bfloat16_deepseek_imports(tmp_path):
    """A V3 saved in bfloat16 across shards imports to transformers' bfloat16 model's logits
    (the weights are the same numbers; the computation float32 on our side)."""
    model = made_by_transformers("v3", tmp_path / "hf", max_shard_size="20KB")
    assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    model.to(torch.bfloat16).save_pretrained(tmp_path / "bf16", max_shard_size="20KB")
    ours, _ = hf_llama.load_hf_llama(tmp_path / "bf16")
    tokens = np.random.default_rng(1).integers(0, 96, size=(1, 16))
    want = torch_logits(model.float(), tokens)     # the bfloat16 weights, computed in float32
    got = ours(tokens.astype(np.int32))
    assert gap(np.asarray(got[0] if isinstance(got, tuple) else got), want) < 1e-5


def test_an_export_with_multi_token_prediction_loads_in_transformers(tmp_path):
    """A library model with MTP exports as a V3 folder transformers loads at the model's
    logits (it leaves the module, stored as a layer past the last, unloaded, as it does V3's
    layer 61)."""
    from test_hf_deepseek import deepseek_style_model

    ours, cfg = deepseek_style_model()
    folder = hf_export.export_hf(ours, tmp_path / "export")
    theirs = transformers.AutoModelForCausalLM.from_pretrained(
        folder, attn_implementation="eager").eval()
    assert type(theirs).__name__ == "DeepseekV3ForCausalLM"
    tokens = np.random.default_rng(2).integers(0, cfg.vocab_size, size=(2, 16))
    got = ours(tokens.astype(np.int32))[0]
    assert gap(torch_logits(theirs, tokens), np.asarray(got)) < 1e-5
