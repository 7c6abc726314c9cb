"""Logical axis names: every parameter carries them, and the default rules map them sensibly."""

import jax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from conftest import make_model, tiny_config
from dagmoe_jax.parallel import DEFAULT_RULES, constrain, logical_to_spec

KNOWN = {name for name, _ in DEFAULT_RULES}


@pytest.mark.parametrize("block,kind,shared", [("dense", "sum", 0), ("moe", "dag", 1), ("moe", "mlp", 0),
                                               ("coe", "sum", 1)])
def test_every_parameter_has_logical_names_of_its_rank(block, kind, shared):
    model = make_model(tiny_config(block, kind, experts=dict(num_shared=shared)))
    seen = 0
    for path, var in nnx.iter_graph(model):
        if isinstance(var, nnx.Param):
            names = var.get_metadata()["out_sharding"]
            assert len(names) == var.ndim, (path, names, var.shape)
            assert all(n is None or n in KNOWN for n in names), (path, names)
            seen += 1
    assert seen > 5


def test_expert_router_and_dag_names():
    model = make_model(tiny_config("moe", "dag"))
    block = model.layers.block
    assert block.experts.w_gate.get_metadata()["out_sharding"] == ("layers", "expert", "embed", "expert_mlp")
    assert block.experts.w_down.get_metadata()["out_sharding"] == ("layers", "expert", "expert_mlp", "embed")
    assert block.router.w_router.get_metadata()["out_sharding"] == ("layers", "embed", None)
    it = block.aggregator.iterations
    assert it.w_down.get_metadata()["out_sharding"] == ("layers", "dag_iters", "embed", "dag")
    assert it.w_up.get_metadata()["out_sharding"] == ("layers", "dag_iters", "dag", "embed")


def test_rules_map_experts_to_the_expert_axis_and_use_each_mesh_axis_once():
    assert logical_to_spec(("layers", "expert", "embed", "expert_mlp"), DEFAULT_RULES) == \
        P(None, "expert", "fsdp", "tensor")
    assert logical_to_spec(("batch", "length", "embed"), DEFAULT_RULES) == \
        P(("data", "fsdp", "expert"), None, None)   # fsdp already used by batch


def test_constrain_is_identity_without_a_mesh():
    x = jax.numpy.ones((2, 3))
    assert constrain(x, ("batch", "embed")) is x
    with pytest.raises(ValueError, match="axis names"):
        constrain(x, ("batch",))
