"""A trained MoE converted to DAG-MoE or Chain-of-Experts (dagmoe_jax/families/moe/conversion.py)
computes the MoE's logits: on the transformers-made folders of tests/fixtures/hf_moe (import
with --to_dag / --to_coe, or RunConfig.init_from with a DAG-MoE or CoE gin config) and on a
run of the library; the chain's later iterations are really there (a_t moves them), and what
cannot convert at equal outputs is one line."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import numpy as np
import pytest
from flax import nnx

from conftest import make_model, tiny_config
from dagmoe_jax.families.moe.config import AggregationConfig, MoEConfig
from dagmoe_jax.families.coe.config import CoEConfig
from dagmoe_jax.hf.llama import load_hf_llama
from dagmoe_jax.families.moe.conversion import (coe_request, converted_config, converted_params,
                                         is_conversion)
from dagmoe_jax.model.params import set_params

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "hf_moe"
IDS = np.load(FIXTURES / "ids.npy")
DATA = Path(__file__).resolve().parent / "fixtures" / "instruct_tiny.jsonl"


def logits_of(model, ids=IDS) -> np.ndarray:
    out = model(np.asarray(ids, np.int32))
    return np.asarray(out[0] if isinstance(out, tuple) else out)


def flat(model) -> dict:
    return {tuple(p): np.asarray(v[...])
            for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


@pytest.mark.parametrize("family", ["mixtral", "olmoe", "qwen3_moe"])
def test_each_family_converts_to_coe_at_transformers_logits(family):
    """Iteration 1 routes as the folder does, iteration 2 starts from a copy of its router at
    a_t = 0: the logits are transformers'; with a_t = 1 the second iteration changes them."""
    cfg = load_hf_llama(FIXTURES / family)[1]
    model, coe = load_hf_llama(FIXTURES / family, convert_to=coe_request(cfg, 2))
    assert coe.block.kind == "coe" and coe.block.iteration_scales
    assert (coe.block.resolved_top_k, coe.block.router) == (cfg.block.router.top_k,
                                                            cfg.block.router)
    np.testing.assert_allclose(logits_of(model), np.load(FIXTURES / family / "logits.npy"),
                               rtol=0, atol=1e-5)
    params = flat(model)
    np.testing.assert_array_equal(params[("layers", "block", "routers", 1, "w_router")],
                                  params[("layers", "block", "routers", 0, "w_router")])
    assert not params[("layers", "block", "iteration_scales")].any()
    model.layers.block.iteration_scales[...] = np.ones((cfg.num_layers, 1), np.float32)
    assert np.abs(logits_of(model) - np.load(FIXTURES / family / "logits.npy")).max() > 1e-3


def test_a_fresh_chain_with_iteration_scales_is_the_papers_chain():
    """a_t starts at 1 in a fresh model: with the same other parameters, the logits of the CoE
    without them."""
    plain = tiny_config("coe", coe={"iterations": 2})
    scaled = dataclasses.replace(plain, block=dataclasses.replace(plain.block,
                                                                  iteration_scales=True))
    ids = np.random.default_rng(0).integers(0, 64, (2, 16))
    a, b = make_model(plain, seed=3), make_model(scaled, seed=4)
    np.testing.assert_array_equal(flat(b)[("layers", "block", "iteration_scales")],
                                  np.ones((2, 1), np.float32))
    set_params(b, flat(a))
    np.testing.assert_allclose(logits_of(b, ids), logits_of(a, ids), rtol=0, atol=1e-6)


@pytest.mark.parametrize("block, needle", [
    (CoEConfig(iterations=2, residual="outer"), "CoEConfig.residual='outer'"),
    (CoEConfig(iterations=2, stream="reference"), "CoEConfig.stream='reference'"),
    (CoEConfig(iterations=2, top_k_per_iter=1), "CoEConfig.top_k_per_iter=1"),
    (CoEConfig(iterations=2, score_fn="sigmoid"), "CoEConfig.score_fn='sigmoid'"),
    (MoEConfig(aggregation=AggregationConfig(kind="mlp")), "AggregationConfig.kind='mlp'"),
])
def test_what_cannot_convert_at_equal_outputs_is_one_line(block, needle):
    cfg = load_hf_llama(FIXTURES / "olmoe")[1]
    with pytest.raises(ValueError, match=needle.replace("(", r"\(")) as err:
        converted_config(cfg, block)
    assert "\n" not in str(err.value)
    assert not is_conversion(tiny_config("dense"), CoEConfig())


def test_a_library_moe_with_shared_experts_and_selection_bias_converts():
    """Not only imported folders: a library MoE (sigmoid router, a shared expert, an
    auxiliary-loss-free selection bias that changes its routing) converts to CoE and to
    DAG-MoE at its logits, the bias copied to every iteration's router."""
    from dagmoe_jax.train.init_from import CARRIED

    cfg = tiny_config("moe", router={"aux_free_bias_rate": 1e-3}, experts={"num_shared": 1})
    source = make_model(cfg, seed=1)
    ids = np.random.default_rng(1).integers(0, 64, (2, 16))
    unbiased = logits_of(source, ids)
    source.layers.block.router.selection_bias[...] = np.linspace(
        -0.5, 0.5, 4, dtype=np.float32)[None].repeat(cfg.num_layers, 0)
    assert np.abs(logits_of(source, ids) - unbiased).max() > 1e-4      # the bias routes
    have = [(tuple(p), v[...]) for p, v in nnx.to_flat_state(nnx.state(source, CARRIED))]
    for block in (coe_request(cfg, 3),
                  MoEConfig(aggregation=AggregationConfig(kind="dag", dag_dim=8))):
        target_cfg = converted_config(cfg, block)
        target = make_model(target_cfg, seed=2)
        set_params(target, converted_params(have, cfg, target_cfg))
        np.testing.assert_allclose(logits_of(target, ids), logits_of(source, ids),
                                   rtol=0, atol=1e-5)


def test_fine_tuning_an_moe_folder_as_dag_moe_or_coe_starts_at_its_logits(tmp_path, capsys):
    """RunConfig.init_from='hf:FOLDER' with a DAG-MoE or CoE block in the gin config converts
    the folder's MoE: the built model starts at transformers' logits; train.py fine-tunes the
    CoE conversion, and training opens the second iteration (a_t leaves zero)."""
    import json

    from dagmoe_jax import run as run_lib
    from dagmoe_jax.cli import train as train_cli
    from dagmoe_jax.config import ModelConfig
    from dagmoe_jax.run.config import OptimConfig, RunConfig
    from dagmoe_jax.train.init_from import load_initial_params, source_model_config
    from conftest import write_special_tokenizer

    folder = tmp_path / "olmoe"
    shutil.copytree(FIXTURES / "olmoe", folder)
    write_special_tokenizer(folder, "bos_named", model_max_length=64)
    init_from = f"hf:{folder}"
    for asked in (CoEConfig(iterations=2),
                  MoEConfig(aggregation=AggregationConfig(kind="dag", dag_dim=8))):
        cfg = source_model_config(init_from, ModelConfig(block=asked))
        assert (cfg.block.kind, cfg.d_model, cfg.qk_norm) == (asked.kind, 16, "full")
        model, _, _ = run_lib.build(cfg, OptimConfig(), RunConfig(seed=7))
        assert "converted to" in load_initial_params(model, init_from)
        np.testing.assert_allclose(logits_of(model), np.load(folder / "logits.npy"),
                                   rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="CoEConfig.stream='reference'"):
        source_model_config(init_from, ModelConfig(block=CoEConfig(stream="reference")))

    run_dir = tmp_path / "coe"
    argv = ["--gin_file=finetune/smoke.gin", f"--run_dir={run_dir}", "--no_progress",
            f"--gin.RunConfig.init_from='{init_from}'", "--gin.RunConfig.epochs=0",
            "--gin.RunConfig.steps=3", f"--gin.DataConfig.source='instruct:{DATA}'",
            "--gin.DataConfig.seq_len=64", "--gin.RunConfig.tensorboard=False",
            "--gin.RunConfig.task_eval_examples=0", "--gin.DataConfig.batch_size=8",
            "--gin.ModelConfig.block='coe'", "--gin.CoEConfig.iterations=2"]
    assert train_cli.main(argv) == 0, capsys.readouterr().err
    assert "converted to CoE" in capsys.readouterr().out
    loaded = run_lib.load_run(run_dir)
    assert loaded.model_cfg.block.kind == "coe" and loaded.model_cfg.block.iteration_scales
    assert json.loads((run_dir / "config.json").read_text())["model"]["block"]["kind"] == "coe"
    assert np.abs(np.asarray(loaded.model.layers.block.iteration_scales[...])).max() > 0


def test_dagmoe_import_to_coe_writes_the_converted_run(tmp_path, capsys):
    """dagmoe-import --to_coe: a run of the chain at the folder's logits; --to_dag with
    --to_coe, and --to_coe of a dense Llama, are one line each and leave nothing."""
    from conftest import write_special_tokenizer
    from dagmoe_jax import run as run_lib
    from dagmoe_jax.cli import hf_import
    from dagmoe_jax.hf.export import export_hf

    folder = tmp_path / "mixtral"
    shutil.copytree(FIXTURES / "mixtral", folder)
    write_special_tokenizer(folder, "bos_named", model_max_length=64)
    assert hf_import.main([f"--hf={folder}", f"--run_dir={tmp_path / 'run'}", "--to_coe",
                           "--coe_iters=3", "--seq_len=32"]) == 0
    assert "CoE of 4 experts, top 2, 3 iterations" in capsys.readouterr().out
    loaded = run_lib.load_run(tmp_path / "run")
    assert loaded.model_cfg.block.iterations == 3
    np.testing.assert_allclose(logits_of(loaded.model), np.load(folder / "logits.npy"),
                               rtol=0, atol=1e-5)
    llama = export_hf(make_model(tiny_config("dense", vocab_size=259)), tmp_path / "llama")
    write_special_tokenizer(llama, "bos_named")
    for argv, needle in (([f"--hf={folder}", "--to_coe", "--to_dag"], "give one"),
                         ([f"--hf={llama}", "--to_coe"], "only an MoE converts to CoE")):
        assert hf_import.main([*argv, f"--run_dir={tmp_path / 'bad'}"]) == 2
        err = capsys.readouterr().err.strip()
        assert needle in err and "\n" not in err and not (tmp_path / "bad").exists()


def test_a_fine_tuned_moe_trains_its_routers_its_own_way():
    """How routers are trained (balance losses, auxiliary-loss-free balancing) is the gin
    config's in a fine-tuned run: the source computes the same logits with a zero selection
    bias added; what the routers compute (top_k) is still the source's."""
    from dagmoe_jax import run as run_lib
    from dagmoe_jax.config import ModelConfig, RouterConfig
    from dagmoe_jax.run.config import OptimConfig, RunConfig
    from dagmoe_jax.train.init_from import load_initial_params, source_model_config

    init_from = f"hf:{FIXTURES / 'olmoe'}"
    asked = RouterConfig(aux_free_bias_rate=1e-3, balance_coef=0.0, balance_scope="sequence")
    for block in (MoEConfig(router=asked), CoEConfig(iterations=2, router=asked)):
        cfg = source_model_config(init_from, ModelConfig(block=block))
        router = cfg.block.router
        assert (router.aux_free_bias_rate, router.balance_coef, router.balance_scope,
                router.score_fn, router.top_k) == (1e-3, 0.0, "sequence", "softmax", 2)
        model, _, _ = run_lib.build(cfg, OptimConfig(), RunConfig(seed=7))
        assert "new values initialised" in load_initial_params(model, init_from)
        np.testing.assert_allclose(logits_of(model), np.load(FIXTURES / "olmoe" / "logits.npy"),
                                   rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match=r"ModelConfig.block.router.top_k=3 \(the source has 2\)"):
        source_model_config(init_from, ModelConfig(block=MoEConfig(router=RouterConfig(top_k=3))))
