"""Hugging Face Llama import/export (dagmoe_jax/hf/llama.py) against a NumPy Llama.

The reference forward pass below is written from the Llama equations as Hugging Face's
``modeling_llama`` computes them (RMSNorm, rotate-half RoPE, repeat_kv grouped-query attention,
SwiGLU MLP, [out, in] linear weights), on the raw checkpoint tensors: it shares no code with the
library's model.
"""

from __future__ import annotations

import json
import math

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file

from dagmoe_jax.model.attention import rope_inv_freq
from dagmoe_jax.config import RopeScalingConfig
from dagmoe_jax.hf import export as hf_export, llama as hf_llama, rope as hf_rope

HF = dict(model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=64, hidden_size=32,
          intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
          num_key_value_heads=2, head_dim=12, hidden_act="silu", max_position_embeddings=64,
          rms_norm_eps=1e-5, rope_theta=10000.0, attention_bias=False, mlp_bias=False,
          tie_word_embeddings=False)
LLAMA3 = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
              original_max_position_embeddings=16)
# YaRN with DeepSeek's two attention-factor terms, bounds chosen so that head_dim 12's six
# pairs fall in all three regimes (kept, ramped, interpolated); and YaRN's plain temperature
# with untruncated bounds.
YARN = dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=64, beta_fast=2.0,
            beta_slow=0.25, mscale=0.707, mscale_all_dim=0.3)
YARN_PLAIN = dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=16,
                  beta_fast=2.0, beta_slow=0.5, truncate=False)


def random_checkpoint(hf: dict, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    d, f, v = hf["hidden_size"], hf["intermediate_size"], hf["vocab_size"]
    h, kv, hd = hf["num_attention_heads"], hf["num_key_value_heads"], hf["head_dim"]
    w = lambda *shape: (0.2 * rng.standard_normal(shape)).astype(np.float32)
    t = {"model.embed_tokens.weight": w(v, d), "model.norm.weight": 1 + w(d)}
    if not hf["tie_word_embeddings"]:
        t["lm_head.weight"] = w(v, d)
    for i in range(hf["num_hidden_layers"]):
        p = f"model.layers.{i}."
        t.update({p + "input_layernorm.weight": 1 + w(d),
                  p + "post_attention_layernorm.weight": 1 + w(d),
                  p + "self_attn.q_proj.weight": w(h * hd, d),
                  p + "self_attn.k_proj.weight": w(kv * hd, d),
                  p + "self_attn.v_proj.weight": w(kv * hd, d),
                  p + "self_attn.o_proj.weight": w(d, h * hd),
                  p + "mlp.gate_proj.weight": w(f, d), p + "mlp.up_proj.weight": w(f, d),
                  p + "mlp.down_proj.weight": w(d, f)})
    return t


def write_checkpoint(path, hf: dict, tensors: dict, dtype=np.float32):
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(hf))
    save_file({k: v.astype(dtype) for k, v in tensors.items()}, str(path / "model.safetensors"),
              metadata={"format": "pt"})


def llama3_inv_freq_reference(inv_freq, factor, low, high, old):
    """The llama3 RoPE scaling, element by element (Llama 3.1's reference code)."""
    out = []
    for f in inv_freq:
        wavelen = 2 * math.pi / f
        if wavelen < old / high:
            out.append(f)
        elif wavelen > old / low:
            out.append(f / factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append((1 - smooth) * f / factor + smooth * f)
    return np.array(out)


def yarn_reference(inv_freq, rs: dict, theta: float):
    """YaRN's frequencies and attention factor, transcribed from Hugging Face's
    ``_compute_yarn_parameters`` line by line (math and loops, no vector code)."""
    dim, factor = 2 * len(inv_freq), rs["factor"]
    old = rs["original_max_position_embeddings"]

    def get_mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0
    if rs.get("attention_factor"):
        attention = rs["attention_factor"]
    elif rs.get("mscale") and rs.get("mscale_all_dim"):
        attention = get_mscale(factor, rs["mscale"]) / get_mscale(factor, rs["mscale_all_dim"])
    else:
        attention = get_mscale(factor)

    def correction_dim(rotations):
        return dim * math.log(old / (rotations * 2 * math.pi)) / (2 * math.log(theta))
    low, high = correction_dim(rs.get("beta_fast", 32)), correction_dim(rs.get("beta_slow", 1))
    if rs.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    out = []
    for i, f in enumerate(inv_freq):
        ramp = min(max((i - low) / (high - low), 0.0), 1.0)
        extrapolation = 1 - ramp
        out.append(f / factor * (1 - extrapolation) + f * extrapolation)
    return np.array(out), attention


def numpy_llama(t: dict, hf: dict, tokens: np.ndarray) -> np.ndarray:
    """Llama's forward pass in float64 NumPy from the checkpoint tensors: logits [B, S, V]."""
    t = {k: np.asarray(v, np.float64) for k, v in t.items()}
    eps, hd = hf["rms_norm_eps"], hf["head_dim"]
    h_, kv = hf["num_attention_heads"], hf["num_key_value_heads"]
    b, s = tokens.shape
    inv_freq = 1.0 / hf["rope_theta"] ** (np.arange(0, hd, 2) / hd)
    rs = hf.get("rope_parameters") or hf.get("rope_scaling")
    attention = 1.0
    if rs and rs.get("rope_type") == "linear":
        inv_freq = inv_freq / rs["factor"]
    elif rs and rs.get("rope_type") == "yarn":
        inv_freq, attention = yarn_reference(inv_freq, rs, hf["rope_theta"])
    elif rs and rs.get("rope_type", "default") != "default":
        inv_freq = llama3_inv_freq_reference(inv_freq, rs["factor"], rs["low_freq_factor"],
                                             rs["high_freq_factor"],
                                             rs["original_max_position_embeddings"])
    freqs = np.arange(s)[:, None] * inv_freq[None]
    emb = np.concatenate([freqs, freqs], axis=-1)                       # [S, hd]
    cos, sin = (attention * np.cos(emb)[None, :, None], attention * np.sin(emb)[None, :, None])

    def rms(x, w):
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w

    def rotate_half(x):
        x1, x2 = x[..., : hd // 2], x[..., hd // 2:]
        return np.concatenate([-x2, x1], axis=-1)

    x = t["model.embed_tokens.weight"][tokens]
    mask = np.tril(np.ones((s, s), bool))
    for i in range(hf["num_hidden_layers"]):
        p = f"model.layers.{i}."
        y = rms(x, t[p + "input_layernorm.weight"])
        q = (y @ t[p + "self_attn.q_proj.weight"].T).reshape(b, s, h_, hd)
        k = (y @ t[p + "self_attn.k_proj.weight"].T).reshape(b, s, kv, hd)
        v = (y @ t[p + "self_attn.v_proj.weight"].T).reshape(b, s, kv, hd)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        k, v = np.repeat(k, h_ // kv, axis=2), np.repeat(v, h_ // kv, axis=2)   # repeat_kv
        scores = np.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(hd)
        scores = np.where(mask, scores, -np.inf)
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        o = np.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, s, h_ * hd)
        x = x + o @ t[p + "self_attn.o_proj.weight"].T
        y = rms(x, t[p + "post_attention_layernorm.weight"])
        g = y @ t[p + "mlp.gate_proj.weight"].T
        x = x + ((g / (1 + np.exp(-g))) * (y @ t[p + "mlp.up_proj.weight"].T)) \
            @ t[p + "mlp.down_proj.weight"].T
    x = rms(x, t["model.norm.weight"])
    head = t["model.embed_tokens.weight"] if hf["tie_word_embeddings"] else t["lm_head.weight"]
    return x @ head.T


def rope_parameters_layout(hf: dict) -> dict:
    """``hf`` as transformers 5 saves it: ``rope_theta`` and the scaling inside
    ``rope_parameters``, no ``rope_scaling`` and no top-level ``rope_theta``."""
    out = {k: v for k, v in hf.items() if k not in ("rope_scaling", "rope_theta")}
    out["rope_parameters"] = {"rope_type": "default", **(hf.get("rope_scaling") or {}),
                              "rope_theta": hf["rope_theta"]}
    return out


@pytest.mark.parametrize("dtype,tied,scaling", [("float32", False, True),
                                                ("bfloat16", True, False)])
def test_imported_logits_equal_numpy_llama(tmp_path, dtype, tied, scaling):
    hf = dict(HF, tie_word_embeddings=tied, rope_scaling=LLAMA3 if scaling else None)
    tensors = random_checkpoint(hf)
    np_dtype = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16}[dtype]
    write_checkpoint(tmp_path / "ckpt", hf, tensors, np_dtype)
    model, cfg = hf_llama.load_hf_llama(tmp_path / "ckpt")
    assert cfg.head_dim == 12 and cfg.block.ffn_hidden == 48 and cfg.norm_eps == 1e-5
    assert cfg.rope_scaling.kind == ("llama3" if scaling else "none")
    tokens = np.random.default_rng(1).integers(0, 64, (2, 24))   # longer than the 16 original
    got = np.asarray(model(tokens)[0])
    # the reference reads the same (rounded, for bfloat16) values the file holds
    stored = {k: v.astype(np_dtype).astype(np.float32) for k, v in tensors.items()}
    want = numpy_llama(stored, hf, tokens)
    np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-4)
    # and with plain RoPE the scaled checkpoint would differ: the scaling is really applied
    if scaling:
        plain = numpy_llama(stored, dict(hf, rope_scaling=None), tokens)
        assert np.max(np.abs(plain - want)) > 1e-3


@pytest.mark.parametrize("scaling", [LLAMA3, {"rope_type": "linear", "factor": 4.0},
                                     {"type": "llama3", **{k: v for k, v in LLAMA3.items()
                                                           if k != "rope_type"}},
                                     YARN, YARN_PLAIN])
def test_every_rope_layout_imports_its_scaling(tmp_path, scaling):
    """transformers 5's ``rope_parameters`` and 4.x's ``rope_scaling`` (with ``rope_type`` or
    the older ``type``) give the same model, and its logits follow the scaling: a
    ``rope_parameters`` config once lost its scaling without a word (0.8 of the logits' range
    off for a llama3 model)."""
    legacy = dict(HF, rope_scaling=scaling)
    new = rope_parameters_layout(dict(HF, rope_scaling={
        "rope_type": scaling.get("rope_type", scaling.get("type")),
        **{k: v for k, v in scaling.items() if k not in ("rope_type", "type")}}))
    assert "rope_scaling" not in new and "rope_theta" not in new
    cfg_legacy = hf_llama.model_config_from_hf(legacy)
    assert hf_llama.model_config_from_hf(new) == cfg_legacy
    assert cfg_legacy.rope_scaling.kind == new["rope_parameters"]["rope_type"] != "none"
    tensors = random_checkpoint(new)
    write_checkpoint(tmp_path / "ckpt", new, tensors)
    model, _ = hf_llama.load_hf_llama(tmp_path / "ckpt")
    tokens = np.random.default_rng(1).integers(0, 64, (2, 24))
    want = numpy_llama(tensors, dict(new, rope_theta=HF["rope_theta"]), tokens)
    np.testing.assert_allclose(np.asarray(model(tokens)[0]), want, rtol=2e-4, atol=2e-4)
    plain = numpy_llama(tensors, dict(HF, rope_scaling=None), tokens)
    assert np.max(np.abs(plain - want)) > 1e-3              # the scaling is really applied
    # export writes both layouts, and each reads back as the same model
    out = hf_export.export_hf(model, tmp_path / "out")
    back = json.loads((out / "config.json").read_text())
    assert back["rope_parameters"]["rope_type"] == cfg_legacy.rope_scaling.kind
    assert back["rope_scaling"]["rope_type"] == cfg_legacy.rope_scaling.kind
    for layout in (back, {k: v for k, v in back.items() if k != "rope_parameters"},
                   {k: v for k, v in back.items() if k not in ("rope_scaling", "rope_theta")}):
        assert hf_llama.model_config_from_hf(layout).replace(
            max_seq_len=cfg_legacy.max_seq_len) == cfg_legacy


def test_export_round_trip_sharded_and_bfloat16(tmp_path):
    hf = dict(HF, rope_scaling=LLAMA3)
    tensors = random_checkpoint(hf, seed=3)
    write_checkpoint(tmp_path / "in", hf, tensors)
    model, _ = hf_llama.load_hf_llama(tmp_path / "in")
    out = hf_export.export_hf(model, tmp_path / "out", max_shard_bytes=20_000)
    index = json.loads((out / hf_llama.INDEX_FILE).read_text())
    assert len(set(index["weight_map"].values())) > 1                 # really sharded
    reader = hf_llama.SafetensorsReader(out)
    assert sorted(reader.keys()) == sorted(tensors)
    for name, value in tensors.items():
        np.testing.assert_array_equal(reader[name], value)
    back = json.loads((out / "config.json").read_text())
    for key in ("hidden_size", "intermediate_size", "head_dim", "rope_theta", "rms_norm_eps",
                "num_key_value_heads", "tie_word_embeddings", "rope_scaling"):
        assert back[key] == hf[key], key
    # a bfloat16 export holds the bfloat16 rounding of every tensor, tied heads stay tied
    tied_hf = dict(HF, tie_word_embeddings=True)
    write_checkpoint(tmp_path / "tied", tied_hf, random_checkpoint(tied_hf, seed=4))
    tied, _ = hf_llama.load_hf_llama(tmp_path / "tied")
    out16 = hf_export.export_hf(tied, tmp_path / "out16", dtype="bfloat16")
    r16 = hf_llama.SafetensorsReader(out16)
    assert "lm_head.weight" not in r16
    assert json.loads((out16 / "config.json").read_text())["tie_word_embeddings"] is True
    emb = r16["model.embed_tokens.weight"]
    assert emb.dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(
        emb, np.asarray(tied.embed[...]).astype(ml_dtypes.bfloat16))


def test_a_library_config_exported_and_imported_is_the_same_config():
    """Widths that are the defaults come back as the defaults (head_dim None, not d / h; the
    dense FFN's None, not 8/3 d rounded), so a run and its own export compare equal
    (DUME's architecture check, upcycle/moerge.py)."""
    from conftest import tiny_config
    from dagmoe_jax.upcycle import moerge
    for cfg in (tiny_config("dense", ffn_hidden=None),
                tiny_config("dense", head_dim=12, ffn_hidden=48)):
        back = hf_llama.model_config_from_hf(hf_export.hf_config_from_model(
            cfg, tie_word_embeddings=False))
        assert (back.head_dim, back.block) == (cfg.head_dim, cfg.block)
        moerge.check_same_architecture([cfg, back])


def test_yarn_rope_equals_its_formula():
    """YaRN's frequencies and attention factor against the line-by-line transcription, in
    every regime; DeepSeek-V3's own values (factor 40, mscale = mscale_all_dim = 1) give
    attention factor 1; factor 1 is plain RoPE."""
    from dagmoe_jax.model.attention import rope_angles, rope_attention_factor
    inv = 1.0 / 10000.0 ** (np.arange(0, 64, 2) / 64)
    for spec in (YARN, YARN_PLAIN, dict(YARN, attention_factor=1.3),
                 dict(rope_type="yarn", factor=40.0, original_max_position_embeddings=4096,
                      mscale=1.0, mscale_all_dim=1.0, beta_fast=32, beta_slow=1)):
        scaling = hf_rope.rope_from_hf(dict(HF, rope_scaling=spec))[1]
        want, attention = yarn_reference(inv, spec, 10000.0)
        np.testing.assert_allclose(rope_inv_freq(64, 10000.0, scaling), want, rtol=1e-6)
        assert rope_attention_factor(scaling) == pytest.approx(attention, rel=1e-12)
        kept, divided = np.isclose(want, inv), np.isclose(want, inv / spec["factor"])
        assert kept.any() and divided.any() and (~kept & ~divided).any()    # three regimes
    assert rope_attention_factor(scaling) == 1.0
    assert rope_attention_factor(hf_rope.rope_from_hf(dict(HF, rope_scaling=YARN))[1]) \
        == pytest.approx((0.1 * 0.707 * math.log(4) + 1) / (0.1 * 0.3 * math.log(4) + 1))
    one = RopeScalingConfig(kind="yarn", factor=1.0, original_max_position=64)
    np.testing.assert_allclose(rope_inv_freq(64, 10000.0, one), inv, rtol=1e-6)
    sin, cos = rope_angles(np.arange(8)[None], 64, 10000.0, one)
    sin0, cos0 = rope_angles(np.arange(8)[None], 64, 10000.0)
    np.testing.assert_array_equal(np.asarray(sin), np.asarray(sin0))
    np.testing.assert_array_equal(np.asarray(cos), np.asarray(cos0))


@pytest.mark.parametrize("entry, needle", [
    (dict(YARN, alpha=1.0), "rope_parameters.alpha"),
    ({k: v for k, v in YARN.items() if k != "factor"}, "lacks 'factor'"),
    (dict(YARN, truncate="yes"), "rope_parameters.truncate")])
def test_a_yarn_entry_we_would_misread_is_one_line(entry, needle):
    with pytest.raises(ValueError, match=needle):
        hf_rope.rope_from_hf(dict(HF, rope_parameters=entry))


def test_yarn_reads_its_context_as_transformers_does():
    """``original_max_position_embeddings`` top-level first, then the entry's, then
    ``max_position_embeddings``; a null factor is their ratio (DeepSeek-V3's note)."""
    bare = {k: v for k, v in YARN.items() if k != "original_max_position_embeddings"}
    read = lambda hf: hf_rope.rope_from_hf(hf)[1]
    assert read(dict(HF, rope_parameters=bare)).original_max_position == 64
    assert read(dict(HF, rope_parameters=YARN, original_max_position_embeddings=32)) \
        .original_max_position == 32
    assert read(dict(HF, rope_parameters=dict(YARN, factor=None,
                                              original_max_position_embeddings=16))).factor == 4


def test_llama3_rope_scaling_equals_its_formula():
    inv = 1.0 / 500000.0 ** (np.arange(0, 128, 2) / 128)
    scaling = RopeScalingConfig(kind="llama3", factor=8.0, low_freq_factor=1.0,
                                high_freq_factor=4.0, original_max_position=8192)
    got = rope_inv_freq(128, 500000.0, scaling)
    want = llama3_inv_freq_reference(inv, 8.0, 1.0, 4.0, 8192)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    wavelen = 2 * np.pi / inv
    # all three regimes occur: kept, divided by the factor, interpolated in between
    assert np.any(wavelen < 2048) and np.any(wavelen > 8192)
    assert np.any((wavelen > 2048) & (wavelen < 8192))
    np.testing.assert_allclose(got[wavelen < 2048], inv[wavelen < 2048], rtol=1e-6)
    np.testing.assert_allclose(got[wavelen > 8192], inv[wavelen > 8192] / 8, rtol=1e-6)
    np.testing.assert_allclose(rope_inv_freq(128, 500000.0), inv, rtol=1e-6)


@pytest.mark.parametrize("change,message", [
    (dict(model_type="mistral"), "model_type"),
    (dict(attention_bias=True), "attention_bias"),
    (dict(mlp_bias=True), "mlp_bias"),
    (dict(sliding_window=4096), "sliding_window"),
    (dict(hidden_act="gelu"), "hidden_act"),
    (dict(rope_scaling={"rope_type": "dynamic", "factor": 4.0}), "rope_scaling.rope_type"),
    (dict(rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}),
     "rope_parameters.rope_type"),
    (dict(rope_parameters={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                           "high_freq_factor": 4.0, "original_max_position_embeddings": 16,
                           "beta_fast": 32}), "rope_parameters.beta_fast"),
    (dict(rope_parameters={"rope_type": "linear", "factor": 2.0},
          rope_scaling={"rope_type": "linear", "factor": 4.0}), "rope_scaling.factor"),
    (dict(rope_parameters={"rope_type": "default", "rope_theta": 5e5}, rope_theta=1e4),
     "rope_theta"),
    (dict(partial_rotary_factor=0.5), "partial_rotary_factor"),
])
def test_unsupported_configs_name_the_field(change, message):
    with pytest.raises(ValueError, match=message) as err:
        hf_llama.model_config_from_hf(dict(HF, **change))
    assert "\n" not in str(err.value)


# The top-level fields of transformers 5.23's LlamaConfig().to_dict(), sorted.
LLAMA_CONFIG_FIELDS_5_23 = [
    "_name_or_path", "architectures", "attention_bias", "attention_dropout", "bos_token_id",
    "chunk_size_feed_forward", "dtype", "eos_token_id", "head_dim", "hidden_act", "hidden_size",
    "id2label", "initializer_range", "intermediate_size", "is_encoder_decoder", "label2id",
    "max_position_embeddings", "mlp_bias", "model_type", "num_attention_heads",
    "num_hidden_layers", "num_key_value_heads", "output_attentions", "output_hidden_states",
    "pad_token_id", "pretraining_tp", "problem_type", "return_dict", "rms_norm_eps",
    "rope_parameters", "tie_word_embeddings", "transformers_version", "use_cache",
    "vocab_size"]


def test_every_llama_config_field_is_read_or_known_harmless():
    """A field LlamaConfig has is either turned into the model (or checked) or listed as not
    changing the forward pass; a field the importer does not know is refused by name."""
    known = hf_llama.READ_FIELDS | hf_llama.NO_EFFECT_FIELDS
    assert not set(LLAMA_CONFIG_FIELDS_5_23) - known
    assert not hf_llama.READ_FIELDS & hf_llama.NO_EFFECT_FIELDS
    with pytest.raises(ValueError, match=r"field rope_interleaved=true is unknown") as err:
        hf_llama.model_config_from_hf(dict(HF, rope_interleaved=True))
    assert "\n" not in str(err.value)


def test_the_listed_fields_are_those_of_the_installed_transformers():
    """With transformers installed (an optional extra), its LlamaConfig has no field the list
    above lacks: a new field fails here before it can be ignored by the importer."""
    transformers = pytest.importorskip("transformers")
    fields = set(transformers.LlamaConfig().to_dict())
    assert not fields - set(LLAMA_CONFIG_FIELDS_5_23), sorted(fields - set(LLAMA_CONFIG_FIELDS_5_23))


def test_bad_checkpoints_are_one_line_errors(tmp_path):
    tensors = random_checkpoint(HF)
    # a bias tensor the config did not announce
    write_checkpoint(tmp_path / "bias", HF,
                     dict(tensors, **{"model.layers.0.self_attn.q_proj.bias": np.zeros(48)}))
    with pytest.raises(ValueError, match="q_proj.bias"):
        hf_llama.load_hf_llama(tmp_path / "bias")
    # a tensor of the wrong shape
    write_checkpoint(tmp_path / "shape", HF,
                     dict(tensors, **{"model.norm.weight": np.ones(31, np.float32)}))
    with pytest.raises(ValueError, match="model.norm.weight has shape"):
        hf_llama.load_hf_llama(tmp_path / "shape")
    # a shard listed by the index but absent
    (tmp_path / "sharded").mkdir()
    (tmp_path / "sharded" / "config.json").write_text(json.dumps(HF))
    (tmp_path / "sharded" / hf_llama.INDEX_FILE).write_text(json.dumps(
        {"weight_map": {name: "model-00002-of-00002.safetensors" for name in tensors}}))
    with pytest.raises(ValueError, match="model-00002-of-00002.safetensors .*missing"):
        hf_llama.load_hf_llama(tmp_path / "sharded")
    with pytest.raises(ValueError, match="config.json does not exist"):
        hf_llama.load_hf_llama(tmp_path / "nowhere")


def test_upcycle_command_reads_hugging_face_directories(tmp_path, capsys):
    from dagmoe_jax.upcycle import __main__ as cli
    from dagmoe_jax.upcycle.command import load_dense

    write_checkpoint(tmp_path / "hf", HF, random_checkpoint(HF))
    dense = load_dense(str(tmp_path / "hf"))
    assert dense.cfg.block.kind == "dense" and dense.data_cfg is None
    # without a tokenizer.json the command stops with one line naming it
    code = cli.main([f"--run_dir={tmp_path / 'out'}", f"--dense={tmp_path / 'hf'}",
                     "--source=text:x.txt"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and "tokenizer.json does not exist" in err[-1]


@pytest.fixture
def hf_tokenizer_json(tmp_path):
    """A small byte-level BPE tokenizer.json with two end tokens, trained offline."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(["a tiny corpus for a tiny tokenizer"] * 4, trainers.BpeTrainer(
        vocab_size=280, special_tokens=["<|endoftext|>", "<eot>", "<bos>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    path = tmp_path / "trained" / "tokenizer.json"
    path.parent.mkdir()
    tok.save(str(path))
    return path


def test_the_tokenizer_folder_of_an_imported_model_is_picked_up(tmp_path, hf_tokenizer_json):
    """An upcycled Hugging Face model's run reads the folder's tokenizer.json and takes its
    EOS from tokenizer_config.json (as transformers writes it: a dict with ``content``), so
    sampling and evaluation of the run need no tokenizer flags."""
    import types

    from dagmoe_jax.data import make_tokenizer
    from dagmoe_jax.upcycle import __main__ as cli

    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "tokenizer.json").write_text(hf_tokenizer_json.read_text())
    assert hf_llama.tokenizer_settings(folder) == {}
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": {"content": "<eot>", "special": True}, "bos_token": "<bos>"}))
    assert hf_llama.tokenizer_settings(folder) == {"eos_token": "<eot>", "bos_token": "<bos>"}
    args = types.SimpleNamespace(tokenizer_path="", dense=[str(folder)], seq_len=0,
                                 batch_size=0)
    data_cfg = cli._base_data(args, None)
    assert (data_cfg.tokenizer, data_cfg.eos_token) == ("hf", "<eot>")
    tok = make_tokenizer(data_cfg)
    assert tok.decode([tok.eos_id]) == "<eot>"
