"""Config validation: every invalid value or combination raises ValueError naming its field."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest

from conftest import tiny_config
from dagmoe_jax.config import ExecutionConfig, ExpertConfig, ModelConfig, RouterConfig
from dagmoe_jax.families.moe.config import AggregationConfig
from dagmoe_jax.families.coe.config import CoEConfig
from dagmoe_jax.families.moe.budget import dag_params_per_layer, matched_shared_hidden

INVALID = [
    # (id, overrides for tiny_config, field name the message must contain)
    ("top_k>num_experts", dict(router=dict(top_k=5)), "top_k"),
    ("top_k=0", dict(router=dict(top_k=0)), "top_k"),
    ("dag_dim=0", dict(aggregation=dict(dag_dim=0)), "dag_dim"),
    ("dag_iters=0", dict(aggregation=dict(dag_iters=0)), "dag_iters"),
    ("heads_not_dividing_d_model", dict(num_heads=5, num_kv_heads=1), "num_heads"),
    ("kv_heads_not_dividing_heads", dict(num_kv_heads=3), "num_kv_heads"),
    ("bad_block", dict(block="doe!"), "block"),
    ("bad_score_fn", dict(router=dict(score_fn="relu")), "score_fn"),
    ("bad_dispatch", dict(experts=dict(dispatch="ragged")), "dispatch"),
    ("bad_kind", dict(aggregation=dict(kind="attention")), "kind"),
    ("bad_edge_act", dict(aggregation=dict(edge_act="relu")), "edge_act"),
    ("bad_dag_edges", dict(aggregation=dict(dag_edges="upper")), "dag_edges"),
    ("bad_residual", dict(block="coe", coe=dict(residual="both")), "residual"),
    ("dag_shared_weights_not_bool", dict(aggregation=dict(dag_shared_weights=1)),
     "dag_shared_weights"),
    ("bad_coe_score_fn", dict(block="coe", coe=dict(score_fn="relu")), "score_fn"),
    ("capacity_factor=0", dict(experts=dict(capacity_factor=0.0)), "capacity_factor"),
    ("capacity_factor<0", dict(experts=dict(capacity_factor=-1.0)), "capacity_factor"),
    ("negative_balance_coef", dict(router=dict(balance_coef=-0.01)), "balance_coef"),
    ("negative_z_loss_coef", dict(router=dict(z_loss_coef=-1e-3)), "z_loss_coef"),
    ("coe_per_iter_top_k_0", dict(block="coe", router=dict(top_k=1), coe=dict(iterations=2)),
     "top_k_per_iter"),
    ("coe_top_k_per_iter>num_experts", dict(block="coe", coe=dict(top_k_per_iter=5)),
     "top_k_per_iter"),
    ("odd_head_dim", dict(num_heads=4, head_dim=7), "head_dim"),
    ("odd_head_dim_derived", dict(d_model=36, num_heads=4, num_kv_heads=2), "head_dim"),
    ("num_experts=0", dict(experts=dict(num_experts=0)), "num_experts"),
    ("negative_num_shared", dict(experts=dict(num_shared=-1)), "num_shared"),
    ("bad_dtype", dict(compute_dtype="float16"), "compute_dtype"),
]


@pytest.mark.parametrize("overrides,field", [c[1:] for c in INVALID], ids=[c[0] for c in INVALID])
def test_invalid_config_raises_naming_the_field(overrides, field):
    with pytest.raises(ValueError, match=rf"\b{field}\b"):
        tiny_config(**overrides)


INVALID_EXECUTION = [("bad_remat", dict(remat="some"), "remat"),
                     ("negative_scan_unroll", dict(scan_unroll=-1), "scan_unroll"),
                     ("bad_attention", dict(attention="flash"), "attention"),
                     ("bad_grouped_matmul", dict(grouped_matmul="loop"), "grouped_matmul")]


@pytest.mark.parametrize("fields,field", [c[1:] for c in INVALID_EXECUTION],
                         ids=[c[0] for c in INVALID_EXECUTION])
def test_invalid_execution_config_raises_naming_the_field(fields, field):
    with pytest.raises(ValueError, match=rf"^ExecutionConfig.{field}="):
        ExecutionConfig(**fields)


def test_valid_tiny_configs_build():
    for block, kind in [("dense", "sum"), ("moe", "sum"), ("moe", "dag"), ("moe", "mlp"),
                        ("coe", "sum")]:
        cfg = tiny_config(block, kind)
        assert cfg.block.kind == block
        assert block != "moe" or cfg.block.aggregation.kind == kind
    # CoE with an explicit per-iteration top-k is fine even where top_k // iterations is 0.
    cfg = tiny_config("coe", router=dict(top_k=1), coe=dict(iterations=2, top_k_per_iter=1))
    assert cfg.block.resolved_top_k == 1
    assert tiny_config("coe").block.resolved_top_k == 1    # top_k 2 // 2 iterations


def test_sub_config_errors_are_raised_directly():
    with pytest.raises(ValueError, match="top_k"):
        RouterConfig(top_k=0)
    with pytest.raises(ValueError, match="capacity_factor"):
        ExpertConfig(capacity_factor=0)
    with pytest.raises(ValueError, match="edge_act"):
        AggregationConfig(edge_act="tanh")
    with pytest.raises(ValueError, match="iterations"):
        CoEConfig(iterations=0)
    with pytest.raises(ValueError, match="^ModelConfig.block="):
        ModelConfig(block=RouterConfig())
    with pytest.raises(TypeError, match="aggregation"):       # the chain sums: no aggregation
        CoEConfig(aggregation=AggregationConfig(kind="dag"))


def test_replace_keeps_unchanged_nested_fields():
    cfg = tiny_config("moe", "dag")
    new = cfg.replace(block=dict(aggregation=dict(dag_iters=3)))
    assert new.block.aggregation.dag_iters == 3
    assert (new.block.aggregation.kind == "dag"
            and new.block.aggregation.dag_dim == cfg.block.aggregation.dag_dim)
    assert new.block.router == cfg.block.router
    assert cfg.block.aggregation.dag_iters == 2                 # the original is untouched (frozen)


def test_parity_helpers():
    assert dag_params_per_layer(512, 128, 2) == 395264
    assert dag_params_per_layer(512, 128, 2) == 2 * (2 * 512 * 128 + 4 * 128 * 128 + 2 * 512)
    assert matched_shared_hidden(512, 128, 2) == 256
    assert 3 * 512 * matched_shared_hidden(512, 128, 2) == 393216


@pytest.mark.parametrize("retired, hint", [("auto", "dispatch='dropless' (exact, the default) or "
                                                     "'capacity'"),
                                           ("dense", "ExecutionConfig.grouped_matmul='einsum'")])
def test_dispatch_is_architecture_and_retired_values_say_what_to_write(retired, hint):
    """Whether experts drop tokens is saved and the same on every machine: no 'auto', and the
    old every-expert oracle is now how dropless runs; a run saved with either migrates."""

    with pytest.raises(ValueError, match=f"^ExpertConfig.dispatch='{retired}' is no longer a "
                                         f"choice: .*{re.escape(hint)}$"):
        ExpertConfig(dispatch=retired)
    old = dataclasses.asdict(ModelConfig())
    old["block"]["experts"]["dispatch"] = retired
    migrated = ModelConfig.from_dict(old)
    assert migrated.block.experts.dispatch == "dropless"
    assert ModelConfig.saved_execution(old).get("grouped_matmul") == (
        "einsum" if retired == "dense" else None)


def test_fuse_gate_up_is_fuse_projections_in_old_runs_and_old_bindings():
    """It fuses q/k/v as well as gate/up: renamed; a run saved with the old name reads, and a
    binding of the old name says the new one."""
    from dagmoe_jax.run.gin import load_execution_config
    old = {**dataclasses.asdict(ModelConfig()), "execution": {"fuse_gate_up": False}}
    assert ModelConfig.saved_execution(old) == {"fuse_projections": False}
    assert "execution" not in ModelConfig.migrate(old)
    with pytest.raises(ValueError, match=r"\(ExecutionConfig.fuse_gate_up: it is "
                                         r"ExecutionConfig.fuse_projections now\)$"):
        load_execution_config(bindings=["ExecutionConfig.fuse_gate_up = False"])
    assert load_execution_config(
        bindings=["ExecutionConfig.fuse_projections = False"]).fuse_projections is False


def test_execution_sits_beside_the_mesh_not_in_the_model_config():
    """How the model runs is the run's (``RunConfig.execution``), never the architecture's:
    an old binding of ``ModelConfig.execution`` says where it went, and a run's config.json of
    the previous layout (the execution inside the model config) moves it there."""
    from dagmoe_jax.run import configs_from_json, configs_to_json
    from dagmoe_jax.run.config import OptimConfig, RunConfig
    from dagmoe_jax.run.gin import load_configs
    from dagmoe_jax.data import DataConfig

    assert "execution" not in {f.name for f in dataclasses.fields(ModelConfig)}
    _, _, _, train = load_configs(bindings=["ExecutionConfig.remat = 'dots'"])
    assert train.execution == ExecutionConfig(remat="dots")
    with pytest.raises(ValueError, match=r"\(ModelConfig.execution: it is RunConfig.execution "
                                         r"now"):
        load_configs(bindings=["ModelConfig.execution = @ExecutionConfig()"])
    blob = configs_to_json(ModelConfig(), DataConfig(), OptimConfig(), RunConfig())
    blob["train"] = blob.pop("run")                 # its name before RunConfig
    blob["model"]["execution"] = blob["train"].pop("execution")
    blob["model"]["execution"]["attention"] = "xla"
    model, _, _, train = configs_from_json(blob)
    assert model == ModelConfig() and train.execution == ExecutionConfig(attention="xla")


ROUTED_FIELDS = ("router", "experts", "aggregation", "num_experts", "top_k", "coe", "doe")


def test_each_family_config_holds_only_its_own_fields():
    """A dense model's config.json has no expert field, a DoE model's no router; each family's
    JSON names its kind and reads back to the same config."""
    dense = json.dumps(dataclasses.asdict(tiny_config("dense")))
    assert not [f for f in ROUTED_FIELDS if f'"{f}"' in dense], dense
    assert json.loads(dense)["block"] == {"kind": "dense", "ffn_hidden": 64}
    doe = json.loads(json.dumps(dataclasses.asdict(tiny_config("doe"))))
    assert doe["block"]["kind"] == "doe" and "router" not in doe["block"]
    coe = json.loads(json.dumps(dataclasses.asdict(tiny_config("coe"))))
    assert "aggregation" not in coe["block"] and coe["block"]["router"]["top_k"] == 2
    for block in ("dense", "moe", "coe", "doe"):
        cfg = tiny_config(block, "dag")
        assert ModelConfig.from_dict(json.loads(json.dumps(dataclasses.asdict(cfg)))) == cfg


def _flat(cfg: ModelConfig, ffn_hidden=64) -> dict:
    """``cfg`` as config.json held it before ModelConfig.block held the family's config: the
    family's name in ``block`` and every family's fields at the top level."""
    blob = dataclasses.asdict(cfg)
    block = blob.pop("block")
    kind = block.pop("kind")
    routed = {k: block.pop(k) for k in ("router", "experts", "aggregation") if k in block}
    blob.update(block=kind, ffn_hidden=ffn_hidden,
                router=routed.get("router", dataclasses.asdict(RouterConfig())),
                experts=routed.get("experts", dataclasses.asdict(ExpertConfig())),
                aggregation=routed.get("aggregation", {"kind": "sum"}),
                coe=block if kind == "coe" else {}, doe=block if kind == "doe" else {})
    return blob


@pytest.mark.parametrize("block", ["dense", "moe", "coe", "doe"])
def test_config_json_of_every_family_before_block_configs_migrates(block):
    """The top-level router / experts / aggregation / coe / doe / ffn_hidden of earlier
    versions move into the family's config; the other families' fields are dropped."""
    cfg = tiny_config(block, "dag")
    assert ModelConfig.from_dict(_flat(cfg)) == cfg
    if block == "doe":        # DoE's FFN defaulted to the model's ffn_hidden: it keeps that width
        old = _flat(cfg.replace(block=dict(ffn_hidden=None)), ffn_hidden=96)
        assert ModelConfig.from_dict(old).block.ffn_hidden == 96


def test_a_run_written_before_llamafactory_truncation_reads_as_it_trained():
    """DataConfig.truncation came with the default 'llamafactory'; a config.json without the
    field (an earlier version's run) reads 'head', how that run cut its examples, so resuming
    it changes nothing; a new run's config.json keeps its own value."""
    import dataclasses

    from dagmoe_jax.data import DataConfig
    from dagmoe_jax.run.config import OptimConfig, RunConfig
    from dagmoe_jax.run.directory import configs_from_json, configs_to_json

    blob = configs_to_json(ModelConfig(), DataConfig(), OptimConfig(), RunConfig())
    assert configs_from_json(blob)[1].truncation == "llamafactory"
    del blob["data"]["truncation"]
    assert configs_from_json(blob)[1].truncation == "head"
    read = configs_from_json(blob)[1]
    assert dataclasses.replace(read, truncation="llamafactory") == DataConfig()
