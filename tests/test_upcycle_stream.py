"""Streaming MoErging of Hugging Face checkpoints (dagmoe_jax/upcycle/stream.py) equals the
in-memory merge of the loaded models."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from test_hf_llama import HF, hf_tokenizer_json, random_checkpoint, write_checkpoint  # noqa
from dagmoe_jax.model.settle import settle
from dagmoe_jax.hf import llama as hf_llama
from dagmoe_jax.upcycle import moerge, stream


@pytest.mark.parametrize("tied", [False, True])
def test_streaming_merge_equals_the_in_memory_merge(tmp_path, tied):
    hf = dict(HF, tie_word_embeddings=tied)
    paths = []
    for j in range(3):
        paths.append(tmp_path / f"m{j}")
        write_checkpoint(paths[-1], hf, random_checkpoint(hf, seed=j))
    dense = [hf_llama.load_hf_llama(p)[0] for p in paths]
    cfg = moerge.dume_config(stream.read_configs(paths), 3, top_k=2)
    want = moerge.flat_params(moerge.moerge(dense, cfg, execution=settle(cfg)))
    model = stream.moerge_hf(paths, cfg, execution=settle(cfg), seed=1)
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
    cfg = moerge.dume_config(stream.read_configs([tmp_path / "a"]), 1)
    with pytest.raises(ValueError, match="one expert per model"):
        stream.moerge_hf([tmp_path / "a"] * 2, cfg, execution=settle(cfg))
    with pytest.raises(ValueError, match="ffn_hidden") as err:
        stream.read_configs([tmp_path / "a", tmp_path / "b"])
    assert "\n" not in str(err.value)


def test_upcycle_command_streams_hugging_face_directories(tmp_path, hf_tokenizer_json):
    from dagmoe_jax import run as run_lib
    from dagmoe_jax.upcycle import __main__ as cli

    hf = dict(HF, vocab_size=288)
    argv = [f"--run_dir={tmp_path / 'out'}", f"--tokenizer_path={hf_tokenizer_json}",
            "--stats_batches=1", "--steps=2", "--seq_len=16", "--batch_size=2", "--top_k=2"]
    paths = []
    for j in range(2):
        paths.append(tmp_path / f"m{j}")
        write_checkpoint(paths[-1], hf, random_checkpoint(hf, seed=j))
        text = tmp_path / f"d{j}.txt"
        text.write_text("\n\n".join([("a tiny corpus " if j else "for a tiny tokenizer ") * 8]
                                     * 30))
        argv += [f"--dense={paths[-1]}", f"--source=text:{text}"]
    assert cli.main(argv) == 0
    merged = moerge.flat_params(run_lib.load_run(tmp_path / "out").model)
    cfg = moerge.dume_config(stream.read_configs(paths), 2, top_k=2)
    want = moerge.flat_params(moerge.moerge([hf_llama.load_hf_llama(p)[0] for p in paths], cfg,
                                            execution=settle(cfg)))
    for path, value in want.items():
        if "router" not in path:
            np.testing.assert_array_equal(merged[path], value, err_msg=str(path))
    assert "RunConfig.trainable = 'router'" in (tmp_path / "out" / "resume.gin").read_text()
