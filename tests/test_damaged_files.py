"""Damaged files are bad input (issue 69, item 2): a truncated or empty safetensors file, a
truncated, empty or non-UTF-8 ``config.json`` / ``tokenizer.json`` / ``tokenizer_config.json``
and a damaged Parquet row group are one line naming the file (exit 2), and nothing is written.
Each reading path: ``dagmoe-import``, ``hf:`` sampling and loading (``load_hf_run``, which
``init_from='hf:'`` and the harness use), and the data a run reads; a run's own damaged
checkpoint is tests/test_checkpoint.py's."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from conftest import write_byte_level_tokenizer
from dagmoe_jax.cli import hf_import, sample
from dagmoe_jax.hf.run import load_hf_run

MIXTRAL = Path(__file__).resolve().parent / "fixtures" / "hf_moe" / "mixtral"


def _half(path: Path) -> None:
    os.truncate(path, path.stat().st_size // 2)


DAMAGE = {
    "half": _half,
    "empty": lambda path: path.write_bytes(b""),
    "100 bytes": lambda path: os.truncate(path, 100),
    "not utf-8": lambda path: path.write_bytes(b"\xff\xfe\x00 not text"),
}
CASES = [("model.safetensors", "half", "is not a readable safetensors file"),
         ("model.safetensors", "empty", "is not a readable safetensors file"),
         ("model.safetensors", "100 bytes", "is not a readable safetensors file"),
         ("config.json", "half", "is not valid JSON"),
         ("config.json", "not utf-8", "is not UTF-8 text"),
         ("tokenizer.json", "half", "is not a Hugging Face tokenizer.json"),
         ("tokenizer.json", "empty", "is not a Hugging Face tokenizer.json"),
         ("tokenizer_config.json", "half", "is not valid JSON"),
         ("tokenizer_config.json", "not utf-8", "is not UTF-8 text")]


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory) -> Path:
    """transformers' own small Mixtral folder with a byte-level tokenizer beside it."""
    folder = tmp_path_factory.mktemp("hf") / "mixtral"
    shutil.copytree(MIXTRAL, folder)
    write_byte_level_tokenizer(folder)
    return folder


def _one_line(capsys, file: Path, needle: str) -> None:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    assert str(file) in err[0] and needle in err[0], err


@pytest.mark.parametrize("name,how,needle", CASES, ids=[f"{n}-{h}" for n, h, _ in CASES])
def test_a_damaged_folder_file_is_one_line_on_every_reading_path(name, how, needle, mixtral,
                                                                  tmp_path, capsys):
    folder = tmp_path / "hf"
    shutil.copytree(mixtral, folder)
    DAMAGE[how](folder / name)
    out = tmp_path / "run"
    assert hf_import.main([f"--hf={folder}", f"--run_dir={out}"]) == 2
    _one_line(capsys, folder / name, needle)
    assert not out.exists()
    assert sample.main([f"--run_dir=hf:{folder}", "--prompt=hi", "--max_new_tokens=2"]) == 2
    _one_line(capsys, folder / name, needle)
    with pytest.raises(ValueError, match=needle):
        load_hf_run(folder).model                               # init_from='hf:', the harness


def test_a_damaged_shard_is_named_when_the_folder_is_opened(mixtral, tmp_path, capsys):
    """A sharded folder: a shard cut short is named before anything is read or written."""
    from dagmoe_jax.hf.llama import SafetensorsReader
    from safetensors.numpy import save_file
    folder = tmp_path / "hf"
    shutil.copytree(mixtral, folder)
    reader = SafetensorsReader(folder)
    names = sorted(reader.keys())
    halves = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    for shard, part in halves.items():
        save_file({n: reader[n] for n in part}, str(folder / shard))
    (folder / "model.safetensors").unlink()
    (folder / "model.safetensors.index.json").write_text(
        '{"weight_map": {' + ", ".join(f'"{n}": "{s}"' for s, part in halves.items()
                                       for n in part) + "}}")
    assert sorted(SafetensorsReader(folder).keys()) == names        # the shards read whole
    _half(folder / "model-00002-of-00002.safetensors")
    out = tmp_path / "run"
    assert hf_import.main([f"--hf={folder}", f"--run_dir={out}"]) == 2
    _one_line(capsys, folder / "model-00002-of-00002.safetensors",
              "is not a readable safetensors file")
    assert not out.exists()


@pytest.mark.parametrize("text, needle", [
    ('{"weight_map": {"a": ', "is not valid JSON"),
    ("\udcff", "is not UTF-8 text"),
    ('["a"]', "has no 'weight_map'"),
    ('{"weight_map": {"model.embed_tokens.weight": "model-00009-of-00009.safetensors"}}',
     "shard model-00009-of-00009.safetensors listed in")])
def test_a_damaged_or_foreign_shard_index_is_one_line(text, needle, mixtral, tmp_path, capsys):
    """A cut, non-UTF-8 or foreign ``model.safetensors.index.json``, or one naming a shard
    the folder lacks: one line naming the index before anything is written."""
    folder = tmp_path / "hf"
    shutil.copytree(mixtral, folder)
    index = folder / "model.safetensors.index.json"
    if text == "\udcff":
        index.write_bytes(b'{"weight_map": "\xff"}')
    else:
        index.write_text(text)
    out = tmp_path / "run"
    assert hf_import.main([f"--hf={folder}", f"--run_dir={out}"]) == 2
    _one_line(capsys, index, needle)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]


def test_a_folder_whose_weights_disagree_names_its_family(mixtral, tmp_path, capsys):
    """A Mixtral whose config.json counts fewer experts than its weights hold: the line says
    Mixtral, not Llama."""
    import json
    folder = tmp_path / "hf"
    shutil.copytree(mixtral, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "num_local_experts": 2}))
    assert hf_import.main([f"--hf={folder}", f"--run_dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "has no place in a Mixtral of this config.json" in err[0], err


def test_a_damaged_parquet_row_group_is_one_line(tmp_path):
    """A Parquet file whose footer reads but whose pages are damaged: the row group that
    cannot be read is named (a file cut short is refused when the source opens)."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from dagmoe_jax.data.parquet import ParquetSource
    path = tmp_path / "d.parquet"
    pq.write_table(pa.table({"text": [f"document {i} " * 20 for i in range(100)]}), path,
                   row_group_size=50)
    blob = bytearray(path.read_bytes())
    blob[100:2000] = bytes(1900)
    path.write_bytes(bytes(blob))
    source = ParquetSource([str(path)], "text", "parquet:d")
    with pytest.raises(ValueError, match=r"d.parquet row group 0 cannot be read .* damaged"):
        source[0]
    cut = tmp_path / "cut.parquet"
    cut.write_bytes(bytes(blob[: len(blob) // 2]))
    with pytest.raises(ValueError, match="is not a Parquet file"):
        ParquetSource([str(cut)], "text", "parquet:cut")


@pytest.mark.parametrize("cut, needle", [
    ("mid-record", r"line 4: not JSON"),
    ("mid-character", r"line 4: not UTF-8 text \(unexpected end of data")])
def test_a_jsonl_cut_short_is_one_line_naming_its_line(cut, needle, tmp_path):
    """Instruction data in JSON lines cut short (a copy interrupted): the line is named, in a
    record or inside a character of it."""
    from dagmoe_jax.data.instruct_records import InstructSource
    record = {"messages": [{"role": "user", "content": "héllo"},
                           {"role": "assistant", "content": "ça va — très bien"}]}
    line = json.dumps(record, ensure_ascii=False).encode()
    data = (line + b"\n") * 4
    end = data.rfind("—".encode()) + 1 if cut == "mid-character" else len(data) - 8
    path = tmp_path / "chat.jsonl"
    path.write_bytes(data[:end])
    with pytest.raises(ValueError, match=f"chat.jsonl {needle}"):
        InstructSource([str(path)], "messages")
