"""Hugging Face MoE checkpoints (Mixtral, OLMoE, Qwen3-MoE) into the library's MoE block.

The folders in tests/fixtures/hf_moe/ were made by transformers itself
(scripts/make_hf_moe_fixtures.py: each family's own class, random weights with norm scales
away from 1, ``save_pretrained``) with the logits transformers computed for ids.npy: the
import must give the same logits, in CI without torch. tests/test_hf_transformers.py makes the
same comparison against transformers in-process where torch is installed."""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest

from dagmoe_jax.families.coe.config import CoEConfig
from dagmoe_jax.families.dense.config import DenseConfig
from dagmoe_jax.hf.llama import load_hf_llama, model_config_from_hf, read_hf_config

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "hf_moe"
FAMILIES = ("mixtral", "olmoe", "qwen3_moe")


def logits_of(model, ids) -> np.ndarray:
    out = model(np.asarray(ids, np.int32))
    return np.asarray(out[0] if isinstance(out, tuple) else out)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_family_imports_at_transformers_logits(family):
    """Each family's routing (softmax over every expert, top-k, renormalised as the family
    says), experts and attention details (OLMoE's q/k norms over the whole projection,
    Qwen3-MoE's per head) reproduce transformers' logits."""
    model, cfg = load_hf_llama(FIXTURES / family)
    got = logits_of(model, np.load(FIXTURES / "ids.npy"))
    np.testing.assert_allclose(got, np.load(FIXTURES / family / "logits.npy"), rtol=0, atol=1e-5)
    router = cfg.block.router
    assert (cfg.block.kind, cfg.block.aggregation.kind, router.score_fn) == ("moe", "sum",
                                                                          "softmax")
    assert cfg.block.experts.num_experts == 4 and router.top_k == 2
    assert (router.renormalize, cfg.qk_norm) == {
        "mixtral": (True, "none"), "olmoe": (False, "full"), "qwen3_moe": (True, "head")}[family]
    assert router.z_loss_coef == 0.0 and router.balance_coef == read_hf_config(
        FIXTURES / family)["router_aux_loss_coef"]


@pytest.mark.parametrize("family, field, value, needle", [
    ("qwen3_moe", "mlp_only_layers", [0], "every layer must be sparse"),
    ("qwen3_moe", "decoder_sparse_step", 2, "every layer must be sparse"),
    ("qwen3_moe", "use_sliding_window", True, "full causal"),
    ("olmoe", "clip_qkv", 8.0, "does not clip"),
    ("mixtral", "router_jitter_noise", 0.1, "adds no noise"),
    ("mixtral", "sliding_window", 4096, "full causal"),
    ("mixtral", "shared_expert_intermediate_size", 64, "unknown to the importer"),
    ("olmoe", "model_type", "jamba", "the importable architectures are llama, mixtral"),
])
def test_what_the_moe_block_cannot_express_is_one_line(family, field, value, needle):
    hf = {**read_hf_config(FIXTURES / family), field: value}
    with pytest.raises(ValueError, match=needle) as err:
        model_config_from_hf(hf)
    assert field in str(err.value) and "\n" not in str(err.value)


def test_an_imported_moe_is_a_run_that_samples_and_fine_tunes(tmp_path, capsys):
    """dagmoe-import writes a Qwen3-MoE folder as an MoE run with the same logits; the
    folder itself reads as a run (hf:FOLDER), and fine-tuning starts from it."""
    from conftest import write_special_tokenizer
    from dagmoe_jax import run as run_lib
    from dagmoe_jax.cli import sample as sample_cli
    from dagmoe_jax.cli.hf_import import import_hf
    from dagmoe_jax.config import ModelConfig
    from dagmoe_jax.train.init_from import source_model_config

    folder = tmp_path / "qwen3_moe"
    shutil.copytree(FIXTURES / "qwen3_moe", folder)
    write_special_tokenizer(folder, "bos_named", model_max_length=64)
    run_dir = import_hf(str(folder), str(tmp_path / "run"), seq_len=32, log=print)
    assert "MoE" in capsys.readouterr().out
    loaded = run_lib.load_run(run_dir)
    assert loaded.model_cfg == load_hf_llama(folder)[1]
    np.testing.assert_allclose(logits_of(loaded.model, np.load(FIXTURES / "ids.npy")),
                               np.load(folder / "logits.npy"), rtol=0, atol=1e-5)
    assert sample_cli.main([f"--run_dir=hf:{folder}", "--prompt=hi", "--max_new_tokens=2"]) == 0
    assert "--- sample 0 ---" in capsys.readouterr().out
    assert source_model_config(f"hf:{folder}", ModelConfig()).qk_norm == "head"
    assert json.loads((run_dir / "config.json").read_text())["model"]["qk_norm"] == "head"


def test_an_imported_moe_converts_to_dag_moe_at_its_logits(tmp_path, capsys):
    """dagmoe-import --to_dag: the DAG module joins each layer with W_up = 0, so the run's
    logits are still the folder's (transformers'), and the module's other weights are random
    (training moves W_up off zero)."""
    from flax import nnx

    from conftest import write_special_tokenizer
    from dagmoe_jax import run as run_lib
    from dagmoe_jax.cli import hf_import

    folder = tmp_path / "olmoe"
    shutil.copytree(FIXTURES / "olmoe", folder)
    write_special_tokenizer(folder, "bos_named", model_max_length=64)
    assert hf_import.main([f"--hf={folder}", f"--run_dir={tmp_path / 'run'}", "--to_dag",
                           "--dag_dim=8", "--seq_len=32"]) == 0
    loaded = run_lib.load_run(tmp_path / "run")
    agg = loaded.model_cfg.block.aggregation
    assert (agg.kind, agg.dag_dim, agg.dag_iters) == ("dag", 8, 2)
    np.testing.assert_allclose(logits_of(loaded.model, np.load(FIXTURES / "ids.npy")),
                               np.load(folder / "logits.npy"), rtol=0, atol=1e-5)
    params = {"/".join(map(str, p)): np.asarray(v[...])
              for p, v in nnx.to_flat_state(nnx.state(loaded.model, nnx.Param))}
    w_up = [k for k in params if k.endswith("w_up") and "aggregator" in k]
    w_down = [k for k in params if k.endswith("w_down") and "aggregator" in k]
    assert w_up and all(not params[k].any() for k in w_up)
    assert w_down and all(params[k].std() > 0 for k in w_down)
    assert hf_import.main([f"--hf={folder}", f"--run_dir={tmp_path / 'bad'}", "--to_dag",
                           "--dag_dim=0"]) == 2
    assert "dag_dim" in capsys.readouterr().err and not (tmp_path / "bad").exists()


@pytest.mark.parametrize("family", FAMILIES)
def test_an_imported_family_exports_back_to_its_own_folder(family, tmp_path):
    """export_hf writes each family in its own names and config: every tensor transformers
    saved comes back bit for bit, the fields transformers reads are the folder's, and the
    export imports to the same model (the same logits)."""
    from dagmoe_jax.hf.export import export_hf
    from dagmoe_jax.hf.llama import SafetensorsReader

    model, cfg = load_hf_llama(FIXTURES / family)
    out = export_hf(model, tmp_path / "out")
    theirs, ours = SafetensorsReader(FIXTURES / family), SafetensorsReader(out)
    assert sorted(ours.keys()) == sorted(theirs.keys())
    for name in theirs.keys():
        np.testing.assert_array_equal(ours[name], theirs[name].astype(np.float32), err_msg=name)
    hf, back = read_hf_config(FIXTURES / family), read_hf_config(out)
    for key in ("model_type", "architectures", "num_experts", "num_local_experts",
                "intermediate_size", "moe_intermediate_size", "num_experts_per_tok",
                "norm_topk_prob", "router_aux_loss_coef", "hidden_size", "num_hidden_layers",
                "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps",
                "vocab_size", "max_position_embeddings", "tie_word_embeddings"):
        # Mixtral's head_dim null is d / heads; Qwen3-MoE's intermediate_size is the width
        # of dense MLPs it has none of (mlp_only_layers), so nothing it computes keeps it
        if hf.get(key) is not None and (family, key) != ("qwen3_moe", "intermediate_size"):
            assert back[key] == hf[key], key
    assert model_config_from_hf(back) == cfg
    again, _ = load_hf_llama(out)
    np.testing.assert_array_equal(logits_of(again, np.load(FIXTURES / "ids.npy")),
                                  logits_of(model, np.load(FIXTURES / "ids.npy")))


@pytest.mark.parametrize("change, needle", [
    (lambda c, b: dict(block=dataclasses.replace(b, aggregation=dataclasses.replace(
        b.aggregation, kind="dag"))), "AggregationConfig.kind='dag'"),
    (lambda c, b: dict(block=dataclasses.replace(b, router=dataclasses.replace(
        b.router, score_fn="sigmoid"))), "RouterConfig.score_fn='sigmoid'"),
    (lambda c, b: dict(block=dataclasses.replace(b, router=dataclasses.replace(
        b.router, aux_free_bias_rate=1e-3))), "RouterConfig.aux_free_bias_rate=0.001"),
    (lambda c, b: dict(block=dataclasses.replace(b, router=dataclasses.replace(
        b.router, n_group=2))), "RouterConfig.n_group=2"),
    (lambda c, b: dict(block=dataclasses.replace(b, router=dataclasses.replace(
        b.router, routed_scaling_factor=2.5))), "RouterConfig.routed_scaling_factor=2.5"),
    (lambda c, b: dict(block=dataclasses.replace(b, experts=dataclasses.replace(
        b.experts, num_shared=1))), "ExpertConfig.num_shared=1"),
    (lambda c, b: dict(block=dataclasses.replace(b, experts=dataclasses.replace(
        b.experts, dispatch="capacity"))), "ExpertConfig.dispatch='capacity'"),
    (lambda c, b: dict(qk_norm="none", block=dataclasses.replace(b, router=dataclasses.replace(
        b.router, renormalize=False))), "RouterConfig.renormalize=False"),
    (lambda c, b: dict(block=CoEConfig(experts=b.experts)), "ModelConfig.block='coe'"),
    (lambda c, b: dict(block=DenseConfig()), "ModelConfig.qk_norm='full'"),
])
def test_what_no_family_computes_is_refused_in_one_line(change, needle):
    """An export never writes a folder that computes something else: the DAG module, a
    sigmoid router, a selection bias, shared experts, dropping dispatch, Mixtral without
    renormalisation, another block family, a Llama with q/k norms are each one line."""
    from dagmoe_jax.hf.export import hf_config_from_model

    cfg = load_hf_llama(FIXTURES / "olmoe")[1]
    bad = dataclasses.replace(cfg, **change(cfg, cfg.block))
    with pytest.raises(ValueError, match=re.escape(needle)) as err:
        hf_config_from_model(bad, tie_word_embeddings=False)
    assert "\n" not in str(err.value)


def test_an_imported_moe_run_exports_with_its_tokenizer(tmp_path, capsys):
    """dagmoe-export writes an imported OLMoE run as an OLMoE folder with its tokenizer (and
    its BOS and EOS ids in config.json), which imports to the transformers logits; a DAG-MoE run is refused in one line and leaves no
    folder."""
    from conftest import write_special_tokenizer
    from dagmoe_jax.cli import export as export_cli, hf_import

    folder = tmp_path / "olmoe"
    shutil.copytree(FIXTURES / "olmoe", folder)
    write_special_tokenizer(folder, "bos_named", model_max_length=64)
    assert hf_import.main([f"--hf={folder}", f"--run_dir={tmp_path / 'run'}",
                           "--seq_len=32"]) == 0
    assert export_cli.main([f"--run_dir={tmp_path / 'run'}", f"--out={tmp_path / 'out'}"]) == 0
    assert "(olmoe, float32 weights" in capsys.readouterr().out
    assert (tmp_path / "out" / "tokenizer.json").read_bytes() == (
        folder / "tokenizer.json").read_bytes()
    exported = read_hf_config(tmp_path / "out")           # the tokenizer's ids, not OLMoE's
    assert (exported["bos_token_id"], exported["eos_token_id"]) == (257, 256)
    model, _ = load_hf_llama(tmp_path / "out")
    np.testing.assert_allclose(logits_of(model, np.load(FIXTURES / "ids.npy")),
                               np.load(folder / "logits.npy"), rtol=0, atol=1e-5)
    assert hf_import.main([f"--hf={folder}", f"--run_dir={tmp_path / 'dag'}", "--to_dag",
                           "--dag_dim=8", "--seq_len=32"]) == 0
    assert export_cli.main([f"--run_dir={tmp_path / 'dag'}", f"--out={tmp_path / 'no'}"]) == 2
    err = capsys.readouterr().err.strip()
    assert "AggregationConfig.kind='dag'" in err and "\n" not in err
    assert not (tmp_path / "no").exists()
