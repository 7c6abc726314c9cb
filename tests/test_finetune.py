"""Fine-tuning: init_from a run directory (the starting parameters are the checkpoint's),
epochs over an instruct: source, trainable 'non_experts', the constant schedule, errors."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx

from dagmoe_jax import run as run_lib
from dagmoe_jax.config import ModelConfig
from dagmoe_jax.run.gin import load_configs
from dagmoe_jax.run.config import OptimConfig, RunConfig
from dagmoe_jax.train.init_from import load_initial_params, source_model_config
from dagmoe_jax.train.loop import train
from dagmoe_jax.run.records import read_metrics
from dagmoe_jax.run.optim import TRAINABLE, make_schedule
from dagmoe_jax.train.step import make_train_step
from conftest import build_once, make_model, single_device_env

REPO = Path(__file__).resolve().parent.parent
DATA = REPO / "tests" / "fixtures" / "instruct_tiny.jsonl"


def flat_params(model) -> dict:
    return {p: np.asarray(v[...]) for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory) -> Path:
    """A 2-step smoke run (built once for the whole run: conftest.build_once)."""
    def build(root: Path) -> str:
        configs = load_configs(["train/smoke.gin"], [
            "RunConfig.steps = 2", f"RunConfig.run_dir = '{root / 'run'}'",
            "RunConfig.task_eval_examples = 0", "RunConfig.tensorboard = False"])
        train(*configs, progress=False, log=lambda _m: None)
        return str(root / "run")
    return Path(build_once(tmp_path_factory, "pretrained", build))


def test_load_initial_params_equal_the_checkpoint(pretrained):
    model_cfg = source_model_config(str(pretrained), ModelConfig())
    loaded = run_lib.load_run(pretrained)
    assert loaded.step == 2
    model, _, _ = run_lib.build(model_cfg, OptimConfig(), RunConfig(seed=7))
    fresh = flat_params(model)
    message = load_initial_params(model, str(pretrained))
    assert "step 2" in message
    got, want = flat_params(model), flat_params(loaded.model)
    assert got.keys() == want.keys()
    assert all(np.array_equal(got[k], want[k]) for k in got)
    assert any(not np.array_equal(fresh[k], got[k]) for k in got)


def test_init_from_a_hugging_face_folder(tmp_path):
    """'hf:<folder>': the architecture and the parameters of an exported Llama."""
    from conftest import tiny_config
    from dagmoe_jax.hf.export import export_hf

    dense = make_model(tiny_config("dense", vocab_size=96), seed=3)
    folder = export_hf(dense, tmp_path / "llama")
    init_from = f"hf:{folder}"
    model_cfg = source_model_config(init_from, ModelConfig())
    assert (model_cfg.block.kind, model_cfg.vocab_size, model_cfg.num_kv_heads) == ("dense", 96, 2)
    model, _, _ = run_lib.build(model_cfg, OptimConfig(), RunConfig(seed=7))
    assert "the Hugging Face checkpoint" in load_initial_params(model, init_from)
    got, want = flat_params(model), flat_params(dense)
    assert got.keys() == want.keys()
    assert all(np.allclose(got[k], want[k], rtol=0, atol=0) for k in got)
    with pytest.raises(ValueError, match="has no config.json"):
        source_model_config(f"hf:{tmp_path / 'nothing'}", ModelConfig())


def test_the_smoke_config_reads_alpaca_and_sharegpt_files_alike(tmp_path):
    """finetune/smoke.gin detects the format per record (instruct_format 'auto', the documented
    default): the docs' smoke command bound to a ShareGPT copy of its Alpaca data reads the
    same conversations."""
    import json

    from dagmoe_jax.data import make_tokenizer
    from dagmoe_jax.data.instruct import instruct_stats

    sharegpt = tmp_path / "sharegpt.jsonl"
    with open(DATA, encoding="utf-8") as f, open(sharegpt, "w", encoding="utf-8") as out:
        for line in f:
            r = json.loads(line)
            prompt = f"{r['instruction']}\n\n{r['input']}" if r["input"] else r["instruction"]
            out.write(json.dumps({"conversations": [{"from": "human", "value": prompt},
                                                    {"from": "gpt", "value": r["output"]}]})
                      + "\n")
    stats = []
    for path in (DATA, sharegpt):
        data = load_configs(["finetune/smoke.gin"],
                            [f"DataConfig.source = 'instruct:{path}'"])[1]
        assert data.instruct_format == "auto"
        stats.append(instruct_stats(data, make_tokenizer(data), epochs=1))
    assert stats[0] == stats[1] and stats[0]["examples"] == 43


@pytest.mark.slow
def test_finetune_from_a_run_for_epochs(pretrained, tmp_path):
    run_dir = tmp_path / "sft"
    messages = []
    configs = load_configs(["finetune/smoke.gin"], [
        f"DataConfig.source = 'instruct:{DATA}'", f"RunConfig.init_from = '{pretrained}'",
        f"RunConfig.run_dir = '{run_dir}'", "RunConfig.epochs = 1",
        "RunConfig.tensorboard = False", "RunConfig.trainable = 'non_experts'",
        "DataConfig.batch_size = 8"])  # the tests' 8 CPU devices divide it
    result = train(*configs, progress=False, log=messages.append)
    text = "\n".join(messages)
    steps = int(re.search(r"1 epochs = (\d+) steps of 8 rows", text).group(1))
    assert "43 examples (0 truncated" in text and f"from {pretrained} (step 2)" in text
    assert result.step == steps >= 5 and not result.interrupted
    records = [r for r in read_metrics(run_dir) if "loss" in r]
    assert len(records) == steps and all(r["trained_tokens"] > 0 for r in records)
    assert 0 < result.eval["loss"] < 10
    # the experts kept the pre-trained weights; the rest moved
    before, after = run_lib.load_run(pretrained).model, run_lib.load_run(run_dir).model
    b, a = flat_params(before), flat_params(after)
    for path in b:
        same = np.array_equal(a[path], b[path])
        assert same == ("experts" in path), path
    assert run_lib.load_configs(run_dir)[3].steps == steps


@pytest.mark.slow
def test_a_finetuning_run_resumed_mid_epoch_is_bit_exact(pretrained, tmp_path):
    """Interrupted in the middle of an epoch and resumed from its checkpoint, fine-tuning
    reproduces the uninterrupted run's losses exactly (the SFT iterator is checkpointed)."""
    import shutil

    def configs(run_dir):
        return load_configs(["finetune/smoke.gin"], [
            f"DataConfig.source = 'instruct:{DATA}'", f"RunConfig.init_from = '{pretrained}'",
            f"RunConfig.run_dir = '{run_dir}'", "RunConfig.epochs = 2",
            "RunConfig.save_every = 4", "RunConfig.tensorboard = False",
            "RunConfig.async_checkpoint = False", "DataConfig.batch_size = 8"])

    ref = tmp_path / "ref"
    result = train(*configs(ref), progress=False, log=lambda _m: None)
    steps = result.step
    assert steps > 8
    losses = {r["step"]: r["loss"] for r in read_metrics(ref) if "loss" in r}
    resumed = tmp_path / "resumed"
    shutil.copytree(ref, resumed)
    for path in (resumed / "checkpoints").iterdir():           # keep only the step-4 save
        if path.name.isdigit() and int(path.name) > 4:
            shutil.rmtree(path)
    messages = []
    train(*configs(resumed), progress=False, log=messages.append)
    assert any("resumed from step 4" in m for m in messages)
    again = {r["step"]: r["loss"] for r in read_metrics(resumed) if "loss" in r}
    assert [again[s] for s in range(5, steps + 1)] == [losses[s] for s in range(5, steps + 1)]


def test_non_experts_freezes_the_experts(tiny):
    cfg = tiny()
    model, optimizer, _ = run_lib.build(cfg, OptimConfig(warmup_steps=0, schedule="constant"),
                                          RunConfig(steps=3, trainable="non_experts"))
    before = flat_params(model)
    rng = np.random.default_rng(0)
    tokens = rng.integers(1, cfg.vocab_size, (2, 17)).astype(np.int32)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:],
             "mask": np.ones((2, 16), bool),
             "segment_ids": np.repeat([[1] * 8 + [2] * 8], 2, axis=0).astype(np.int32)}
    step = make_train_step(wrt=TRAINABLE["non_experts"])
    step(model, optimizer, {k: jax.numpy.asarray(v) for k, v in batch.items()})
    after = flat_params(model)
    experts = [p for p in before if "experts" in p]
    assert experts
    for path in before:
        assert np.array_equal(before[path], after[path]) == (path in experts), path


def test_constant_schedule_without_warmup():
    schedule = make_schedule(OptimConfig(schedule="constant", warmup_steps=0,
                                         learning_rate=2e-5), 100)
    assert [float(schedule(s)) for s in (0, 50, 99, 200)] == pytest.approx([2e-5] * 4)


def test_bad_init_from_is_a_one_line_error(tmp_path):
    for value, words in ((str(tmp_path / "nope"), "is not a run directory"),
                         (f"hf:{tmp_path}", "has no config.json")):
        with pytest.raises(ValueError) as err:
            source_model_config(value, ModelConfig())
        assert words in str(err.value) and "\n" not in str(err.value)
    result = subprocess.run(
        [sys.executable, str(REPO / "train.py"), "--gin_file=finetune/smoke.gin",
         f"--run_dir={tmp_path / 'run'}", "--no_progress",
         f"--gin.RunConfig.init_from='{tmp_path / 'nope'}'"],
        capture_output=True, text=True, timeout=120, cwd=REPO,
        env={"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"})
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "is not a run directory" in lines[0], result.stderr


def test_architecture_conflict_is_a_one_line_error(pretrained):
    with pytest.raises(ValueError, match=r"ModelConfig.d_model=128 \(the source has 64\)"):
        source_model_config(str(pretrained), ModelConfig(d_model=128))
    cfg = source_model_config(str(pretrained), ModelConfig())
    assert cfg == run_lib.load_configs(pretrained)[0]


@pytest.fixture(scope="module")
def hf_source(tmp_path_factory) -> Path:
    """A step-0 run of a dense model (vocabulary 259) reading text with a Hugging Face
    tokenizer (conftest.write_special_tokenizer: BOS <s> named, EOS </s>)."""
    from conftest import tiny_config, write_special_tokenizer
    from dagmoe_jax.data import DataConfig

    root = tmp_path_factory.mktemp("hf_source")
    tokenizer_json = write_special_tokenizer(root / "tokenizer", "bos_named")
    cfg = tiny_config("dense", vocab_size=259, max_seq_len=64)
    run_dir = root / "run"
    run_lib.prepare_run_dir(run_dir)
    run_cfg = RunConfig(run_dir=str(run_dir), tensorboard=False)
    run_lib.save_configs(run_dir, cfg, DataConfig(tokenizer="hf", seq_len=64,
                                                  tokenizer_path=str(tokenizer_json)),
                         OptimConfig(), run_cfg)
    built, optimizer, _ = run_lib.build(cfg, OptimConfig(), run_cfg)
    run_lib.save_initial_checkpoint(run_dir, built, optimizer, cfg, run_cfg, None)
    return run_dir


def test_a_finetuned_run_reads_text_with_its_sources_tokenizer(hf_source, tmp_path):
    """`python train.py` fine-tuning a run that read text with a Hugging Face tokenizer trains
    with that tokenizer without any tokenizer binding, and its config.json says so."""
    import json

    run_dir = tmp_path / "sft"
    result = subprocess.run(
        [sys.executable, str(REPO / "train.py"), "--gin_file=finetune/smoke.gin",
         f"--run_dir={run_dir}", "--no_progress",
         f"--gin.RunConfig.init_from='{hf_source}'", "--gin.RunConfig.steps=2",
         f"--gin.DataConfig.source='instruct:{DATA}'", "--gin.DataConfig.seq_len=64",
         "--gin.RunConfig.epochs=0", "--gin.RunConfig.tensorboard=False",
         "--gin.RunConfig.task_eval_examples=0", "--gin.DataConfig.batch_size=8"],
        capture_output=True, text=True, timeout=600, cwd=REPO, env=single_device_env())
    assert result.returncode == 0, result.stderr[-2000:]
    blob = json.loads((run_dir / "config.json").read_text())
    source = json.loads((hf_source / "config.json").read_text())
    assert blob["data"]["tokenizer"] == "hf"
    # The run reads its own copy of the source's tokenizer: the same file.
    assert blob["data"]["tokenizer_path"] == str(run_dir / "tokenizer" / "tokenizer.json")
    assert blob["tokenizer"]["sha256"] == source["tokenizer"]["sha256"] != ""
    assert f"tokenizer: hf {source['data']['tokenizer_path']} (from {hf_source})" in result.stdout
    assert run_lib.load_run(run_dir).tokenizer.bos_id == 257


def test_another_tokenizer_for_a_finetuned_run_is_one_line_unless_meant(hf_source, tmp_path):
    from dagmoe_jax.data import DataConfig
    from dagmoe_jax.train.init_from import source_data_config

    mine = DataConfig(tokenizer="sentencepiece", tokenizer_path=str(tmp_path / "x.model"))
    with pytest.raises(ValueError, match=r"was trained with another tokenizer than the gin "
                                         r"config's: DataConfig.tokenizer='sentencepiece' "
                                         r"\(the source has 'hf'\)") as err:
        source_data_config(str(hf_source), mine)
    assert "tokenizer_from_source=False" in str(err.value) and "\n" not in str(err.value)
    assert source_data_config(str(hf_source), mine, tokenizer_from_source=False) is mine
    inherited = source_data_config(str(hf_source), DataConfig(seq_len=64))
    assert (inherited.tokenizer, inherited.seq_len) == ("hf", 64)


def test_a_hugging_face_source_lends_its_tokenizer_json(tmp_path):
    from conftest import tiny_config, write_special_tokenizer
    from dagmoe_jax.data import DataConfig
    from dagmoe_jax.hf.export import export_hf
    from dagmoe_jax.train.init_from import source_data_config

    folder = export_hf(make_model(tiny_config("dense", vocab_size=259)), tmp_path / "hf")
    with pytest.raises(ValueError, match="has neither tokenizer.json nor tokenizer.model"):
        source_data_config(f"hf:{folder}", DataConfig())
    write_special_tokenizer(folder, "bos_added")
    got = source_data_config(f"hf:{folder}", DataConfig())
    assert (got.tokenizer, got.tokenizer_path) == ("hf", str(folder / "tokenizer.json"))


def test_reading_a_run_with_another_tokenizer_file_is_refused(hf_source, tmp_path):
    """The run's config.json records its tokenizer file's SHA-256: evaluation, sampling and
    the harness (load_run) refuse a file that changed, or another tokenizer."""
    import dataclasses
    import shutil

    copy = tmp_path / "run"
    shutil.copytree(hf_source, copy)
    data_cfg = run_lib.load_configs(copy)[1]
    with pytest.raises(ValueError, match=r"trained with the 'hf' tokenizer, not 'byte'"):
        run_lib.load_run(copy, data_cfg=dataclasses.replace(data_cfg, tokenizer="byte",
                                                            tokenizer_path=""))
    tokenizer_json = Path(data_cfg.tokenizer_path)
    other = tmp_path / "other" / "tokenizer.json"
    other.parent.mkdir()
    shutil.copy(tokenizer_json.parent / "tokenizer_config.json", other.parent)
    other.write_text(tokenizer_json.read_text().replace('"<|eot|>"', '"<|end|>"'))
    with pytest.raises(ValueError, match=r"is not the file it trained with: restore") as err:
        run_lib.load_run(copy, data_cfg=dataclasses.replace(data_cfg,
                                                            tokenizer_path=str(other)))
    assert "\n" not in str(err.value)
    assert run_lib.load_run(copy).tokenizer.eos_id == 256


def test_a_dataset_with_nothing_to_train_exits_2_and_writes_nothing(tmp_path):
    """Every example longer than seq_len + 1 and cut from its head before its answer: one line,
    exit 2, and
    no run directory (it is created only once the data is found trainable)."""
    import json

    data = tmp_path / "long.jsonl"
    data.write_text("".join(json.dumps({"instruction": "why? " * 40, "output": "because"}) + "\n"
                            for _ in range(12)))
    run_dir = tmp_path / "runs" / "sft"
    result = subprocess.run(
        [sys.executable, str(REPO / "train.py"), "--gin_file=finetune/smoke.gin",
         f"--run_dir={run_dir}", "--no_progress", f"--gin.DataConfig.source='instruct:{data}'",
         "--gin.DataConfig.seq_len=32", "--gin.DataConfig.batch_size=8",
         "--gin.DataConfig.truncation='head'"],     # (LlamaFactory's cut would keep answers)
        capture_output=True, text=True, timeout=300, cwd=REPO, env=single_device_env())
    assert result.returncode == 2, result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: no example of instruct:")
    assert "within seq_len + 1 = 33 tokens (11 of 11 examples are longer" in lines[0]
    assert "raise DataConfig.seq_len" in lines[0]
    assert not run_dir.exists()


def test_a_chat_template_is_inherited_only_where_the_source_chose_one(hf_source, tmp_path):
    import json
    import shutil

    from dagmoe_jax.data import DataConfig
    from dagmoe_jax.train.init_from import source_data_config

    plain = source_data_config(str(hf_source), DataConfig(chat_template="plain"))
    assert plain.chat_template == "plain"                  # the pre-trained run chose none
    chose = tmp_path / "sft_run"
    shutil.copytree(hf_source, chose)
    blob = json.loads((chose / "config.json").read_text())
    blob["data"]["chat_template"] = "plain"
    (chose / "config.json").write_text(json.dumps(blob))
    assert source_data_config(str(chose), DataConfig()).chat_template == "plain"
    with pytest.raises(ValueError, match=r"DataConfig.chat_template='x.jinja' \(the source has "
                                         r"'plain'\)"):
        source_data_config(str(chose), DataConfig(chat_template="x.jinja"))


@pytest.mark.slow
def test_no_hold_out_trains_on_every_example(tmp_path):
    """DataConfig.heldout_fraction = 0 (LlamaFactory's and the paper's: all data trains):
    every example is in the epoch, the run trains and says it has no held-out evaluation, and
    --mode=eval asks for an --eval_source in one line."""
    from dagmoe_jax.data import DataConfig, make_tokenizer
    from dagmoe_jax.data.instruct import instruct_stats

    data = DataConfig(source=f"instruct:{DATA}", seq_len=128, batch_size=8)
    tok = make_tokenizer(data)
    held, every = (instruct_stats(data.replace(heldout_fraction=f), tok, epochs=1)["examples"]
                   for f in (0.05, 0.0))
    assert every > held
    run_dir = tmp_path / "sft"
    messages = []
    configs = load_configs(["finetune/smoke.gin"], [
        f"DataConfig.source = 'instruct:{DATA}'", "DataConfig.heldout_fraction = 0.0",
        f"RunConfig.run_dir = '{run_dir}'", "RunConfig.epochs = 1",
        "RunConfig.tensorboard = False", "RunConfig.eval_every = 2",
        "DataConfig.batch_size = 8",
        # a small model: the path under test is the data's, and the tests' 8 CPU devices run
        # the default model's dropless experts through XLA's slow ragged_dot
        "ModelConfig.d_model = 64", "ModelConfig.num_layers = 2"])
    result = train(*configs, progress=False, log=messages.append)
    text = "\n".join(messages)
    assert f"fine-tuning data: {every} examples" in text
    assert "no held-out evaluation" in text and result.eval == {} and result.step >= 2
    from dagmoe_jax.evaluation import evaluate_checkpoint      # what --mode=eval runs
    with pytest.raises(ValueError, match=r"trained on all of its data \(heldout_fraction 0\): "
                                         r"pass --eval_source=SPEC") as err:
        evaluate_checkpoint(str(run_dir))
    assert "\n" not in str(err.value)


def test_finetuning_from_a_hugging_face_folder_makes_one_self_contained_record(tmp_path,
                                                                                 capsys):
    """Fine-tuning from hf:FOLDER: a tokenizer binding that contradicts the folder's is one
    line (exit 2, nothing written) even where it binds the default's value; without it the
    run's operative_config.gin and config.json describe the same run; the run carries its
    own copy of the tokenizer, so it samples after the folder has moved; and dagmoe-sample
    and evaluation read hf:FOLDER itself, as every command that reads a run does."""
    import json
    import shutil

    from conftest import tiny_config, write_special_tokenizer
    from dagmoe_jax.cli import sample as sample_cli
    from dagmoe_jax.cli import train as train_cli
    from dagmoe_jax.evaluation import evaluate_checkpoint
    from dagmoe_jax.hf.export import export_hf

    folder = export_hf(make_model(tiny_config("dense", vocab_size=259, max_seq_len=64)),
                       tmp_path / "hf")
    write_special_tokenizer(folder, "bos_named")
    run_dir = tmp_path / "sft"
    argv = ["--gin_file=finetune/smoke.gin", f"--run_dir={run_dir}", "--no_progress",
            f"--gin.RunConfig.init_from='hf:{folder}'", "--gin.RunConfig.epochs=0",
            "--gin.RunConfig.steps=2", f"--gin.DataConfig.source='instruct:{DATA}'",
            "--gin.DataConfig.seq_len=64", "--gin.RunConfig.tensorboard=False",
            "--gin.RunConfig.task_eval_examples=0", "--gin.DataConfig.batch_size=8"]
    assert train_cli.main([*argv, "--gin.DataConfig.tokenizer='byte'"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "DataConfig.tokenizer='byte' (the source has 'hf')" in err
    assert not run_dir.exists()

    assert train_cli.main(argv) == 0
    capsys.readouterr()
    blob = json.loads((run_dir / "config.json").read_text())
    assert blob["data"]["tokenizer_path"] == str(run_dir / "tokenizer" / "tokenizer.json")
    assert sorted(p.name for p in (run_dir / "tokenizer").iterdir()) == [
        "generation_config.json", "tokenizer.json", "tokenizer_config.json"]
    # The operative config, read back by gin, is the run's model and tokenizer.
    model_cfg, data_cfg, _, _ = load_configs([str(run_dir / run_lib.OPERATIVE_GIN)])
    recorded_model, recorded_data, _, _ = run_lib.load_configs(run_dir)
    assert model_cfg == recorded_model
    assert ((data_cfg.tokenizer, data_cfg.tokenizer_path)
            == (recorded_data.tokenizer, recorded_data.tokenizer_path) == ("hf", str(
                run_dir / "tokenizer" / "tokenizer.json")))

    prompt = ["--prompt=hello", "--max_new_tokens=3"]
    assert sample_cli.main([f"--run_dir=hf:{folder}", *prompt]) == 0
    assert "--- sample 0 ---" in capsys.readouterr().out
    docs = tmp_path / "docs.txt"
    docs.write_text("hello world. " * 60)
    capsys.readouterr()
    scored = evaluate_checkpoint(f"hf:{folder}", eval_source=f"text:{docs}",
                                 data_overrides={"seq_len": 32, "batch_size": 2})
    assert scored["step"] == 0 and 0 < scored["loss"] < 20
    assert capsys.readouterr().out == ""            # library code does not print
    shutil.move(folder, tmp_path / "moved")
    assert sample_cli.main([f"--run_dir={run_dir}", *prompt]) == 0
    assert "--- sample 0 ---" in capsys.readouterr().out
    # The run itself moves too: it reads its own copy where the recorded path is gone.
    shutil.move(run_dir, tmp_path / "sft_moved")
    assert run_lib.load_run(tmp_path / "sft_moved").tokenizer.bos_id == 257
