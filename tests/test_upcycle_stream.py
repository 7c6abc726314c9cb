"""Streaming MoErging of Hugging Face checkpoints (dagmoe_jax/upcycle/stream.py) equals the
in-memory merge of the loaded models."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from test_hf_llama import HF, random_checkpoint, write_checkpoint
from dagmoe_jax.runs.settle import settle
from dagmoe_jax.upcycle import hf_llama, moerge, stream


@pytest.mark.parametrize("tied", [False, True])
def test_streaming_merge_equals_the_in_memory_merge(tmp_path, tied):
    hf = dict(HF, tie_word_embeddings=tied)
    paths = []
    for j in range(3):
        paths.append(tmp_path / f"m{j}")
        write_checkpoint(paths[-1], hf, random_checkpoint(hf, seed=j))
    dense = [hf_llama.load_hf_llama(p)[0] for p in paths]
    cfg = settle(moerge.dume_config(stream.read_configs(paths), 3, top_k=2))
    want = moerge.flat_params(moerge.moerge(dense, cfg))
    model = stream.moerge_hf(paths, cfg, seed=1)
    leaves = jax.tree.leaves(model)
    assert all(isinstance(x, jax.Array) for x in leaves)           # nothing left abstract
    got = moerge.flat_params(model)
    assert set(got) == set(want)
    for path, value in want.items():
        if "router" not in path:
            np.testing.assert_array_equal(got[path], value, err_msg=str(path))
    w = got[("layers", "block", "router", "w_router")]
    assert w.std() > 0 and np.all(got[("layers", "block", "router", "b_router")] == 0)


def test_streaming_merge_refuses_a_wrong_expert_count_and_different_models(tmp_path):
    write_checkpoint(tmp_path / "a", HF, random_checkpoint(HF))
    other = dict(HF, intermediate_size=40)
    write_checkpoint(tmp_path / "b", other, random_checkpoint(other))
    cfg = settle(moerge.dume_config(stream.read_configs([tmp_path / "a"]), 1))
    with pytest.raises(ValueError, match="one expert per model"):
        stream.moerge_hf([tmp_path / "a"] * 2, cfg)
    with pytest.raises(ValueError, match="ffn_hidden") as err:
        stream.read_configs([tmp_path / "a", tmp_path / "b"])
    assert "\n" not in str(err.value)
