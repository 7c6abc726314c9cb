"""Tokenizers: byte, SentencePiece (trained here) and HF tokenizer.json (built here)."""

import pickle

import numpy as np
import pytest

from conftest import SPECIAL_TOKENIZER_KINDS, write_special_tokenizer
from dagmoe_jax.data import (DataConfig, check_tokens, make_tokenizer, task_eval_batches,
                             train_dataset, train_source)
from dagmoe_jax.data.tasks import parse
from dagmoe_jax.data.tokenizers import ByteTokenizer, HFTokenizer, SentencePieceTokenizer

SAMPLES = ["lis 3 1 4 = 3\n", "edit abca acb = 2\nthe lazy dog", "héllo wörld"]
CORPUS = [f"the quick brown fox {i} jumps over the lazy dog = {i * 7}" for i in range(200)]


def test_byte_round_trip():
    tok = make_tokenizer(DataConfig())
    assert isinstance(tok, ByteTokenizer)
    assert (tok.vocab_size, tok.eos_id, tok.pad_id) == (256, 0, 0)
    for s in SAMPLES:
        ids = tok.encode(s)
        assert ids == list(s.encode("utf-8")) and tok.decode(ids) == s
    assert tok.decode([0xC3]) == "\ufffd"  # a cut utf-8 sequence decodes with a replacement
    assert tok.decode([104, 300, 105]) == "h\ufffdi"  # ids past the byte range too


@pytest.fixture(scope="module")
def sp_model(tmp_path_factory):
    import sentencepiece as spm
    d = tmp_path_factory.mktemp("sp")
    (d / "corpus.txt").write_text("\n".join(CORPUS))
    spm.SentencePieceTrainer.train(
        input=str(d / "corpus.txt"), model_prefix=str(d / "tiny"), vocab_size=320,
        model_type="bpe", normalization_rule_name="identity", remove_extra_whitespaces=False,
        user_defined_symbols=["\n"], byte_fallback=True, minloglevel=2)
    return str(d / "tiny.model")


@pytest.fixture(scope="module")
def hf_json(tmp_path_factory):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<pad>", "<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    path = tmp_path_factory.mktemp("hf") / "tokenizer.json"
    tok.save(str(path))
    return str(path)


def test_sentencepiece_round_trip(sp_model):
    tok = make_tokenizer(DataConfig(tokenizer="sentencepiece", tokenizer_path=sp_model))
    assert isinstance(tok, SentencePieceTokenizer)
    assert tok.vocab_size == 320 and tok.eos_id == 2 and tok.pad_id == tok.eos_id  # no pad piece
    for s in SAMPLES:
        ids = tok.encode(s)
        assert all(0 <= i < tok.vocab_size for i in ids) and tok.decode(ids) == s
    assert len(tok.encode(CORPUS[0])) < 0.75 * len(CORPUS[0])  # it learned merges
    clone = pickle.loads(pickle.dumps(tok))
    assert clone.encode(SAMPLES[1]) == tok.encode(SAMPLES[1])
    explicit = SentencePieceTokenizer(sp_model, eos_token="</s>")
    assert explicit.eos_id == 2
    with pytest.raises(ValueError, match=r"DataConfig.eos_token='<nope>' is not in"):
        SentencePieceTokenizer(sp_model, eos_token="<nope>")


def test_hf_round_trip(hf_json):
    tok = make_tokenizer(DataConfig(tokenizer="hf", tokenizer_path=hf_json))
    assert isinstance(tok, HFTokenizer)
    assert tok.vocab_size == 300 and tok.eos_id == 1 and tok.pad_id == 0
    for s in SAMPLES:
        ids = tok.encode(s)
        assert tok.eos_id not in ids and tok.decode(ids) == s
    assert len(tok.encode(CORPUS[0])) < len(CORPUS[0]) / 2
    assert pickle.loads(pickle.dumps(tok)).encode(SAMPLES[0]) == tok.encode(SAMPLES[0])
    assert HFTokenizer(hf_json, eos_token="<pad>").eos_id == 0
    with pytest.raises(ValueError, match=r"has no EOS token among '<eos>': set "
                                         r"DataConfig.eos_token") as err:
        HFTokenizer(hf_json, eos_token="<eos>")
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("kind", SPECIAL_TOKENIZER_KINDS)
def test_hf_special_tokens_are_read_as_transformers_reads_them(tmp_path, kind):
    """BOS and EOS from tokenizer_config.json, added only when asked (then by the file's own
    post-processor), and left out of decoded text when asked: what lm-eval's hf model gets
    from AutoTokenizer (tests/test_harness_hf.py checks against it where torch is installed)."""
    tok = HFTokenizer(str(write_special_tokenizer(tmp_path, kind)))
    assert tok.eos_id == 256
    assert tok.bos_id == (257 if kind in ("bos_added", "bos_named") else None)
    assert tok.special_ids == {256, 257, 258}
    body = list("hé".encode("utf-8"))
    assert tok.encode("hé") == body                           # training: nothing added
    assert tok.encode("hé", add_special_tokens=True) == (
        [257] + body if kind == "bos_added" else body)
    ids = [257, *body, 258, 256]
    assert tok.decode(ids, skip_special_tokens=True) == "hé"
    assert tok.decode(ids) == "<s>hé<|eot|></s>"


def test_hf_eos_is_tokenizer_configs_before_the_usual_names(tmp_path):
    """An EOS named by tokenizer_config.json wins over '</s>' in the vocabulary (Llama 3
    names '<|end_of_text|>'; transformers reads the file); DataConfig.eos_token over both."""
    import json

    path = write_special_tokenizer(tmp_path, "no_bos")
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config,
                                                                "eos_token": "<|eot|>"}))
    assert HFTokenizer(str(path)).eos_id == 258
    assert HFTokenizer(str(path), eos_token="</s>").eos_id == 256
    (tmp_path / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"tokenizer_config.json is not valid JSON") as err:
        HFTokenizer(str(path))
    assert "\n" not in str(err.value)


def test_byte_and_sentencepiece_special_tokens(sp_model):
    byte = ByteTokenizer()
    assert byte.bos_id is None and byte.encode("a", add_special_tokens=True) == [97]
    assert byte.decode([97, 0], skip_special_tokens=True) == "a" and byte.decode([97, 0]) == "a\x00"
    sp = SentencePieceTokenizer(sp_model)
    assert sp.bos_id is not None and sp.bos_id in sp.special_ids and sp.eos_id in sp.special_ids
    assert sp.encode("the fox", add_special_tokens=True) == [sp.bos_id] + sp.encode("the fox")


@pytest.mark.parametrize("kind", ["sentencepiece", "hf"])
def test_missing_model_file(tmp_path, kind):
    path = str(tmp_path / "missing.model")
    with pytest.raises(FileNotFoundError, match=r"DataConfig.tokenizer_path='.*missing.model' "
                                                r"is not a file") as err:
        make_tokenizer(DataConfig(tokenizer=kind, tokenizer_path=path))
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("kind", ["sentencepiece", "hf"])
def test_pipelines_with_model_tokenizers(kind, sp_model, hf_json, tmp_path):
    (tmp_path / "t.txt").write_text("\n\n".join(CORPUS[:30]))
    path = sp_model if kind == "sentencepiece" else hf_json
    cfg = DataConfig(source=f"text:{tmp_path}/t.txt", tokenizer=kind, tokenizer_path=path,
                     seq_len=32, batch_size=2, shuffle=False)
    tok = make_tokenizer(cfg)
    batches = [b for b, _ in zip(iter(train_dataset(cfg, tok)), range(8))]
    for b in batches:
        check_tokens(b, tok.vocab_size)
    stream = np.concatenate([np.append(b["inputs"][r], b["targets"][r, -1])
                             for b in batches for r in range(2)]).tolist()
    pieces, start = [], 0
    for k, i in enumerate(stream):
        if i == tok.eos_id:
            pieces.append(tok.decode(stream[start:k]))
            start = k + 1
    records = train_source(cfg)
    assert len(pieces) >= 3 and pieces == [records[i] for i in range(len(pieces))]
    synth = cfg.replace(source="synthetic:lis,lcs")
    batch = task_eval_batches(synth, tok, num_examples=4, batch_size=4)[0]
    for r in range(4):
        answer = tok.decode(batch["targets"][r][batch["mask"][r]].tolist())
        line = tok.decode(batch["targets"][r][:np.flatnonzero(batch["mask"][r])[-1] + 1].tolist())
        assert answer.endswith("\n") and line.endswith(answer)
        assert int(answer) == parse(line)[2]
