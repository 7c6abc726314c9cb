"""Hugging Face interop against the real client: ``transformers`` and ``torch`` (an optional
extra, ``pip install -r benchmarks/requirements-peer.txt``; these tests skip without them,
and tests/test_hf_llama.py checks the same import against a NumPy Llama).

Tiny Llamas made and saved by ``transformers`` itself (untied, tied, GQA, llama3 RoPE scaling
in its own ``rope_parameters`` layout, bfloat16, sharded) are imported and their logits
compared; the library's exports are loaded by ``LlamaForCausalLM.from_pretrained`` and
compared; and 20 greedy tokens agree on both sides. ``python tests/test_hf_transformers.py``
prints the measured agreement (benchmarks/RESULTS.md).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from dagmoe_jax.decoding.generate import generate  # noqa: E402
from dagmoe_jax.hf import export as hf_export, llama as hf_llama  # noqa: E402

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 16}
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
        "beta_fast": 4.0, "beta_slow": 0.5, "mscale": 0.707, "mscale_all_dim": 0.3}
CASES = {
    "untied": dict(),
    "tied": dict(tie_word_embeddings=True),
    "llama3 scaling": dict(rope_parameters={**LLAMA3, "rope_theta": 10000.0}),
    # DeepSeek's YaRN terms (its checkpoints' mscale pair), a context ratio equal to the factor
    "yarn scaling": dict(rope_parameters={**YARN, "rope_theta": 10000.0}),
    "bfloat16": dict(dtype="bfloat16"),
    "sharded": dict(shard="20KB"),
}


def tiny_llama(seed: int = 0, tie_word_embeddings: bool = False, rope_parameters=None):
    """A random 2-layer GQA Llama (4 heads over 2 KV heads) made by transformers."""
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(
        vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        rms_norm_eps=1e-5, tie_word_embeddings=tie_word_embeddings,
        rope_parameters=rope_parameters or {"rope_type": "default", "rope_theta": 10000.0},
        bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():                 # random norms too, so every tensor matters
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
    return model


def torch_logits(model, tokens: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.as_tensor(tokens)).logits.float().numpy()


def relative_gap(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def import_case(name: str, folder: Path) -> float:
    """Save the case's model with transformers, import it, and the logits' relative gap."""
    spec = dict(CASES[name])
    dtype, shard = spec.pop("dtype", None), spec.pop("shard", None)
    model = tiny_llama(**spec)
    saved = model.to(torch.bfloat16) if dtype == "bfloat16" else model
    saved.save_pretrained(folder, safe_serialization=True,
                          **({"max_shard_size": shard} if shard else {}))
    reference = transformers.LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32)
    ours, cfg = hf_llama.load_hf_llama(folder)
    if spec.get("rope_parameters"):
        assert cfg.rope_scaling.kind == spec["rope_parameters"]["rope_type"]
    if shard:
        assert (folder / hf_llama.INDEX_FILE).is_file()
    tokens = np.random.default_rng(1).integers(0, 96, (2, 40))      # past the 16 original
    return relative_gap(np.asarray(ours(tokens)[0]), torch_logits(reference, tokens))


@pytest.mark.parametrize("name", sorted(CASES))
def test_transformers_checkpoints_import_with_their_logits(tmp_path, name):
    # bfloat16: both sides compute in float32 from the same bf16-rounded weights
    assert import_case(name, tmp_path / "hf") < 1e-5


def export_gap(folder: Path, rope=LLAMA3) -> float:
    model = tiny_llama(seed=3, rope_parameters={**rope, "rope_theta": 5e5})
    model.save_pretrained(folder / "in", safe_serialization=True)
    ours, _ = hf_llama.load_hf_llama(folder / "in")
    out = hf_export.export_hf(ours, folder / "out")
    back = transformers.LlamaForCausalLM.from_pretrained(out, dtype=torch.float32)
    tokens = np.random.default_rng(2).integers(0, 96, (2, 40))
    return relative_gap(torch_logits(back, tokens), np.asarray(ours(tokens)[0]))


@pytest.mark.parametrize("rope", [LLAMA3, YARN], ids=["llama3", "yarn"])
def test_exports_load_in_transformers_with_the_same_logits(tmp_path, rope):
    assert export_gap(tmp_path, rope) < 1e-5


def greedy_pair(folder: Path):
    model = tiny_llama(seed=5)
    model.save_pretrained(folder, safe_serialization=True)
    ours, _ = hf_llama.load_hf_llama(folder)
    prompt = [1, 17, 42, 9, 88, 3]
    mine = generate(ours, [prompt], max_new_tokens=20)[0]
    with torch.no_grad():
        theirs = model.generate(torch.as_tensor([prompt]), max_new_tokens=20, do_sample=False,
                                eos_token_id=None, pad_token_id=0, min_new_tokens=20)
    return mine, theirs[0, len(prompt):].tolist()


def test_twenty_greedy_tokens_agree(tmp_path):
    mine, theirs = greedy_pair(tmp_path)
    assert len(mine) == 20 and mine == theirs


MOE_FIXTURES = Path(__file__).resolve().parent / "fixtures" / "hf_moe"


def tiny_moe(family: str, seed: int = 0, **overrides):
    """A random 2-layer MoE of ``family`` (8 experts, top 2, GQA) made by transformers' own
    class, its norm scales away from 1; ``overrides``: config fields to set instead."""
    torch.manual_seed(seed)
    common = dict(vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-6,
                  num_experts_per_tok=2, bos_token_id=None, eos_token_id=None,
                  pad_token_id=None)
    cls, config, fields = {
        "mixtral": (transformers.MixtralForCausalLM, transformers.MixtralConfig,
                    dict(intermediate_size=24, num_local_experts=8)),
        "olmoe": (transformers.OlmoeForCausalLM, transformers.OlmoeConfig,
                  dict(intermediate_size=24, num_experts=8, norm_topk_prob=True)),
        "qwen3_moe": (transformers.Qwen3MoeForCausalLM, transformers.Qwen3MoeConfig,
                      dict(head_dim=16, intermediate_size=48, moe_intermediate_size=24,
                           num_experts=8, norm_topk_prob=False)),
    }[family]
    model = cls(config(**{**common, **fields, **overrides})).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
    return model


def moe_gaps(family: str, folder: Path):
    """A family's model saved by transformers, imported, exported again and loaded by
    transformers: (import gap, export gap) of the logits, relative to transformers'."""
    model = tiny_moe(family)
    model.save_pretrained(folder / family)
    ours, _ = hf_llama.load_hf_llama(folder / family)
    tokens = np.random.default_rng(0).integers(0, 96, size=(2, 24))
    got = ours(tokens.astype(np.int32))
    got = np.asarray(got[0] if isinstance(got, tuple) else got)
    back = transformers.AutoModelForCausalLM.from_pretrained(
        hf_export.export_hf(ours, folder / "export")).eval()
    assert type(back) is type(model)
    want = torch_logits(model, tokens)
    return relative_gap(got, want), relative_gap(torch_logits(back, tokens), want)


@pytest.mark.parametrize("family", ["mixtral", "olmoe", "qwen3_moe"])
def test_a_transformers_moe_imports_at_its_logits(family, tmp_path):
    """Each MoE family saved by transformers imports to its logits (float32) and exports to a
    folder transformers loads as the same class with the same logits, and the folders
    tests/test_hf_moe.py checks in CI hold what transformers computes today."""
    imported, exported = moe_gaps(family, tmp_path)
    assert imported < 1e-5 and exported < 1e-5, (imported, exported)
    fixture = transformers.AutoModelForCausalLM.from_pretrained(MOE_FIXTURES / family).eval()
    np.testing.assert_allclose(torch_logits(fixture, np.load(MOE_FIXTURES / "ids.npy")),
                               np.load(MOE_FIXTURES / family / "logits.npy"), rtol=0, atol=1e-6)


if __name__ == "__main__":           # the agreement table of benchmarks/RESULTS.md
    import tempfile
    with tempfile.TemporaryDirectory() as tmp:
        print(f"transformers {transformers.__version__}, torch {torch.__version__}")
        print(f"{'case':<16}{'max |ours - theirs| / max |theirs|':>36}")
        for case in CASES:
            print(f"{case:<16}{import_case(case, Path(tmp) / case):>36.2e}")
        print(f"{'export':<16}{export_gap(Path(tmp) / 'export'):>36.2e}")
        for family in ("mixtral", "olmoe", "qwen3_moe"):
            gaps = moe_gaps(family, Path(tmp) / family)
            print(f"{family:<16}{gaps[0]:>36.2e}  (export, loaded by transformers: "
                  f"{gaps[1]:.2e})")
        mine, theirs = greedy_pair(Path(tmp) / "greedy")
        print(f"20 greedy tokens equal: {mine == theirs}")
    sys.exit(0)
