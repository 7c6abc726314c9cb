"""Record sources on small local data made in tmp_path, and their one-line errors."""

import json
import re

import numpy as np
import pytest

from dagmoe_jax.data import (DataConfig, eval_batches, eval_source, make_tokenizer, train_dataset,
                             train_source)
from dagmoe_jax.data.sources import (HELDOUT_STREAM, TRAIN_STREAM, SyntheticSource, open_source,
                                     record_text)
from dagmoe_jax.data.tasks import parse


def _records(src):
    return [src[i] for i in range(len(src))]


def _raises(match, fn, exc=ValueError):
    with pytest.raises(exc, match=match) as err:
        fn()
    assert "\n" not in str(err.value), str(err.value)


def test_synthetic_source_is_lazy_deterministic_and_split_by_stream():
    cfg = DataConfig(source="synthetic:lis,lcs", num_synthetic=50, num_synthetic_eval=20)
    train = open_source(cfg, "source", stream=TRAIN_STREAM)
    held = open_source(cfg, "source", stream=HELDOUT_STREAM)
    assert (len(train), len(held)) == (50, 20)
    again = open_source(cfg, "source", stream=TRAIN_STREAM)
    assert _records(train) == _records(again)
    assert _records(train)[:20] != _records(held)
    for i, text in enumerate(_records(train)):
        task, inputs, answer = parse(text)
        assert task == ("lis", "lcs")[i % 2] and 4 <= len(inputs[0]) <= 12
    other = SyntheticSource(("lis", "lcs"), 50, stream=TRAIN_STREAM, seed=1, min_size=4,
                            max_size=12)
    assert _records(other) != _records(train)  # synthetic_seed changes the content


def test_text_glob_documents(tmp_path):
    (tmp_path / "b.txt").write_text("second file doc\n")
    (tmp_path / "a.txt").write_text("doc one line 1\nline 2\n\n\n  \t\ndoc two\r\n\ndoc three")
    (tmp_path / "c.md").write_text("not matched\n")
    cfg = DataConfig(source=f"text:{tmp_path}/*.txt")
    src = open_source(cfg, "source")
    assert _records(src) == ["doc one line 1\nline 2", "doc two", "doc three", "second file doc"]
    both = open_source(DataConfig(source=f"text:{tmp_path}/c.md,{tmp_path}/*.txt"), "source")
    assert _records(both)[0] == "not matched" and len(both) == 5


def test_text_errors(tmp_path):
    (tmp_path / "blank.txt").write_text("\n  \n\n")
    spec = f"text:{tmp_path}/*.nothing"
    _raises(re.escape(f"DataConfig.source='{spec}' matched no file"),
            lambda: open_source(DataConfig(source=spec), "source"))
    spec = f"text:{tmp_path}/missing.txt"
    _raises(re.escape(f"DataConfig.source='{spec}' names a path that does not exist"),
            lambda: open_source(DataConfig(source=spec), "source"))
    _raises(r"names a directory .*: use a glob",
            lambda: open_source(DataConfig(source=f"text:{tmp_path}"), "source"))
    spec = f"text:{tmp_path}/blank.txt"
    _raises(re.escape(f"DataConfig.source='{spec}' is empty"),
            lambda: open_source(DataConfig(source=spec), "source"))
    _raises(r"DataConfig.eval_source='text:.*' matched no file",
            lambda: open_source(DataConfig(eval_source=f"text:{tmp_path}/x*"), "eval_source"))


def test_jsonl(tmp_path):
    rows = [{"text": "first", "id": 1}, {"text": ""}, {"text": "third \u00e9"}]
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    src = open_source(DataConfig(source=f"jsonl:{tmp_path}/*.jsonl"), "source")
    assert _records(src) == ["first", "third \u00e9"]  # empty text skipped
    (tmp_path / "e.jsonl").write_text(json.dumps({"body": "x"}) + "\n")
    src = open_source(DataConfig(source=f"jsonl:{tmp_path}/e.jsonl", text_key="body"), "source")
    assert _records(src) == ["x"]


def test_jsonl_errors(tmp_path):
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n{"content": "no text key"}\n')
    path = tmp_path / "bad.jsonl"
    _raises(re.escape(f"{path} line 2") + r" has no string under DataConfig.text_key='text'",
            lambda: open_source(DataConfig(source=f"jsonl:{path}"), "source"))
    (tmp_path / "broken.jsonl").write_text('{"text": "ok"}\n{"text": \n')
    _raises(r"broken.jsonl line 2 is not valid JSON",
            lambda: open_source(DataConfig(source=f"jsonl:{tmp_path}/broken.jsonl"), "source"))
    (tmp_path / "empty.jsonl").write_text('{"text": ""}\n')
    _raises(r"is empty", lambda: open_source(
        DataConfig(source=f"jsonl:{tmp_path}/empty.jsonl"), "source"))


def _write_array_record(path, records):
    from array_record.python.array_record_module import ArrayRecordWriter
    writer = ArrayRecordWriter(str(path), "group_size:1")
    for r in records:
        writer.write(r)
    writer.close()


def test_array_record(tmp_path):
    _write_array_record(tmp_path / "p-0.array_record", [b"plain text", "caf\u00e9".encode()])
    _write_array_record(tmp_path / "p-1.array_record",
                        [json.dumps({"text": "from json", "n": 3}).encode(), b"{not json"])
    src = open_source(DataConfig(source=f"array_record:{tmp_path}/p-*.array_record"), "source")
    assert _records(src) == ["plain text", "caf\u00e9", "from json", "{not json"]
    with pytest.raises(ValueError, match=r"has no DataConfig.text_key='body'"):
        record_text(json.dumps({"text": "x"}).encode(), "body")
    _write_array_record(tmp_path / "none.array_record", [])
    _raises(r"DataConfig.source='array_record:.*none.array_record' is empty", lambda: open_source(
        DataConfig(source=f"array_record:{tmp_path}/none.array_record"), "source"))
    _raises(r"matched no file", lambda: open_source(
        DataConfig(source=f"array_record:{tmp_path}/*.nope"), "source"))


@pytest.fixture(scope="module")
def tfds_dir(tmp_path_factory):
    """A tiny TFDS dataset prepared locally in ArrayRecord format (no network, no TF)."""
    import tensorflow_datasets as tfds

    class DagmoeTinyText(tfds.core.GeneratorBasedBuilder):
        VERSION = tfds.core.Version("1.0.0")

        def _info(self):
            return tfds.core.DatasetInfo(builder=self, features=tfds.features.FeaturesDict(
                {"text": tfds.features.Text(), "label": tfds.features.Scalar(dtype=np.int32)}))

        def _split_generators(self, dl_manager):
            return {"train": self._generate_examples(12, "train"),
                    "validation": self._generate_examples(3, "val")}

        def _generate_examples(self, n, prefix):
            for i in range(n):
                yield i, {"text": f"{prefix} doc {i} caf\u00e9", "label": i}

    data_dir = tmp_path_factory.mktemp("tfds")
    tfds.disable_progress_bar()
    DagmoeTinyText(data_dir=str(data_dir), file_format="array_record").download_and_prepare()
    return str(data_dir)


def test_tfds(tfds_dir):
    cfg = DataConfig(source="tfds:dagmoe_tiny_text", tfds_data_dir=tfds_dir,
                     eval_split="validation")
    train = _records(open_source(cfg, "source"))
    assert sorted(train) == sorted(f"train doc {i} caf\u00e9" for i in range(12))
    val = _records(open_source(cfg, "source", split="validation"))
    assert sorted(val) == [f"val doc {i} caf\u00e9" for i in range(3)]


def test_tfds_errors(tfds_dir, tmp_path):
    _raises(rf"DataConfig.source='tfds:dagmoe_tiny_text' is not prepared in {tmp_path}: prepare "
            r"it there first", lambda: open_source(DataConfig(
                source="tfds:dagmoe_tiny_text", tfds_data_dir=str(tmp_path)), "source"))
    _raises(r"DataConfig.source='tfds:no_such_dataset_xyz' is not prepared", lambda: open_source(
        DataConfig(source="tfds:no_such_dataset_xyz", tfds_data_dir=tfds_dir), "source"))
    # a registered catalog dataset that is not prepared must not start a download
    _raises(r"DataConfig.source='tfds:mnist' is not prepared", lambda: open_source(
        DataConfig(source="tfds:mnist", tfds_data_dir=str(tmp_path)), "source"))
    _raises(r"DataConfig.text_key='body' is not a feature of .*\(features: ", lambda: open_source(
        DataConfig(source="tfds:dagmoe_tiny_text", tfds_data_dir=tfds_dir, text_key="body"),
        "source"))
    _raises(r"split 'test' cannot be read", lambda: open_source(DataConfig(
        source="tfds:dagmoe_tiny_text", tfds_data_dir=tfds_dir, split="test"), "source"))


def test_tfds_pipeline_with_eval_split(tfds_dir):
    cfg = DataConfig(source="tfds:dagmoe_tiny_text", tfds_data_dir=tfds_dir,
                     eval_split="validation", seq_len=8, batch_size=2)
    tok = make_tokenizer(cfg)
    assert len(train_source(cfg)) == 12  # nothing held out: eval_split is the eval data
    val = _records(eval_source(cfg))
    assert sorted(val) == [f"val doc {i} caf\u00e9" for i in range(3)]
    rows = [np.append(b["inputs"][r], b["targets"][r, -1])[:b["mask"][r].sum() + 1]
            for b in eval_batches(cfg, tok) for r in range(2) if b["mask"][r].any()]
    assert tok.decode(np.concatenate(rows).tolist()) == "\x00".join(val) + "\x00"
    batch = next(iter(train_dataset(cfg, tok)))
    assert batch["inputs"].shape == (2, 8)
    held = DataConfig(source="tfds:dagmoe_tiny_text", tfds_data_dir=tfds_dir, seq_len=8)
    assert len(train_source(held)) == 11  # 5% of 12 rounds to 0: at least one held out


def test_binary_or_latin1_text_is_trained_on_with_a_warning(tmp_path, monkeypatch, caplog):
    """Latin-1 text and binary files were trained on without a word (as U+FFFD characters and
    NULs). Each now logs one warning naming the file, the offset and the fix; UTF-8 text whose
    multi-byte characters straddle the scan's blocks does not."""
    import logging

    from dagmoe_jax.data.sources import TextSource

    monkeypatch.setattr(TextSource, "_BLOCK", 7)        # characters cut across blocks
    good = tmp_path / "good.txt"
    good.write_text("café crème brûlée\n\nnaïve – “quoted” 日本語\n", encoding="utf-8")
    latin = tmp_path / "latin.txt"
    latin.write_bytes("plain words, then café\n".encode("latin-1"))
    binary = tmp_path / "model.bin"
    binary.write_bytes(b"GGUF\x00\x01\x02\x03 weights\n")
    with caplog.at_level(logging.WARNING, logger="dagmoe_jax.data.sources"):
        assert TextSource([str(good)])[1] == "naïve – “quoted” 日本語"
        assert not caplog.records
        TextSource([str(latin), str(binary)])
        TextSource([str(latin)])                          # once per file
    assert [r.getMessage() for r in caplog.records] == [
        f"{latin} is not UTF-8 text (byte 0xe9 at offset 21 is not valid UTF-8; Latin-1?): its "
        f"undecodable bytes train as U+FFFD replacement characters; convert it (iconv -f latin1 "
        f"-t utf-8) or leave it out",
        f"{binary} looks binary (a NUL byte at offset 4), not text: leave it out of "
        f"DataConfig.source"]


def _parquet(path, texts, **columns):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": texts, **columns}), str(path), row_group_size=7)
    return path


def test_parquet_is_read_by_column(tmp_path):
    a = _parquet(tmp_path / "a.parquet", [f"alpha {i}" for i in range(20)], id=list(range(20)))
    b = _parquet(tmp_path / "b.parquet", [f"beta {i}" for i in range(5)], id=list(range(5)))
    cfg = DataConfig(source=f"parquet:{tmp_path}/*.parquet", heldout_fraction=0.2)
    src = open_source(cfg, "source")
    assert len(src) == 25 and src[0] == "alpha 0" and src[19] == "alpha 19"
    assert src[20] == "beta 0" and [src[i] for i in (8, 7, 6)] == ["alpha 8", "alpha 7", "alpha 6"]
    assert len(train_source(cfg)) + len(eval_source(cfg)) == 25
    batch = next(iter(train_dataset(cfg.replace(seq_len=16, batch_size=2), make_tokenizer(cfg))))
    assert batch["inputs"].shape == (2, 16)
    _raises(r"a.parquet has no column DataConfig.text_key='body' \(columns: 'text', 'id'\): "
            r"set text_key", lambda: open_source(cfg.replace(text_key="body"), "source"))
    (tmp_path / "bad.parquet").write_text("not parquet")
    _raises(r"bad.parquet is not a Parquet file",
            lambda: open_source(cfg.replace(source=f"parquet:{tmp_path}/bad.parquet"), "source"))
    del a, b


def test_a_mixture_draws_by_weight_and_resumes_exactly(tmp_path):
    """CoE's 1:1 mixture: over 10,000 records each source within 2% of its weight, a small
    source repeating rather than cutting the large one short; a saved iterator resumes with
    the same batches; evaluation mixes the components' held-out records alike."""
    from collections import Counter

    from dagmoe_jax.data.splits import describe_mixture, mixed_train_records

    _parquet(tmp_path / "web.parquet", [f"web page {i}" for i in range(3000)])
    (tmp_path / "math.jsonl").write_text("".join(json.dumps({"text": f"math {i}"}) + "\n"
                                                 for i in range(200)))
    spec = f"mix:1*parquet:{tmp_path}/web.parquet,1*jsonl:{tmp_path}/math.jsonl"
    cfg = DataConfig(source=spec, seq_len=16, batch_size=2)
    records = mixed_train_records(cfg)
    counts = Counter(records[i].split()[0] for i in range(10_000))
    assert abs(counts["web"] - 5000) <= 200 and abs(counts["math"] - 5000) <= 200
    assert len({records[i] for i in range(10_000) if records[i].startswith("web")}) > 2000
    ds = train_dataset(cfg, make_tokenizer(cfg))
    it = iter(ds)
    for _ in range(5):
        next(it)
    state = it.get_state()
    want = [next(it)["inputs"] for _ in range(3)]
    again = iter(train_dataset(cfg, make_tokenizer(cfg)))
    again.set_state(state)
    assert all(np.array_equal(a, next(again)["inputs"]) for a in want)
    held = Counter(eval_source(cfg)[i].split()[0] for i in range(len(eval_source(cfg))))
    assert held["web"] == held["math"] == 10               # 5% of math's 200, as many of web
    uneven = mixed_train_records(cfg.replace(source=spec.replace("1*parquet", "3*parquet")))
    share = sum(uneven[i].startswith("web") for i in range(10_000)) / 10_000
    assert abs(share - 0.75) < 0.02
    # What the start-up prints: each weight, source and size, and that the weights (summing
    # to 2 as written) were normalised; weights summing to 1 need no such word.
    line = describe_mixture(cfg)
    assert line == (f"mixture of 2 sources: 0.5 of parquet:{tmp_path}/web.parquet (2,850 "
                    f"records), 0.5 of jsonl:{tmp_path}/math.jsonl (190 records); weights 1, 1 "
                    "(sum 2) normalised to sum to 1")
    heard = []              # the stream says the same of the components it opened
    mixed_train_records(cfg, log=heard.append)
    assert heard == [line]
    assert "normalised" not in describe_mixture(cfg.replace(source=spec.replace("1*", "0.5*")))
    assert describe_mixture(DataConfig(source=f"jsonl:{tmp_path}/math.jsonl")) is None
    _raises(r"mixed sources of kinds .* \(not 'instruct'\)",
            lambda: DataConfig(source=f"mix:1*instruct:{tmp_path}/math.jsonl"))
    _raises(r"a weight first", lambda: DataConfig(source=f"mix:jsonl:{tmp_path}/math.jsonl"))
