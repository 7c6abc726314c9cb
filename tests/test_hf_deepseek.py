"""Hugging Face DeepSeek-V2 and DeepSeek-V3 checkpoints in and out (dagmoe_jax/hf/deepseek.py).

The folders tests/fixtures/hf_moe/deepseek_v2 and deepseek_v3 were made by transformers itself
(scripts/make_hf_moe_fixtures.py: V2 with group-limited greedy routing and no query
compression, V3 with its correction bias, both with YaRN and a dense first layer), with the
logits transformers computed: the import must give the same logits, in CI without torch.
tests/test_hf_deepseek_transformers.py makes the same comparisons in-process where torch is
installed."""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
from flax import nnx

from dagmoe_jax.hf import deepseek
from dagmoe_jax.hf.export import export_hf, hf_config_from_model
from dagmoe_jax.hf.llama import (SafetensorsReader, load_hf_llama, model_config_from_hf,
                                 read_hf_config)
from dagmoe_jax.model.attention import apply_rope, rope_angles
from dagmoe_jax.model.params import variable

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "hf_moe"
VERSIONS = ("deepseek_v2", "deepseek_v3")


def logits_of(model, ids) -> np.ndarray:
    out = model(np.asarray(ids, np.int32))
    return np.asarray(out[0] if isinstance(out, tuple) else out)


@pytest.mark.parametrize("version", VERSIONS)
def test_a_deepseek_imports_at_transformers_logits(version):
    """MLA (V2 without query compression, V3 with), the interleaved RoPE columns, YaRN with
    DeepSeek's mscale, the dense first layer, the shared experts, V2's group-limited greedy
    and V3's biased top-2-sum groups reproduce transformers' logits."""
    model, cfg = load_hf_llama(FIXTURES / version)
    got = logits_of(model, np.load(FIXTURES / "ids.npy"))
    np.testing.assert_allclose(got, np.load(FIXTURES / version / "logits.npy"), rtol=0,
                               atol=1e-5)
    # transformers writes V3's num_nextn_predict_layers (1) but saves no module: none is read
    assert cfg.mtp.depth == 0 and read_hf_config(FIXTURES / version).get(
        "num_nextn_predict_layers", 0) == 0
    hf, r, e = read_hf_config(FIXTURES / version), cfg.block.router, cfg.block.experts
    assert (cfg.mla.kv_lora_rank, cfg.mla.q_lora_rank) == (8, hf["q_lora_rank"] or 0)
    assert (cfg.first_dense_layers, cfg.first_dense_ffn_hidden) == (1, 24)
    assert (e.num_experts, e.expert_hidden, e.num_shared, e.shared_hidden) == (8, 8, 2, 8)
    assert (r.n_group, r.topk_group, r.top_k) == (4, 2, 2)
    assert (r.score_fn, r.group_score, r.renormalize) == {
        "deepseek_v2": ("softmax", "max", False),
        "deepseek_v3": ("sigmoid", "top2_sum", True)}[version]
    assert r.routed_scaling_factor == hf["routed_scaling_factor"]
    assert cfg.rope_scaling.kind == "yarn" and cfg.rope_scaling.mscale_all_dim > 0
    assert (r.balance_scope, r.balance_load, r.z_loss_coef) == ("sequence", "slots", 0.0)


def test_the_correction_bias_is_the_selection_bias():
    """V3's e_score_correction_bias is read into the router's one selection bias (moved by
    fine-tuning at DeepSeek-V3's gamma); the checkpoint's differs from zero, so the routing
    above depended on it."""
    model, cfg = load_hf_llama(FIXTURES / "deepseek_v3")
    bias = np.asarray(variable(model, ("layers", "block", "router", "selection_bias"))[...])
    want = np.stack([SafetensorsReader(FIXTURES / "deepseek_v3")[
        f"model.layers.{i}.mlp.gate.e_score_correction_bias"] for i in (1, 2)])
    np.testing.assert_array_equal(bias, want)
    assert np.abs(want).max() > 0.1
    assert cfg.block.router.aux_free_bias_rate == deepseek.AUX_FREE_GAMMA


def test_interleaved_rope_is_the_half_split_rotation_of_reordered_columns(rng):
    """DeepSeek rotates pairs (x0, x1), (x2, x3), ... as complex numbers x_{2i} + i x_{2i+1}
    times e^{i theta_i p} (transformers' ``apply_rotary_emb``); the library rotates halves.
    Re-ordering the columns by :func:`rope_order` makes the two one computation: a NumPy
    transcription of the complex product against the library's RoPE."""
    n, positions = 8, np.arange(5)
    x = rng.standard_normal((1, 5, 1, n)).astype(np.float32)
    theta = 10000.0 ** (-np.arange(0, n, 2) / n)
    rotation = np.exp(1j * positions[:, None] * theta[None])            # [5, n/2]
    pairs = x[0, :, 0, 0::2] + 1j * x[0, :, 0, 1::2]
    turned = pairs * rotation
    want = np.stack([turned.real, turned.imag], -1).reshape(5, n)      # interleaved again
    order = deepseek.rope_order(n, pairs=True)
    sin, cos = rope_angles(positions[None], n, 10000.0)
    got = np.asarray(apply_rope(x[..., order], sin, cos))[0, :, 0]     # halves
    np.testing.assert_allclose(got, want[:, order], rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(deepseek.rope_order(n, pairs=False), np.arange(n))


@pytest.mark.parametrize("version", VERSIONS)
def test_a_deepseek_exports_back_to_its_own_folder(version, tmp_path):
    """export_hf writes each version in its own names: every tensor transformers saved comes
    back bit for bit (the RoPE columns interleaved again), the fields transformers reads are
    the folder's, and the export imports to the same model."""
    model, cfg = load_hf_llama(FIXTURES / version)
    out = export_hf(model, tmp_path / "out")
    theirs, ours = SafetensorsReader(FIXTURES / version), SafetensorsReader(out)
    assert sorted(ours.keys()) == sorted(theirs.keys())
    for name in theirs.keys():
        np.testing.assert_array_equal(ours[name], theirs[name].astype(np.float32), err_msg=name)
    hf, back = read_hf_config(FIXTURES / version), read_hf_config(out)
    for key in ("model_type", "architectures", "q_lora_rank", "kv_lora_rank",
                "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "head_dim",
                "first_k_dense_replace", "intermediate_size", "moe_intermediate_size",
                "n_routed_experts", "n_shared_experts", "num_experts_per_tok", "n_group",
                "topk_group", "norm_topk_prob", "routed_scaling_factor", "topk_method",
                "rope_interleave", "num_key_value_heads", "rope_parameters"):
        if key in hf:
            assert back[key] == hf[key], key
    assert model_config_from_hf(back) == cfg


def deepseek_style_model():
    """(model, config) of configs/variants/deepseek.gin's choices on the tiny model: MLA
    without query compression, a dense first layer, a shared expert, the sigmoid router with
    its selection bias (moved off zero) in groups, and one multi-token prediction module."""
    from conftest import make_model, tiny_config
    from dagmoe_jax.config import MLAConfig, MTPConfig

    cfg = tiny_config("moe", "sum")
    block = cfg.block
    cfg = dataclasses.replace(
        cfg, num_layers=3, first_dense_layers=1, num_kv_heads=cfg.num_heads,
        mtp=MTPConfig(depth=1),
        mla=MLAConfig(kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8),
        block=dataclasses.replace(
            block, experts=dataclasses.replace(block.experts, num_shared=1,
                                               shared_hidden=block.experts.expert_hidden),
            router=dataclasses.replace(block.router, score_fn="sigmoid", renormalize=True,
                                       aux_free_bias_rate=1e-3, n_group=2, topk_group=1,
                                       group_score="top2_sum", routed_scaling_factor=2.5)))
    model = make_model(cfg, seed=3)
    bias = variable(model, ("layers", "block", "router", "selection_bias"))
    bias.set_value(bias[...] + np.linspace(-0.3, 0.3, bias.shape[-1], dtype=np.float32))
    return model, cfg


def test_a_deepseek_style_model_of_the_library_exports_and_imports_back(tmp_path):
    """A model built from configs/variants/deepseek.gin's choices (MLA without query
    compression, a dense first layer, a shared expert, the sigmoid router with its bias) and
    a multi-token prediction module exports as a DeepSeek-V3 folder that imports to the same
    logits and cross-entropies; its bias, moved off zero, and the module (stored as layer 3, as
    V3 stores its layer 61, with the copies of the embedding and head) come back; as a CoE it
    keeps its logits."""
    from dagmoe_jax.families.coe.config import CoEConfig
    from dagmoe_jax.train.step import lm_loss

    model, cfg = deepseek_style_model()
    bias = variable(model, ("layers", "block", "router", "selection_bias"))
    out = export_hf(model, tmp_path / "out")
    assert read_hf_config(out)["model_type"] == "deepseek_v3"
    again, back_cfg = load_hf_llama(out)
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 12))
    np.testing.assert_allclose(logits_of(again, ids), logits_of(model, ids), rtol=0, atol=1e-6)
    np.testing.assert_array_equal(
        np.asarray(variable(again, ("layers", "block", "router", "selection_bias"))[...]),
        np.asarray(bias[...]))
    assert (back_cfg.mla, back_cfg.first_dense_layers) == (cfg.mla, cfg.first_dense_layers)
    assert back_cfg.mtp == cfg.mtp and read_hf_config(out)["num_nextn_predict_layers"] == 1
    names = SafetensorsReader(out).keys()
    assert {"model.layers.3.eh_proj.weight", "model.layers.3.mlp.gate.weight",
            "model.layers.3.shared_head.head.weight"} <= set(names)
    batch = {"inputs": ids[:, :-1], "targets": ids[:, 1:]}
    ours, theirs = lm_loss(model, batch), lm_loss(again, batch)
    assert float(theirs[1]["mtp_loss"]) == pytest.approx(float(ours[1]["mtp_loss"]), rel=1e-6)
    # (the totals differ by the balance losses: the import takes DeepSeek's coefficients)
    assert float(theirs[1]["ce_loss"]) == pytest.approx(float(ours[1]["ce_loss"]), rel=1e-6)
    coe, coe_cfg = load_hf_llama(out, convert_to=CoEConfig(iterations=2))
    assert coe_cfg.block.kind == "coe" and coe_cfg.mtp.depth == 1
    np.testing.assert_allclose(logits_of(coe, ids), logits_of(model, ids), rtol=0, atol=1e-6)
    assert np.isfinite(float(lm_loss(coe, batch)[1]["mtp_loss"]))


@pytest.mark.parametrize("version, field, value, needle", [
    ("deepseek_v2", "norm_topk_prob", True, "the two disagree"),
    ("deepseek_v2", "topk_method", "noaux_tc", "'greedy' or 'group_limited_greedy'"),
    ("deepseek_v3", "scoring_func", "softmax", "scores by 'sigmoid'"),
    ("deepseek_v3", "num_key_value_heads", 1, "its own key and value"),
    ("deepseek_v3", "moe_layer_freq", 2, "must be an MoE layer"),
    ("deepseek_v3", "n_shared_experts", 0, "n_shared_experts is missing or not an integer"),
    ("deepseek_v2", "n_group", None, "n_group is missing"),
    ("deepseek_v3", "attention_bias", True, "no linear biases"),
    ("deepseek_v3", "index_topk", 2048, "unknown to the importer"),
    ("deepseek_v3", "num_nextn_predict_layers", -1, "expected an integer >= 0"),
])
def test_what_the_library_does_not_compute_is_one_line(version, field, value, needle):
    hf = {**read_hf_config(FIXTURES / version), field: value}
    with pytest.raises(ValueError, match=re.escape(needle)) as err:
        model_config_from_hf(hf)
    assert field in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("change, needle", [
    (lambda b: dict(router=dataclasses.replace(b.router, group_score="max")),
     "RouterConfig.group_score='max'"),
    (lambda b: dict(experts=dataclasses.replace(b.experts, num_shared=0)),
     "ExpertConfig.num_shared=0"),
    (lambda b: dict(experts=dataclasses.replace(b.experts, dispatch="capacity")),
     "ExpertConfig.dispatch='capacity'"),
    (lambda b: dict(aggregation=dataclasses.replace(b.aggregation, kind="dag")),
     "AggregationConfig.kind='dag'"),
    (lambda b: dict(router=dataclasses.replace(b.router, score_fn="softmax",
                                               group_score="max")),
     "RouterConfig.renormalize=True cannot be exported to a Hugging Face deepseek_v2"),
    (lambda b: dict(router=dataclasses.replace(b.router, score_fn="softmax", group_score="max",
                                               renormalize=False)),
     "RouterConfig.aux_free_bias_rate=0.001 cannot be exported to a Hugging Face deepseek_v2"),
])
def test_what_neither_version_computes_is_refused_in_one_line(change, needle):
    """A softmax router is a V2, which never renormalises and has no selection bias; neither
    version drops tokens, has the DAG module, or another group score; each is one line."""
    cfg = load_hf_llama(FIXTURES / "deepseek_v3")[1]
    bad = dataclasses.replace(cfg, block=dataclasses.replace(cfg.block, **change(cfg.block)))
    with pytest.raises(ValueError, match=re.escape(needle)) as err:
        hf_config_from_model(bad, tie_word_embeddings=False)
    assert "\n" not in str(err.value)


def test_an_imported_deepseek_is_a_run_that_converts_to_dag_moe_and_coe(tmp_path):
    """dagmoe-import writes a DeepSeek-V3 folder as a run with transformers' logits; --to_dag
    adds the DAG module to the routed layers with W_up = 0 and --to_coe a chain whose later
    iterations start at a_t = 0 (the same logits both), the shared experts outside the DAG
    module and in the chain's update as the seeds place them."""
    from conftest import write_special_tokenizer
    from dagmoe_jax import run as run_lib
    from dagmoe_jax.cli import hf_import

    folder = tmp_path / "deepseek_v3"
    shutil.copytree(FIXTURES / "deepseek_v3", folder)
    write_special_tokenizer(folder, "bos_named", model_max_length=64)
    ids, want = np.load(FIXTURES / "ids.npy"), np.load(folder / "logits.npy")
    runs = {}
    for flag, name in (([], "run"), (["--to_dag", "--dag_dim=8"], "dag"), (["--to_coe"], "coe")):
        assert hf_import.main([f"--hf={folder}", f"--run_dir={tmp_path / name}",
                               "--seq_len=32", *flag]) == 0
        runs[name] = loaded = run_lib.load_run(tmp_path / name)
        np.testing.assert_allclose(logits_of(loaded.model, ids), want, rtol=0, atol=1e-5)
    from dagmoe_jax.config import ModelConfig
    from dagmoe_jax.train.init_from import source_model_config
    assert source_model_config(f"hf:{folder}", ModelConfig()) == runs["run"].model_cfg
    assert runs["coe"].model_cfg.block.kind == "coe"
    assert runs["coe"].model_cfg.block.experts.num_shared == 2
    loaded = runs["dag"]
    cfg = loaded.model_cfg
    assert cfg.block.aggregation.kind == "dag" and cfg.block.experts.num_shared == 2
    assert cfg.mla.kv_lora_rank == 8 and cfg.first_dense_layers == 1
    saved = json.loads((tmp_path / "dag" / "config.json").read_text())["model"]
    assert saved["first_dense_layers"] == 1
    params = {"/".join(map(str, p)) for p, _ in nnx.to_flat_state(nnx.state(loaded.model))}
    assert any("aggregator" in p for p in params)


def test_fine_tuning_starts_from_a_deepseek_folder():
    """RunConfig.init_from='hf:FOLDER' of a DeepSeek-V3: the run is built from the folder's
    config, holds its parameters (the correction bias too) and its first step trains them."""
    import optax

    from dagmoe_jax import run as run_lib
    from dagmoe_jax.config import ModelConfig
    from dagmoe_jax.run.config import OptimConfig, RunConfig
    from dagmoe_jax.train.init_from import load_initial_params, source_model_config
    from dagmoe_jax.train.step import make_train_step

    init_from = f"hf:{FIXTURES / 'deepseek_v3'}"
    cfg = source_model_config(init_from, ModelConfig())
    model, _, _ = run_lib.build(cfg, OptimConfig(), RunConfig(seed=7))
    assert "the Hugging Face checkpoint" in load_initial_params(model, init_from)
    ids = np.load(FIXTURES / "ids.npy")
    np.testing.assert_allclose(logits_of(model, ids),
                               np.load(FIXTURES / "deepseek_v3" / "logits.npy"), rtol=0,
                               atol=1e-5)
    bias = np.asarray(variable(model, ("layers", "block", "router", "selection_bias"))[...])
    optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
    batch = {"inputs": ids[:, :-1].astype(np.int32), "targets": ids[:, 1:].astype(np.int32)}
    metrics = make_train_step()(model, optimizer, batch)
    assert np.isfinite(float(metrics["loss"]))
    moved = np.asarray(variable(model, ("layers", "block", "router", "selection_bias"))[...])
    assert np.abs(moved - bias).max() == pytest.approx(deepseek.AUX_FREE_GAMMA, rel=1e-3)
