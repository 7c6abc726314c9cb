"""``dagmoe-export``: a dense run as a Hugging Face Llama directory with its tokenizer, read back
as the same model and the same ids, and upcycled together with the run it came from (issue 35,
item 4)."""

from __future__ import annotations

import json
import random

import jax.numpy as jnp
import numpy as np
import pytest

from conftest import make_model, tiny_config
from dagmoe_jax import run as run_lib
from dagmoe_jax.cli import export as export_cli
from dagmoe_jax.data import DataConfig
from dagmoe_jax.data.tokenizers import ByteTokenizer, HFTokenizer
from dagmoe_jax.hf import export as hf_export, llama as hf_llama
from dagmoe_jax.hf.tokenizer import byte_spelling, byte_tokenizer_json
from dagmoe_jax.upcycle import __main__ as upcycle_cli
from dagmoe_jax.upcycle import command

TEXT = "\n\n".join(("abcabcab " if i % 2 else "0101 0110 ") * 6 for i in range(40))


def write_dense_run(root, seed=0):
    """A dense run (step 0, byte tokenizer) over a small text corpus."""
    (root / "corpus.txt").write_text(TEXT)
    data = DataConfig(source=f"text:{root / 'corpus.txt'}", seq_len=16, batch_size=4)
    model = make_model(tiny_config("dense", vocab_size=256, init_std=0.2), seed=seed)
    return command.write_run(str(root / "run"), model, model.cfg, data, steps=1,
                             trainable="all"), data


def random_texts(count=300, seed=0):
    rng = random.Random(seed)
    chars = lambda: rng.choice([rng.randrange(1, 128), rng.randrange(128, 0x800),  # noqa: E731
                                rng.randrange(0x800, 0xD800), rng.randrange(0x10000, 0x10FFFF),
                                0x100, 0x20, 0x0A])
    return ["".join(chr(chars()) for _ in range(rng.randrange(0, 40))) for _ in range(count)]


def test_the_byte_tokenizer_json_gives_the_byte_tokenizers_ids(tmp_path):
    byte_tokenizer_json(tmp_path / "tokenizer.json")
    ours = ByteTokenizer()
    hf = HFTokenizer(str(tmp_path / "tokenizer.json"), byte_spelling()[0])
    assert (hf.vocab_size, hf.eos_id, hf.pad_id) == (256, ours.eos_id, ours.pad_id)
    for text in random_texts():
        ids = ours.encode(text)
        assert hf.encode(text) == ids, text
        assert hf.decode(ids + [ours.eos_id]) == ours.decode(ids + [ours.eos_id])
    rng = random.Random(1)                 # any ids, invalid utf-8 included: the same text
    for _ in range(500):
        ids = [rng.randrange(256) for _ in range(rng.randrange(1, 12))]
        assert hf.decode(ids) == ours.decode(ids), ids
    assert len(set(byte_spelling().values())) == 256


def test_a_dense_run_exports_as_the_same_model_with_its_tokenizer(tmp_path, capsys):
    run_dir, _ = write_dense_run(tmp_path)
    out = tmp_path / "export"
    assert export_cli.main([f"--run_dir={run_dir}", f"--out={out}"]) == 0
    assert "exported step 0" in capsys.readouterr().out
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
        "tokenizer_config.json"]
    config = json.loads((out / "config.json").read_text())
    # what transformers' save_pretrained writes beside config.json: the ids it sets
    assert json.loads((out / "generation_config.json").read_text()) == {
        "_from_model_config": True, **{k: config[k] for k in ("bos_token_id", "eos_token_id",
                                                              "pad_token_id")
                                       if config[k] is not None}}
    assert config["eos_token_id"] is not None
    exported, cfg = hf_llama.load_hf_llama(out)
    loaded = run_lib.load_run(run_dir)
    assert cfg == loaded.model_cfg.replace(init_std=cfg.init_std)  # HF does not record it
    tokens = jnp.asarray(np.arange(32).reshape(2, 16) * 7 % 256, jnp.int32)
    np.testing.assert_allclose(np.asarray(exported(tokens)[0]),
                               np.asarray(loaded.model(tokens)[0]), rtol=1e-5, atol=1e-5)
    eos = json.loads((out / "tokenizer_config.json").read_text())["eos_token"]
    assert HFTokenizer(str(out / "tokenizer.json"), eos).encode(TEXT) == list(TEXT.encode())
    assert not list(tmp_path.glob(".export.partial*"))


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_the_weights_get_the_mode_of_the_other_files(tmp_path, umask):
    """model.safetensors (one file or shards) is written 0666 less the umask like config.json,
    not safetensors' own 0600."""
    import os

    model = make_model(tiny_config("dense", vocab_size=256))
    old = os.umask(umask)
    try:
        one = hf_export.export_hf(model, tmp_path / "one")
        shards = hf_export.export_hf(model, tmp_path / "shards", max_shard_bytes=20000)
    finally:
        os.umask(old)
    files = [*one.iterdir(), *shards.iterdir()]
    assert len(list(shards.glob("*.safetensors"))) > 1
    assert {f.stat().st_mode & 0o777 for f in files} == {0o666 & ~umask}, \
        {f.name: oct(f.stat().st_mode & 0o777) for f in files}


def test_a_run_and_its_own_export_upcycle_together(tmp_path, monkeypatch):
    run_dir, data = write_dense_run(tmp_path)
    (tmp_path / "second").mkdir()
    other, _ = write_dense_run(tmp_path / "second", seed=1)
    out = tmp_path / "export"
    assert export_cli.main([f"--run_dir={other}", f"--out={out}"]) == 0
    merged = tmp_path / "dume"
    argv = [f"--run_dir={merged}", "--stats_batches=1", "--steps=1", "--top_k=2",
            f"--dense={run_dir}", f"--source={data.source}",
            f"--dense={out}", f"--source={data.source}"]
    assert upcycle_cli.main(argv) == 0
    loaded = run_lib.load_run(merged)
    assert loaded.model_cfg.block.experts.num_experts == 2
    # both exports alone (no run directory): the exported tokenizer.json is the byte tokenizer
    again = tmp_path / "export2"
    assert export_cli.main([f"--run_dir={run_dir}", f"--out={again}"]) == 0
    monkeypatch.chdir(tmp_path)                          # the folders given relative to it
    both = ["--run_dir=dume2", "--stats_batches=1", "--steps=1", "--top_k=2",
            f"--dense={again.name}", f"--source={data.source}", f"--dense={out.name}",
            f"--source={data.source}"]
    assert upcycle_cli.main(both) == 0
    assert run_lib.load_run(tmp_path / "dume2").tokenizer.encode("ab") == [97, 98]
    recorded = run_lib.load_configs(tmp_path / "dume2")[1].tokenizer_path
    assert recorded == str(again.resolve() / "tokenizer.json")    # readable from anywhere


@pytest.mark.parametrize("argv, needle", [
    ([], "--run_dir=DIR (a dense or MoE train.py run) and --out=DIR are required"),
    (["--run_dir=x", "--out=y", "--dtype=float16"], "--dtype=float16 is invalid"),
    (["--run_dir=/nonexistent", "--out=y"], "run directory /nonexistent does not exist"),
])
def test_bad_input_is_one_line_and_writes_nothing(argv, needle, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert export_cli.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and needle in err[0], err
    assert not list(tmp_path.iterdir())


def test_a_run_no_family_computes_or_a_used_out_dir_is_refused(tmp_path, capsys):
    run_dir, data = write_dense_run(tmp_path)
    used = tmp_path / "used"
    used.mkdir()
    (used / "keep.txt").write_text("mine")
    assert export_cli.main([f"--run_dir={run_dir}", f"--out={used}"]) == 2
    assert "not an empty directory" in capsys.readouterr().err
    assert [p.name for p in used.iterdir()] == ["keep.txt"]
    moe = make_model(tiny_config("moe", vocab_size=256))        # DAG-MoE's sigmoid router
    moe_dir = command.write_run(str(tmp_path / "moe"), moe, moe.cfg, data, steps=1,
                                trainable="all")
    assert export_cli.main([f"--run_dir={moe_dir}", f"--out={tmp_path / 'x'}"]) == 2
    assert "cannot be exported: RouterConfig.score_fn='sigmoid'" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_an_interrupted_export_leaves_nothing(tmp_path, capsys, monkeypatch):
    run_dir, _ = write_dense_run(tmp_path)

    def interrupted(*_args, **_kwargs):
        raise KeyboardInterrupt
    monkeypatch.setattr("dagmoe_jax.hf.tokenizer.export_tokenizer", interrupted)
    assert export_cli.main([f"--run_dir={run_dir}", f"--out={tmp_path / 'x'}"]) == 130
    assert capsys.readouterr().err.strip().splitlines() == [
        f"error: SIGINT received: nothing was written at {tmp_path / 'x'}"]
    assert not (tmp_path / "x").exists() and not list(tmp_path.glob(".x.partial"))


def test_an_imported_olmoe_exports_its_padding_id_and_generation_config(tmp_path, capsys):
    """An OLMoE folder whose tokenizer names a padding token (OLMoE's ``<|padding|>``) and
    whose ``generation_config.json`` sets sampling defaults: imported and exported, its
    config.json keeps ``pad_token_id`` (it was written null) and the folder's own
    generation_config.json comes back (none was written)."""
    import shutil
    from pathlib import Path

    from tokenizers import AddedToken

    from dagmoe_jax.cli import hf_import
    from dagmoe_jax.hf.tokenizer import byte_level_tokenizer
    folder = tmp_path / "olmoe"
    shutil.copytree(Path(__file__).parent / "fixtures" / "hf_moe" / "olmoe", folder)
    tok = byte_level_tokenizer()
    tok.add_special_tokens([AddedToken(t, special=True) for t in ("</s>", "<|padding|>")])
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "</s>",
         "pad_token": "<|padding|>"}))
    generation = {"eos_token_id": 256, "pad_token_id": 257, "temperature": 0.7}
    (folder / "generation_config.json").write_text(json.dumps(generation))
    run_dir, out = tmp_path / "run", tmp_path / "export"
    assert hf_import.main([f"--hf={folder}", f"--run_dir={run_dir}"]) == 0
    assert export_cli.main([f"--run_dir={run_dir}", f"--out={out}"]) == 0
    capsys.readouterr()
    config = json.loads((out / "config.json").read_text())
    assert (config["model_type"], config["eos_token_id"], config["pad_token_id"]) == (
        "olmoe", 256, 257)
    assert json.loads((out / "generation_config.json").read_text()) == generation
