"""The upcycling command within its memory promise: the run is written from the merged
parameters (no second model, no optimizer state; train.py creates that when it resumes), and
``--dtype=bfloat16`` holds the merge in bfloat16. The memory itself is measured by
``benchmarks/merge_memory.py``, not here."""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from test_hf_llama import HF, hf_tokenizer_json, random_checkpoint, write_checkpoint  # noqa
from dagmoe_jax import run as run_lib
from dagmoe_jax.model.params import flat_params
from dagmoe_jax.upcycle import __main__ as cli


def hf_experts(tmp_path, tokenizer_json, *extra):
    """argv of the upcycling command over two tiny Hugging Face experts and their domains."""
    hf = dict(HF, vocab_size=288)
    argv = [f"--tokenizer_path={tokenizer_json}", "--stats_batches=2", "--steps=2",
            "--seq_len=16", "--batch_size=8", "--top_k=2", "--stats_text=stream", *extra]
    for j in range(2):
        write_checkpoint(tmp_path / f"m{j}", hf, random_checkpoint(hf, seed=j))
        text = tmp_path / f"d{j}.txt"
        text.write_text("\n\n".join([("a tiny corpus " if j else "for a tiny tokenizer ") * 8]
                                     * 30))
        argv += [f"--dense={tmp_path / f'm{j}'}", f"--source=text:{text}"]
    return argv


def test_the_run_is_written_without_a_second_model_and_resumes_training(
        tmp_path, hf_tokenizer_json, monkeypatch):
    from dagmoe_jax.run.gin import load_configs
    from dagmoe_jax.train.loop import train

    def refuse(*_args, **_kwargs):
        raise AssertionError("the upcycling command built a second model or an optimizer")

    out = tmp_path / "out"
    with monkeypatch.context() as patch:
        patch.setattr(run_lib, "build", refuse)
        patch.setattr(nnx, "Optimizer", refuse)
        assert cli.main([f"--run_dir={out}", *hf_experts(tmp_path, hf_tokenizer_json)]) == 0
    step0 = out / "checkpoints" / "0"
    meta = json.loads((step0 / "meta" / "metadata").read_text())
    assert meta["state_keys"] == ["model"]
    saved = (step0 / "state" / "_METADATA").read_text()
    assert "optimizer" not in saved and "w_router" in saved
    written = flat_params(run_lib.load_run(out).model)        # evaluation reads it as any run

    log = []
    result = train(*load_configs([str(out / "resume.gin")]), progress=False, log=log.append)
    assert result.step == 2 and not result.interrupted
    assert any("resumed from step 0" in m and "fresh optimizer state" in m for m in log), log
    trained = run_lib.load_run(out)            # step 2: a full state, optimizer included
    assert trained.step == 2
    params = flat_params(trained.model)
    router = ("layers", "block", "router", "w_router")
    assert not np.array_equal(params[router], written[router])      # DUME+ trained the router
    attn = next(p for p in written if "attn" in p)
    np.testing.assert_array_equal(params[attn], written[attn])      # and nothing else


def test_bfloat16_upcycle_matches_the_float32_one(tmp_path, hf_tokenizer_json):
    argv = hf_experts(tmp_path, hf_tokenizer_json)
    assert cli.main([f"--run_dir={tmp_path / 'f32'}", *argv]) == 0
    assert cli.main([f"--run_dir={tmp_path / 'bf16'}", "--dtype=bfloat16", *argv]) == 0
    f32, bf16 = (run_lib.load_run(tmp_path / name) for name in ("f32", "bf16"))
    assert bf16.model_cfg == f32.model_cfg and bf16.model_cfg.param_dtype == "float32"
    assert bf16.model.embed[...].dtype == jnp.float32          # read into float32 weights
    a, b = flat_params(f32.model), flat_params(bf16.model)
    for path, value in a.items():
        if "router" in path:         # solved from the bfloat16 model's statistics
            np.testing.assert_allclose(b[path], value, atol=0.02, err_msg=str(path))
        else:                        # the float32 merge rounded to bfloat16
            np.testing.assert_allclose(b[path], value, rtol=2 ** -8, atol=1e-7,
                                       err_msg=str(path))
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 288, (2, 16)))
    want, got = (np.asarray(m.model(tokens)[0]) for m in (f32, bf16))
    assert np.abs(got - want).max() < 0.1 * np.abs(want).max()
    summary = json.loads((tmp_path / "bf16" / "dume.json").read_text())
    assert summary["dtype"] == "bfloat16"


@pytest.mark.parametrize("flag", ["--dtype=float16", "--dtype=bf16"])
def test_a_bad_dtype_is_one_line_and_writes_nothing(tmp_path, capsys, flag):
    out = tmp_path / "out"
    code = cli.main([f"--run_dir={out}", flag, "--dense=x", "--source=text:y"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "--dtype" in err[0], err
    assert not out.exists()
