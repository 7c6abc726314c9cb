"""The gin model configs: every shipped combination loads and validates; errors are one line."""

import glob
import os

import pytest

from dagmoe_jax.families.dense.config import DenseConfig
from dagmoe_jax.model.accounting import account
from dagmoe_jax.run.gin import CONFIG_DIR, load_configs, load_execution_config, load_model_config

MODELS = sorted(os.path.relpath(p, CONFIG_DIR) for p in glob.glob(str(CONFIG_DIR / "models/*.gin")))
VARIANTS = sorted(os.path.relpath(p, CONFIG_DIR) for p in glob.glob(str(CONFIG_DIR / "variants/*.gin")))


def test_paper_models_are_shipped():
    for name in ("models/s.gin", "models/s_fine.gin", "models/m.gin", "models/l.gin", "models/tiny.gin"):
        assert name in MODELS
    for g in (64, 128):
        for L in (1, 2, 3):
            assert f"variants/dag_g{g}_l{L}.gin" in VARIANTS
            assert f"variants/moe_shared_g{g}_l{L}.gin" in VARIANTS
    assert {"variants/moe.gin", "variants/mlp_g64.gin", "variants/coe_g128_l2.gin",
            "variants/coe_authors.gin"} <= set(VARIANTS)


@pytest.mark.parametrize("model", MODELS)
def test_every_variant_loads_and_shared_baselines_match_their_dag(model):
    for variant in VARIANTS:
        cfg = load_model_config([model, variant])
        if "dag_" in variant:
            twin = load_model_config([model, variant.replace("dag_", "moe_shared_")])
            moe = load_model_config([model, "variants/moe.gin"])
            added_dag = account(cfg).total_params - account(moe).total_params
            added_shared = account(twin).total_params - account(moe).total_params
            # the shared expert's d_r is rounded to a multiple of 8: within 3 d * 4 per layer
            assert abs(added_dag - added_shared) <= cfg.num_layers * 3 * cfg.d_model * 4
            assert cfg.block.aggregation.kind == "dag" and twin.block.experts.num_shared == 1


def test_table3_shapes():
    s = load_model_config(["models/s.gin", "variants/dag_g128_l2.gin"])
    assert (s.d_model, s.num_layers, s.num_heads, s.num_kv_heads) == (512, 4, 32, 8)
    e, a = s.block.experts, s.block.aggregation
    assert (e.num_experts, e.expert_hidden, s.block.router.top_k) == (32, 256, 4)
    assert (a.dag_dim, a.dag_iters, s.vocab_size) == (128, 2, 128256)
    f = load_model_config(["models/s_fine.gin"])
    e = f.block.experts
    assert (e.num_experts, e.expert_hidden, f.block.router.top_k) == (64, 128, 8)
    m = load_model_config(["models/m.gin"])
    assert m.num_layers == 6
    big = load_model_config(["models/l.gin", "variants/moe_shared_g256_l2.gin"])
    e = big.block.experts
    assert (big.d_model, big.num_layers, e.expert_hidden, e.shared_hidden) == (1024, 8, 512, 512)
    coe = load_model_config(["models/s.gin", "variants/coe_g128_l2.gin"])
    assert coe.block.kind == "coe" and coe.block.resolved_top_k == 2 and coe.block.iterations == 2
    assert (coe.block.experts.num_shared, coe.block.experts.shared_hidden) == (1, 247)


def test_coe_preset_is_the_equal_parameter_ablation():
    """The CoE preset adds what the DAG-MoE L 2 preset adds (the summary's "393K, equal params"),
    its second router included, to the nearest integer d_r (d 512, N 32: d_r 247, 512 over),
    and makes the same top_k expert calls per token as MoE."""
    from dagmoe_jax.families.moe.budget import coe_budget_residual
    from dagmoe_jax.model.accounting import account
    total = {name: account(load_model_config(["models/s.gin", f"variants/{name}.gin"]),
                           128).total_params
             for name in ("moe", "dag_g128_l2", "coe_g128_l2")}
    layers, d, n = 4, 512, 32
    dag_added = (total["dag_g128_l2"] - total["moe"]) / layers
    coe_added = (total["coe_g128_l2"] - total["moe"]) / layers
    assert dag_added == 395_264
    assert coe_added - dag_added == 512 == coe_budget_residual(d, 128, 2, n, 247)
    assert abs(coe_added - dag_added) <= 1.5 * d          # the nearest d_r: within 3 d / 2
    assert coe_added == d * n + 3 * d * 247
    coe = load_model_config(["models/s.gin", "variants/coe_g128_l2.gin"])
    assert coe.block.resolved_top_k * coe.block.iterations == coe.block.router.top_k


def test_coe_authors_variant_is_their_main_run_and_trains():
    """variants/coe_authors.gin is the block of the CoE authors' main run
    (joevidev/chainofexperts: runs/run.sh ``main_64ept-4tpk-2itr``, config.json, MoEGate):
    2 iterations of 4 experts, a softmax router per iteration without renormalisation, their
    residual reading, the per-sequence slot balance loss at 0.001 and no z-loss, one shared
    expert as large as a routed one (the model config's EXPERT_HIDDEN, whatever the size)."""
    import jax.numpy as jnp
    import numpy as np
    import optax
    from flax import nnx

    from conftest import make_model
    from dagmoe_jax.train.step import make_train_step

    for model, d_r in (("models/s.gin", 256), ("models/l.gin", 512), ("models/tiny.gin", 32)):
        cfg = load_model_config([model, "variants/coe_authors.gin"])
        c = cfg.block
        assert (c.kind, c.iterations, c.resolved_top_k, c.shared_router) == ("coe", 2, 4, False)
        assert (c.residual, c.stream, c.score_fn) == ("inner", "reference", None)
        r = c.iteration_router
        assert (r.score_fn, r.renormalize, r.balance_coef, r.balance_load, r.balance_prob,
                r.balance_scope, r.z_loss_coef, r.aux_free_bias_rate, r.bias) == (
            "softmax", False, 0.001, "slots", "softmax", "sequence", 0.0, 0.0, False)
        e = c.experts
        assert (e.num_shared, e.shared_hidden, e.expert_hidden, e.dispatch) == (
            1, d_r, d_r, "dropless")
    # the shared expert follows the routed size when the size is bound through its macro
    wide = load_model_config(["models/tiny.gin", "variants/coe_authors.gin"],
                             ["EXPERT_HIDDEN = 48"]).block.experts
    assert (wide.expert_hidden, wide.shared_hidden) == (48, 48)
    # one training step of the tiny model (d 64, 2 layers, 8 experts) with it
    cfg = cfg.replace(num_layers=1, vocab_size=64)
    net = make_model(cfg)
    assert net.layers.block.replaces_stream
    optimizer = nnx.Optimizer(net, optax.adam(1e-3), wrt=nnx.Param)
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, 64, (2, 17)), jnp.int32)
    metrics = make_train_step()(net, optimizer, {"inputs": tokens[:, :-1],
                                                 "targets": tokens[:, 1:]})
    assert np.isfinite(float(metrics["loss"])) and float(metrics["z_loss"]) > 0
    # slots: 1 at balance, N at worst; the loss adds 0.001 of it and nothing of the z-loss
    assert 1.0 <= float(metrics["balance_loss"]) <= 8.0
    np.testing.assert_allclose(float(metrics["loss"]) - float(metrics["ce_loss"]),
                               0.001 * float(metrics["balance_loss"]), atol=1e-6)


# config/models/coe_deepseekv2/config.json of joevidev/chainofexperts (commit 51c1acc), less
# its CoE fields (inner_iter, outer_residual, inner_residual, use_igate) and auto_map, read as
# the DeepSeek-V2 it extends
COE_AUTHORS_BACKBONE = {
    "model_type": "deepseek_v2", "attention_bias": False, "aux_loss_alpha": 0.001,
    "bos_token_id": 100000, "eos_token_id": 100001, "ep_size": 1, "first_k_dense_replace": 0,
    "hidden_act": "silu", "hidden_size": 1024, "intermediate_size": 5472, "kv_lora_rank": 512,
    "max_position_embeddings": 163840, "moe_intermediate_size": 704, "moe_layer_freq": 1,
    "n_group": 1, "n_routed_experts": 63, "n_shared_experts": 1, "norm_topk_prob": False,
    "num_attention_heads": 8, "num_experts_per_tok": 7, "num_hidden_layers": 4,
    "num_key_value_heads": 8, "pretraining_tp": 1, "q_lora_rank": None, "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64, "rms_norm_eps": 1e-06,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 0.707,
                     "mscale_all_dim": 0.707, "original_max_position_embeddings": 4096,
                     "type": "yarn"},
    "rope_theta": 10000, "routed_scaling_factor": 1.0, "scoring_func": "softmax",
    "seq_aux": True, "tie_word_embeddings": False, "topk_group": 1, "topk_method": "greedy",
    "torch_dtype": "bfloat16", "use_cache": True, "v_head_dim": 128, "vocab_size": 102400}


def test_coe_authors_whole_model_is_their_deepseek_v2_backbone():
    """variants/coe_authors_deepseek_v2.gin is their config.json: the backbone the DeepSeek-V2
    importer reads from it (MLA, YaRN, sizes, 63 routed experts of 704 beside one shared) with
    variants/coe_authors.gin's chain (2 iterations of 4) as the block."""
    from dagmoe_jax.hf.llama import model_config_from_hf

    ours = load_model_config(["variants/coe_authors_deepseek_v2.gin"])
    theirs = model_config_from_hf(COE_AUTHORS_BACKBONE)
    for field in ("d_model", "num_layers", "num_heads", "vocab_size", "max_seq_len", "norm_eps",
                  "rope_theta", "rope_scaling", "mla", "first_dense_layers"):
        assert getattr(ours, field) == getattr(theirs, field), field
    assert ours.block.experts == theirs.block.experts
    assert (ours.block.kind, ours.block.iterations, ours.block.resolved_top_k) == ("coe", 2, 4)
    assert ours.block.router.score_fn == theirs.block.router.score_fn == "softmax"


def test_bindings_override_files():
    cfg = load_model_config(["models/s.gin"], ["AggregationConfig.dag_iters = 3", "ModelConfig.vocab_size = 256"])
    assert cfg.block.aggregation.dag_iters == 3 and cfg.vocab_size == 256


def test_nested_configs_bind_with_or_without_their_wiring():
    """``ExecutionConfig.remat = 'full'`` reaches ``RunConfig.execution`` with no file wiring
    ``RunConfig.execution = @ExecutionConfig()``; the same holds for every nested config,
    the block family's parts included, found by walking the configs' fields."""
    bindings = ["ExecutionConfig.remat = 'full'", "RopeScalingConfig.kind = 'llama3'",
                "RouterConfig.top_k = 1", "MeshConfig.data = 2"]
    bare, _, _, train = load_configs([], bindings)
    assert (train.execution.remat, bare.rope_scaling.kind, bare.block.router.top_k,
            train.mesh.data) == ("full", "llama3", 1, 2)
    wired = load_model_config(["models/s.gin", "gpu.gin"], ["ExecutionConfig.attention = 'xla'"])
    execution = load_execution_config(["models/s.gin", "gpu.gin"],
                                      ["ExecutionConfig.attention = 'xla'"])
    assert (execution.remat, execution.attention, wired.compute_dtype) == (
        "dots", "xla", "bfloat16")
    with pytest.raises(ValueError, match="ExecutionConfig.*remat"):
        load_execution_config([], ["ExecutionConfig.remat = 'some'"])


@pytest.mark.parametrize("files,bindings,needle", [
    (["models/s.gin"], ["RouterConfig.topk = 3"], "topk"),
    (["models/no_such_model.gin"], [], "no_such_model"),
    (["models/s.gin"], ["RouterConfig.top_k = 64"], "top_k"),
    (["models/s.gin"], ["AggregationConfig.dag_dim = 0"], "dag_dim"),
])
def test_errors_are_one_line_and_name_the_culprit(files, bindings, needle):
    with pytest.raises(ValueError) as err:
        load_model_config(files, bindings)
    assert needle in str(err.value)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("binding, hint", [
    ("DataConfig.sorce = 'x'", "(did you mean DataConfig.source?)"),
    ("RouterConfig.topk = 3", "(did you mean RouterConfig.top_k?)"),
    ("DataConfg.source = 'x'", "(did you mean DataConfig?)"),
    ("RunConfig.zzzz = 3", ""),
])
def test_a_misspelt_binding_suggests_the_nearest_name(binding, hint):
    with pytest.raises(ValueError) as err:
        load_configs(["train/smoke.gin"], [binding])
    message = str(err.value)
    assert message.endswith(hint) and "\n" not in message, message
    assert hint or "did you mean" not in message, message


def test_training_configs_load_from_any_working_directory(tmp_path, monkeypatch):
    from dagmoe_jax.run.gin import load_configs
    monkeypatch.chdir(tmp_path)
    model, data, optim, train = load_configs(["configs/dagmoe_s.gin", "configs/cpu_small.gin"])
    # dagmoe_s: the paper's s model and recipe; cpu_small shrinks the trunk and the run.
    a = model.block.aggregation
    assert (model.d_model, a.kind, a.dag_dim) == (512, "dag", 128)
    assert (model.num_layers, model.vocab_size, data.seq_len, train.steps) == (2, 256, 256, 200)
    assert (optim.b2, optim.weight_decay, optim.schedule) == (0.999, 0.1, "wsd")
    model, data, optim, train = load_configs(["dagmoe_s"])
    assert (model.num_layers, data.seq_len, data.batch_size, optim.learning_rate,
            optim.warmup_steps, train.steps) == (4, 2048, 256, 5e-4, 2000, 23842)


def test_the_bindings_users_write_keep_working_and_old_wiring_says_the_new_spelling():
    """`--gin.RouterConfig.top_k=8`, `AggregationConfig.dag_iters=3` and the variant files
    configure the family ``ModelConfig.block`` names; a binding of a field the family's config
    holds now is one line that says what to write."""
    cfg = load_model_config(["models/s.gin", "variants/dag_g128_l2.gin"],
                            ["RouterConfig.top_k = 8", "AggregationConfig.dag_iters = 3"])
    assert (cfg.block.kind, cfg.block.router.top_k, cfg.block.aggregation.dag_iters) == (
        "moe", 8, 3)
    coe = load_model_config(["models/s.gin", "variants/coe_g128_l2.gin"],
                            ["RouterConfig.top_k = 8"])
    assert (coe.block.kind, coe.block.router.top_k, coe.block.resolved_top_k) == ("coe", 8, 4)
    dense = load_model_config(["models/tiny.gin"], ["ModelConfig.block = 'dense'",
                                                    "DenseConfig.ffn_hidden = 96"])
    assert dense.block == DenseConfig(ffn_hidden=96)
    for old, new in [("ModelConfig.router = @RouterConfig()", "bind RouterConfig.<field>"),
                     ("ModelConfig.ffn_hidden = 96", "DenseConfig.ffn_hidden"),
                     ("ModelConfig.coe = @CoEConfig()", "ModelConfig.block = 'coe'")]:
        with pytest.raises(ValueError) as err:
            load_model_config(["models/tiny.gin"], [old])
        assert new in str(err.value) and "\n" not in str(err.value), str(err.value)


def test_the_run_config_s_old_name_still_configures_it(tmp_path):
    """``RunConfig`` was ``TrainConfig``: a saved run's gin file (``resume.gin``, written by
    :func:`configs_to_gin` before the rename) and a command line of the old name configure the
    same run, in gin's order (a later binding wins whichever name it uses); a file that
    another includes is not translated, and gin's error is one line naming the new name."""
    from dagmoe_jax.run import configs_to_gin
    from dagmoe_jax.run.config import RunConfig, TrainConfig

    configs = load_configs(["train/smoke.gin"], ["RunConfig.steps = 7", "MeshConfig.data = 1",
                                                 "ExecutionConfig.remat = 'dots'"])
    old_gin = tmp_path / "resume.gin"
    old_gin.write_text(configs_to_gin(*configs).replace("RunConfig", "TrainConfig"))
    assert "TrainConfig.steps = 7" in old_gin.read_text()
    assert load_configs([str(old_gin)]) == configs
    _, _, _, run = load_configs(["train/smoke.gin"], ["TrainConfig.steps = 9",
                                                      "TrainConfig.log_every = 3"])
    assert (run.steps, run.log_every, type(run)) == (9, 3, RunConfig) and TrainConfig is RunConfig
    _, _, _, run = load_configs([str(old_gin)], ["RunConfig.steps = 9", "TrainConfig.steps = 8"])
    assert run.steps == 8
    assert load_configs(bindings=["TrainConfig.steps = 5"]) == load_configs(
        bindings=["RunConfig.steps = 5"])
    including = tmp_path / "including.gin"
    including.write_text(f"include '{old_gin}'\n")
    with pytest.raises(ValueError) as err:
        load_configs([str(including)])
    assert str(err.value).endswith("(TrainConfig: it is RunConfig now)"), str(err.value)
    assert "\n" not in str(err.value)


def test_the_deepseek_variant_trains_saves_and_reads_back():
    """variants/deepseek.gin on the tiny model: MLA, a dense first layer, DeepSeek-V3's routing
    and multi-token prediction; one training step moves every router's selection bias (the
    module's too), and the config survives
    config.json and resume.gin."""
    import dataclasses

    import jax
    import numpy as np
    import optax
    from flax import nnx

    from conftest import make_model
    from dagmoe_jax.config import ModelConfig
    from dagmoe_jax.run.directory import config_bindings
    from dagmoe_jax.train.step import make_train_step

    cfg = load_model_config(["models/tiny.gin", "variants/deepseek.gin"])
    assert cfg.mla.enabled and cfg.first_dense_layers == 1 and cfg.routed_layers == 1
    r = cfg.block.router
    assert (r.n_group, r.topk_group, r.group_score, r.routed_scaling_factor) == (
        4, 2, "top2_sum", 2.5)
    assert ModelConfig.from_dict(dataclasses.asdict(cfg)) == cfg
    assert "ModelConfig.mla = @MLAConfig()" in config_bindings(cfg)
    model = make_model(cfg)
    optimizer = nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)
    rng = np.random.default_rng(0)
    batch = {"inputs": rng.integers(0, 256, (4, 16), dtype=np.int32),
             "targets": rng.integers(0, 256, (4, 16), dtype=np.int32),
             "mask": np.ones((4, 16), bool)}
    metrics = make_train_step()(model, optimizer, jax.tree.map(jax.numpy.asarray, batch))
    assert np.isfinite(float(metrics["loss"]))
    assert float(jax.numpy.max(jax.numpy.abs(model.layers.block.router.selection_bias[...]))) > 0
    # V3's one multi-token prediction module trains beside the model, its router balanced too
    assert cfg.mtp.depth == 1 and "MTPConfig.depth = 1" in config_bindings(cfg)
    assert np.isfinite(float(metrics["mtp_loss"]))
    assert float(jax.numpy.max(jax.numpy.abs(model.mtp.layer.block.router.selection_bias[...]))) > 0
