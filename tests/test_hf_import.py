"""``dagmoe-import``: a Hugging Face Llama folder as a dense run directory (issue 34, item 2):
the same model and tokenizer, a run that needs the folder no more, continues training with
fresh optimizer state, exports back to the same tensors, and refuses bad input in one line."""

from __future__ import annotations

import json
import shutil

import jax.numpy as jnp
import numpy as np
import pytest

from conftest import write_special_tokenizer
from test_hf_llama import HF, random_checkpoint, write_checkpoint
from dagmoe_jax import run as run_lib
from dagmoe_jax.cli import hf_import
from dagmoe_jax.data.tokenizers import file_sha256
from dagmoe_jax.hf import llama as hf_llama

CONFIG = dict(HF, vocab_size=259)         # conftest.write_special_tokenizer's 259 ids


@pytest.fixture
def folder(tmp_path):
    """A Hugging Face Llama folder: random weights, a byte-level tokenizer with BOS and two
    EOS ids (``generation_config.json``), as transformers saves one."""
    path = tmp_path / "hf"
    write_checkpoint(path, CONFIG, random_checkpoint(CONFIG))
    write_special_tokenizer(path, "eos_ids")
    return path


def test_a_folder_imports_as_the_same_dense_model_and_tokenizer(folder, tmp_path, capsys):
    out = tmp_path / "run"
    assert hf_import.main([f"--hf={folder}", f"--run_dir={out}", "--seq_len=32"]) == 0
    assert f"imported {folder} into {out}" in capsys.readouterr().out
    want, _ = hf_llama.load_hf_llama(folder)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 259, (2, 16)))
    expected = np.asarray(want(tokens)[0])
    copied = sorted(p.name for p in (out / "tokenizer").iterdir())
    assert copied == ["generation_config.json", "tokenizer.json", "tokenizer_config.json"]
    shutil.rmtree(folder)                       # the run needs the folder no more
    run = run_lib.load_run(out)
    assert run.model_cfg.block.kind == "dense" and run.step == 0
    assert (run.data_cfg.tokenizer, run.data_cfg.seq_len) == ("hf", 32)
    assert run.data_cfg.tokenizer_path == str(out / "tokenizer" / "tokenizer.json")
    np.testing.assert_array_equal(np.asarray(run.model(tokens)[0]), expected)
    assert run.tokenizer.encode("hi") == [104, 105] and run.tokenizer.eos_id == 256
    record = json.loads((out / "config.json").read_text())["tokenizer"]
    assert record["path"] == run.data_cfg.tokenizer_path
    assert record["sha256"] == file_sha256(str(out / "tokenizer" / "tokenizer.json"))
    # written into a hidden sibling and moved: no trace of it is left or recorded
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]
    assert ".partial" not in (out / "config.json").read_text() + (out / "resume.gin").read_text()
    assert run.run_cfg.run_dir == str(out)


def test_the_imported_run_trains_on_and_exports_back(folder, tmp_path):
    from dagmoe_jax.hf.export import export_run
    from dagmoe_jax.run.gin import load_configs
    from dagmoe_jax.train.loop import train

    out = tmp_path / "run"
    (tmp_path / "text.txt").write_text("hello there, a tiny corpus.\n\n" * 40)
    hf_import.import_hf(str(folder), str(out), seq_len=16, batch_size=8,
                        source=f"text:{tmp_path / 'text.txt'}", steps=2, log=lambda _m: None)
    back = tmp_path / "back"
    export_run(str(out), str(back))
    source = hf_llama.SafetensorsReader(folder)
    exported = hf_llama.SafetensorsReader(back)
    assert sorted(exported.keys()) == sorted(source.keys())
    for name in source.keys():                  # step 0 is the folder's tensors, exactly
        np.testing.assert_array_equal(exported[name], source[name], err_msg=name)

    log = []
    result = train(*load_configs([str(out / "resume.gin")]), progress=False, log=log.append)
    assert result.step == 2 and not result.interrupted
    assert any("resumed from step 0" in m and "fresh optimizer state" in m for m in log), log
    trained = run_lib.load_run(out)
    assert trained.step == 2
    assert not np.array_equal(np.asarray(trained.model.embed[...]),
                              source["model.embed_tokens.weight"])     # two steps trained it


@pytest.mark.parametrize("argv, needle", [
    ([], "--hf=DIR (a Hugging Face Llama or MoE folder) and --run_dir=DIR are required"),
    (["--hf=/nonexistent", "--run_dir=run"], "/nonexistent"),
    (["--hf=HF", "--run_dir=run", "--batch_size=0"], "--batch_size=0 is invalid"),
    (["--hf=HF", "--run_dir=run", "--seq_len=4096"], "--seq_len=4096 is longer than the "
                                                      "model's context (64 positions)"),
    (["--hf=HF_NO_TOKENIZER", "--run_dir=run"], "tokenizer.json does not exist"),
    (["--hf=HF", "--run_dir=USED"], "already exists and is not an empty directory"),
])
def test_bad_input_is_one_line_and_writes_nothing(argv, needle, folder, tmp_path, capsys,
                                                  monkeypatch):
    bare = tmp_path / "bare"
    write_checkpoint(bare, CONFIG, random_checkpoint(CONFIG))
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "keep.txt").write_text("mine")
    monkeypatch.chdir(tmp_path)
    argv = [a.replace("HF_NO_TOKENIZER", str(bare)).replace("HF", str(folder))
            .replace("USED", "used") for a in argv]
    before = sorted(p.name for p in tmp_path.iterdir())
    assert hf_import.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and needle in err[0], err
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    assert [p.name for p in (tmp_path / "used").iterdir()] == ["keep.txt"]


def test_an_interrupted_import_leaves_nothing(folder, tmp_path, capsys, monkeypatch):
    def interrupted(*_args, **_kwargs):
        raise KeyboardInterrupt
    monkeypatch.setattr(hf_llama, "load_hf_llama", interrupted)
    empty = tmp_path / "empty"
    empty.mkdir()
    for out in (tmp_path / "run", empty):
        assert hf_import.main([f"--hf={folder}", f"--run_dir={out}"]) == 130
        assert capsys.readouterr().err.strip().splitlines() == [
            f"error: SIGINT received: nothing was written at {out}"]
    assert not (tmp_path / "run").exists() and not list(empty.iterdir())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty", "hf"]    # no sibling left


@pytest.mark.parametrize("kind,first", [("bos_added", [257]), ("no_bos", [])])
def test_an_hf_folder_is_sampled_from_the_prompt_transformers_would_give(kind, first, tmp_path,
                                                                         monkeypatch):
    """``dagmoe-sample --run_dir=hf:DIR`` with defaults starts the prompt as the folder's
    tokenizer starts text (its post-processor's BOS, or nothing), not with the EOS a run of
    this library's records follows: the ids transformers' ``tokenizer(prompt)`` hands
    ``generate`` (tokenizers' own encoding with its special tokens, as the fast tokenizer)."""
    from tokenizers import Tokenizer
    from dagmoe_jax.cli import sample
    from dagmoe_jax.decoding import generate as generate_lib
    path = tmp_path / "hf"
    write_checkpoint(path, CONFIG, random_checkpoint(CONFIG))
    write_special_tokenizer(path, kind)
    seen = []

    def record(model, prompts, **kwargs):
        seen.extend(prompts)
        return [[104] for _ in prompts]
    monkeypatch.setattr(generate_lib, "generate", record)
    assert sample.main([f"--run_dir=hf:{path}", "--prompt=hello", "--max_new_tokens=1"]) == 0
    reference = Tokenizer.from_file(str(path / "tokenizer.json")).encode("hello").ids
    assert seen == [reference] and reference[:len(first)] == first
