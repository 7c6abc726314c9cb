"""Instruction data: field mappings, chat templates (Llama-3 and ChatML fixtures with a tiny
tokenizer.json made here), assistant-only loss weights, SFT packing, epochs and resume; the
pre-training pipeline's segment packing."""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest

from dagmoe_jax.data import DataConfig, eval_batches, make_tokenizer, train_dataset
from dagmoe_jax.data.chat import ChatEncoder
from dagmoe_jax.data.instruct import (chat_encoder, instruct_dataset, instruct_eval_batches,
                                      instruct_stats)
from dagmoe_jax.data.instruct_records import open_instruct, to_messages

LLAMA3 = (r"{% set loop_messages = messages %}{% for message in loop_messages %}"
          r"{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
          r" + message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
          r"{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
          r"{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
          r"{% endif %}")
CHATML = (r"{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + "
          r"message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
          r"{{ '<|im_start|>assistant\n' }}{% endif %}")
SPECIAL = ["<pad>", "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|begin_of_text|>",
           "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
CHAT = [{"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And 3+3?"},
        {"role": "assistant", "content": "It is 6."}]


@pytest.fixture(scope="module")
def hf_folders(tmp_path_factory):
    """Two HF tokenizer folders sharing a tiny BPE tokenizer.json: Llama-3 and ChatML."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tok.train_from_iterator(["What is two plus two? It is four. Be brief and clear."] * 20,
                            trainers.BpeTrainer(vocab_size=320, special_tokens=SPECIAL,
                                                initial_alphabet=alphabet))
    folders = {}
    for name, template, bos, eos in (("llama3", LLAMA3, "<|begin_of_text|>", "<|eot_id|>"),
                                      ("chatml", CHATML, None, "<|im_end|>")):
        d = tmp_path_factory.mktemp(name)
        tok.save(str(d / "tokenizer.json"))
        (d / "tokenizer_config.json").write_text(json.dumps(
            {"chat_template": template, "bos_token": bos, "eos_token": {"content": eos}}))
        folders[name] = str(d / "tokenizer.json")
    return folders


def hf_cfg(path: str, **kw) -> DataConfig:
    return DataConfig(tokenizer="hf", tokenizer_path=path, **kw)


def write_jsonl(path, records) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


# ----------------------------------------------------------------------------- field mappings

@pytest.mark.parametrize("fmt,record,expected", [
    ("alpaca", {"instruction": "Sum", "input": "1 2", "output": "3"},
     [("user", "Sum\n\n1 2"), ("assistant", "3")]),
    ("alpaca", {"instruction": "Hi", "input": "", "output": "Hello"},
     [("user", "Hi"), ("assistant", "Hello")]),
    ("metamath", {"query": "q?", "response": "r.", "type": "GSM"},
     [("user", "q?"), ("assistant", "r.")]),
    ("prompt_response", {"prompt": "p", "response": "r", "system": "s"},
     [("system", "s"), ("user", "p"), ("assistant", "r")]),
    ("fields:question,answer", {"question": "q", "answer": "a"},
     [("user", "q"), ("assistant", "a")]),
    ("messages", {"messages": CHAT}, [(m["role"], m["content"]) for m in CHAT]),
    ("auto", {"query": "q", "response": "r"}, [("user", "q"), ("assistant", "r")]),
    ("auto", {"instruction": "i", "output": "o"}, [("user", "i"), ("assistant", "o")]),
])
def test_field_mappings(fmt, record, expected):
    assert [(m["role"], m["content"]) for m in to_messages(record, fmt, "x")] == expected


SLIMORCA = {"conversations": [  # a SlimOrca record as the dataset ships it
    {"from": "system", "value": "You are an AI assistant.", "weight": None},
    {"from": "human", "value": "What is 2 + 2?", "weight": 0.0},
    {"from": "gpt", "value": "4.", "weight": 1.0}]}


@pytest.mark.parametrize("fmt", ["sharegpt", "auto"])
def test_sharegpt_turns_map_their_roles_as_llamafactory_does(fmt):
    """ShareGPT (SlimOrca: conversations of {from, value}) reads as LlamaFactory's sharegpt
    format maps its tags: system, human -> user, gpt -> assistant; 'auto' tells it from
    OpenAI-style {role, content} by its turns' keys."""
    assert [(m["role"], m["content"]) for m in to_messages(SLIMORCA, fmt, "x")] == [
        ("system", "You are an AI assistant."), ("user", "What is 2 + 2?"), ("assistant", "4.")]
    assert to_messages({"conversations": CHAT}, "auto", "x") == CHAT


def test_sharegpt_turns_of_other_roles_are_refused_by_name():
    tool = {"conversations": [{"from": "human", "value": "q"},
                              {"from": "function_call", "value": "{}"},
                              {"from": "gpt", "value": "a"}]}
    with pytest.raises(ValueError, match=r"^f line 3: ShareGPT role 'function_call' \(turn 1\) "
                                         r"is not supported: only human, gpt, system turns"):
        to_messages(tool, "sharegpt", "f line 3")
    with pytest.raises(ValueError, match=r"turn 0 is not a ShareGPT \{'from', 'value': str\}"):
        to_messages({"conversations": [{"from": "human"}]}, "sharegpt", "f line 1")
    with pytest.raises(ValueError, match="with an assistant turn"):
        to_messages({"conversations": [{"from": "human", "value": "q"}]}, "sharegpt", "f")


def test_a_sharegpt_file_packs_into_trained_examples(tmp_path):
    """A SlimOrca-style jsonl file becomes packed rows whose trained tokens are the answers."""
    records = [{"conversations": [{"from": "human", "value": f"Q{i}?"},
                                  {"from": "gpt", "value": f"A{i}!"}]} for i in range(20)]
    cfg = DataConfig(source=f"instruct:{write_jsonl(tmp_path / 's.jsonl', records)}",
                     seq_len=48, batch_size=3, seed=3, heldout_fraction=0.1)
    tok = make_tokenizer(cfg)
    batches = list(instruct_dataset(cfg, tok, epochs=1))
    seen = [e for b in batches for e in examples_of(b, tok)]
    assert len(seen) == 18 and all(t.startswith("### Instruction:\nQ") for t in seen)
    for b in batches:
        assert set(tok.decode(b["targets"][b["mask"]])) <= set("A0123456789!\x00")


def test_missing_field_is_a_one_line_error_naming_file_line_and_mapping(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"instruction": "a", "output": "b"},
                                              {"instruction": "a", "response": "b"}])
    with pytest.raises(ValueError) as err:
        open_instruct([path], "alpaca", "source", f"instruct:{path}")
    message = str(err.value)
    assert "\n" not in message and f"{path} line 2" in message and "'output'" in message
    assert "instruct_format" in message and "metamath" in message
    with pytest.raises(ValueError, match="line 1: no known instruction fields"):
        open_instruct([write_jsonl(tmp_path / "e.jsonl", [{"text": "x"}])], "auto", "source",
                      "instruct:e")
    with pytest.raises(ValueError, match="messages"):
        to_messages({"messages": [{"role": "bot", "content": "x"}]}, "messages", "f line 1")


def test_a_record_short_of_a_field_is_an_incomplete_record_not_a_format_problem(tmp_path):
    """An Alpaca record without `output` (under 'auto' or 'alpaca') names the file, the line and
    the missing field; it does not send the user to DataConfig.instruct_format."""
    path = write_jsonl(tmp_path / "d.jsonl", [{"instruction": "a", "output": "b"},
                                              {"instruction": "a", "input": "c"}])
    for fmt in ("auto", "alpaca"):
        with pytest.raises(ValueError) as err:
            open_instruct([path], fmt, "source", f"instruct:{path}")
        message = str(err.value)
        assert message.startswith(f"{path} line 2: an incomplete 'alpaca' record: no 'output' "
                                  "field (it has input, instruction): add its 'output'"), message
        assert "instruct_format" not in message and "\n" not in message
    with pytest.raises(ValueError, match=r"f line 1: an incomplete 'metamath' record: its "
                                         r"'response' is null, not a string"):
        to_messages({"query": "q", "response": None}, "auto", "f line 1")


def test_parquet_records(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    pq.write_table(pa.table({"query": ["a", "b"], "response": ["1", "2"]}),
                   tmp_path / "m.parquet")
    src = open_instruct([str(tmp_path / "m.parquet")], "metamath", "source", "instruct:m")
    assert len(src) == 2 and src[1][1] == {"role": "assistant", "content": "2"}
    with pytest.raises(ValueError, match=r"m.parquet row 0: no string field 'prompt'"):
        open_instruct([str(tmp_path / "m.parquet")], "prompt_response", "source", "x")


def test_json_array_and_array_record_records(tmp_path):
    """Alpaca ships one JSON array (alpaca_data.json); ArrayRecord files hold a JSON record
    each, as the library's pre-training ArrayRecord source reads them."""
    from array_record.python.array_record_module import ArrayRecordWriter

    records = [{"instruction": f"Say {i}.", "input": "", "output": str(i)} for i in range(3)]
    (tmp_path / "alpaca_data.json").write_text(json.dumps(records, indent=2))
    writer = ArrayRecordWriter(str(tmp_path / "a.array_record"), "group_size:1")
    for r in records:
        writer.write(json.dumps(r).encode())
    writer.close()
    for name in ("alpaca_data.json", "a.array_record"):
        src = open_instruct([str(tmp_path / name)], "alpaca", "source", f"instruct:{name}")
        assert len(src) == 3 and src[2][-1] == {"role": "assistant", "content": "2"}
    (tmp_path / "bad.json").write_text("[{\"instruction\": ")
    with pytest.raises(ValueError, match=r"bad.json: not a JSON array"):
        open_instruct([str(tmp_path / "bad.json")], "alpaca", "source", "x")


# ------------------------------------------------------------------------- templates, weights

def trained_text(encoder: ChatEncoder, messages) -> list:
    """The trained stretches of a conversation, decoded."""
    ids, weights = encoder.encode(messages)
    out, run = [], []
    for i, w in zip(ids, weights):
        if w:
            run.append(i)
        elif run:
            out.append(encoder.tokenizer.decode(run))
            run = []
    return out + ([encoder.tokenizer.decode(run)] if run else [])


def test_llama3_template_renders_and_trains_the_assistant_and_eot(hf_folders):
    cfg = hf_cfg(hf_folders["llama3"])
    encoder = chat_encoder(cfg, make_tokenizer(cfg))
    h = "<|start_header_id|>{}<|end_header_id|>\n\n"
    expected = ("<|begin_of_text|>" + h.format("system") + "Be brief.<|eot_id|>"
                + h.format("user") + "What is 2+2?<|eot_id|>" + h.format("assistant")
                + "4<|eot_id|>" + h.format("user") + "And 3+3?<|eot_id|>"
                + h.format("assistant") + "It is 6.<|eot_id|>")
    assert encoder.render(CHAT) == expected
    assert encoder.render(CHAT[:2], True) == expected[:expected.index("4<|eot_id|>")]
    ids, weights = encoder.encode(CHAT)
    assert encoder.tokenizer.decode(ids) == expected
    assert trained_text(encoder, CHAT) == ["4<|eot_id|>", "It is 6.<|eot_id|>"]


def test_chatml_template_trains_up_to_im_end_not_the_newline(hf_folders):
    cfg = hf_cfg(hf_folders["chatml"])
    encoder = chat_encoder(cfg, make_tokenizer(cfg))
    expected = ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 2+2?"
                "<|im_end|>\n<|im_start|>assistant\n4<|im_end|>\n<|im_start|>user\nAnd 3+3?"
                "<|im_end|>\n<|im_start|>assistant\nIt is 6.<|im_end|>\n")
    assert encoder.render(CHAT) == expected
    ids, _ = encoder.encode(CHAT)
    assert encoder.tokenizer.decode(ids) == expected
    assert trained_text(encoder, CHAT) == ["4<|im_end|>", "It is 6.<|im_end|>"]


def test_plain_template_with_the_byte_tokenizer_is_exact():
    encoder = chat_encoder(DataConfig(), make_tokenizer(DataConfig()))
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]
    ids, weights = encoder.encode(messages)
    text = "### Instruction:\nHi\n\n### Response:\nYo"
    assert ids == list(text.encode()) + [0]
    assert weights == [0] * (len(text) - 2) + [1, 1, 1]
    assert trained_text(encoder, CHAT) == ["4\x00", "It is 6.\x00"]


def test_a_template_that_rewrites_earlier_turns_is_refused(hf_folders):
    cfg = hf_cfg(hf_folders["chatml"])
    odd = "{{ messages | length }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    encoder = ChatEncoder(make_tokenizer(cfg), odd)
    with pytest.raises(ValueError, match="extension of the turns before"):
        encoder.encode(CHAT)


# ------------------------------------------------------------------------------------- packing

def sft_cfg(tmp_path, n=23, **kw) -> DataConfig:
    records = [{"instruction": f"Q{i}" + "?" * (i % 7), "output": f"A{i}" + "!" * (i % 5)}
               for i in range(n)]
    path = write_jsonl(tmp_path / "sft.jsonl", records)
    base = dict(source=f"instruct:{path}", seq_len=48, batch_size=3, seed=3,
                heldout_fraction=0.1)
    return DataConfig(**{**base, **kw})


def examples_of(batch, tokenizer) -> list:
    """Each packed example of a batch, decoded, with its mask checked against its bounds."""
    out = []
    for r in range(batch["inputs"].shape[0]):
        seg, inputs = batch["segment_ids"][r], batch["inputs"][r]
        full = np.append(inputs, batch["targets"][r][-1])
        ids = sorted(set(seg.tolist()) - {0})
        assert ids == list(range(1, len(ids) + 1))                  # segments 1..n, 0 = padding
        assert np.all(np.diff(seg[seg > 0]) >= 0)
        if (seg == 0).any():                                        # padding only at the end
            assert not np.any(seg[np.argmax(seg == 0):])
        for s in ids:
            where = np.flatnonzero(seg == s)
            assert np.array_equal(where, np.arange(where[0], where[-1] + 1))
            out.append(tokenizer.decode(full[where[0]:where[-1] + 2]))
        # never a prediction across examples, never on padding
        nxt = np.append(seg[1:], 0)
        crossing = (seg != nxt) & (np.arange(len(seg)) < len(seg) - 1)
        assert not np.any(batch["mask"][r] & ((seg == 0) | crossing))
    return out


def test_packing_keeps_examples_whole_and_masks_only_their_answers(tmp_path):
    cfg = sft_cfg(tmp_path)
    tok = make_tokenizer(cfg)
    batches = list(instruct_dataset(cfg, tok, epochs=1))
    assert all(b["inputs"].shape == (3, 48) and b["segment_ids"].dtype == np.int32
               for b in batches)
    seen = [e for b in batches for e in examples_of(b, tok)]
    assert len(seen) == 21                                      # 23 records, 2 held out
    for text in seen:                                           # whole: header to EOS
        assert text.startswith("### Instruction:\nQ") and text.endswith("\x00")
    for b in batches:
        trained = b["targets"][b["mask"]]
        prompts = b["inputs"][b["mask"]]
        assert set(tok.decode(trained)) <= set("A0123456789!\x00")
        assert np.all(prompts != 0)                             # never predicts from an EOS


def test_epochs_cover_every_example_once_each_in_a_new_order(tmp_path):
    cfg = sft_cfg(tmp_path)
    tok = make_tokenizer(cfg)
    stream = [e for b in instruct_dataset(cfg, tok, epochs=3) for e in examples_of(b, tok)]
    assert Counter(Counter(stream).values()) == {3: 21}
    assert stream[:21] != stream[21:42] and sorted(stream[:21]) == sorted(stream[21:42])
    stats = instruct_stats(cfg, tok, epochs=3)
    assert stats["batches"] == len(list(instruct_dataset(cfg, tok, epochs=3)))
    assert stats["examples"] == 21 and stats["truncated"] == 0
    other = [e for b in instruct_dataset(cfg.replace(seed=4), tok, epochs=1)
             for e in examples_of(b, tok)]
    assert other != stream[:21]


def test_packing_off_puts_one_example_per_row(tmp_path):
    """DataConfig.packing = False (LlamaFactory's default): every row holds one whole example,
    padded, so N examples over 3 epochs at batch B are ceil(3N / B) steps, each example seen
    once an epoch, with the same mask as when packed."""
    import math

    cfg = sft_cfg(tmp_path, packing=False, seq_len=128)     # room for 3 packed a row
    tok = make_tokenizer(cfg)
    batches = list(instruct_dataset(cfg, tok, epochs=3))
    stats = instruct_stats(cfg, tok, epochs=3)
    assert len(batches) == stats["batches"] == math.ceil(3 * 21 / 3) == 21
    rows = [(b["segment_ids"][r], b) for b in batches for r in range(3)]
    assert all(set(seg.tolist()) <= {0, 1} for seg, _ in rows)
    stream = [e for b in batches for e in examples_of(b, tok)]
    assert len(stream) == 63 and Counter(Counter(stream).values()) == {3: 21}
    packed = list(instruct_dataset(cfg.replace(packing=True), tok, epochs=3))
    assert len(packed) < len(batches)
    assert sum(int(b["mask"].sum()) for b in batches) == sum(int(b["mask"].sum())
                                                             for b in packed)


def test_llamafactory_truncation_keeps_a_share_of_each_answer():
    """truncate_example('llamafactory') cuts turn by turn with LlamaFactory's infer_seqlen
    (transcribed here from data/processor/processor_utils.py): a long prompt keeps the answer,
    long both are cut in proportion, a later turn gets what the earlier ones left."""
    from dagmoe_jax.data.instruct import infer_seqlen, truncate_example

    def theirs(source_len, target_len, cutoff_len):          # LlamaFactory's, as written
        if target_len * 2 < cutoff_len:
            max_target_len = cutoff_len
        elif source_len * 2 < cutoff_len:
            max_target_len = cutoff_len - source_len
        else:
            max_target_len = int(cutoff_len * (target_len / (source_len + target_len)))
        new_target_len = min(max_target_len, target_len)
        max_source_len = max(cutoff_len - new_target_len, 0)
        return min(max_source_len, source_len), new_target_len

    for s_len, t_len, cut in [(100, 10, 64), (10, 100, 64), (80, 60, 64), (5, 5, 64),
                              (64, 64, 64), (1, 200, 3)]:
        assert infer_seqlen(s_len, t_len, cut) == theirs(s_len, t_len, cut)
    # one turn: a 100-token prompt, a 10-token answer, 64 tokens: the answer survives whole
    ids, w = list(range(110)), [0] * 100 + [1] * 10
    got_ids, got_w = truncate_example(ids, w, 64, "llamafactory")
    assert got_ids == list(range(54)) + list(range(100, 110)) and sum(got_w) == 10
    assert truncate_example(ids, w, 64, "head") == (ids[:64], w[:64])     # no answer left
    # two turns: the second gets what the first left
    ids2 = list(range(50))
    w2 = [0] * 10 + [1] * 10 + [0] * 20 + [1] * 10
    got_ids, got_w = truncate_example(ids2, w2, 30, "llamafactory")
    s1, t1 = theirs(10, 10, 30)
    s2, t2 = theirs(20, 10, 30 - s1 - t1)
    assert len(got_ids) == s1 + t1 + s2 + t2 <= 30
    assert got_ids[:s1 + t1] == list(range(s1)) + list(range(10, 10 + t1))
    assert truncate_example(ids2, w2, 60, "llamafactory") == (ids2, w2)   # fits: untouched


def test_long_examples_are_truncated_and_counted(tmp_path):
    """At seq_len 44 some conversations are longer than a row: the count of truncated ones is
    the training records whose whole encoding exceeds seq_len + 1 tokens (some but not all);
    every example the dataset packs fits a row, and the dataset holds as many examples and
    trained tokens as the statistics say."""
    from dagmoe_jax.data import train_records
    cfg = sft_cfg(tmp_path, seq_len=44)
    tok = make_tokenizer(cfg)
    stats = instruct_stats(cfg, tok, epochs=1)
    encoder = chat_encoder(cfg, tok)
    records = train_records(cfg)
    whole = [len(encoder.encode(records[i])[0]) for i in range(len(records))]
    longer = sum(n > cfg.seq_len + 1 for n in whole)
    assert 0 < longer < len(whole)
    assert stats["truncated"] == longer and stats["examples"] == len(whole)
    segments, trained = 0, 0
    for b in instruct_dataset(cfg, tok, epochs=1):
        examples_of(b, tok)
        for row in b["segment_ids"]:
            ids, counts = np.unique(row[row > 0], return_counts=True)
            assert np.all(counts <= cfg.seq_len)        # inputs: the example less its last token
            segments += len(ids)
        trained += int(b["mask"].sum())
    assert segments == stats["examples"] and trained == stats["trained_tokens"]


def test_mid_epoch_resume_is_bit_identical(tmp_path):
    cfg = sft_cfg(tmp_path)
    tok = make_tokenizer(cfg)
    it = iter(instruct_dataset(cfg, tok, epochs=2))
    for _ in range(4):
        next(it)
    state = it.get_state()
    rest = list(it)
    again = iter(instruct_dataset(cfg, tok, epochs=2))
    again.set_state(state)
    resumed = list(again)
    assert len(resumed) == len(rest) > 0
    for a, b in zip(rest, resumed):
        assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


def test_eval_batches_are_packed_whole_and_masked(tmp_path):
    cfg = sft_cfg(tmp_path, n=60)
    tok = make_tokenizer(cfg)
    batches = instruct_eval_batches(cfg, tok)
    seen = [e for b in batches for e in examples_of(b, tok)]
    assert len(seen) == 6 and all(b["inputs"].shape == (3, 48) for b in batches)


# ------------------------------------------------------------------ pre-training segment packing

def test_pretraining_segment_packing(tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", [{"text": f"document {i} " * (i % 4 + 1)}
                                              for i in range(40)])
    cfg = DataConfig(source=f"jsonl:{path}", seq_len=32, batch_size=2, segment_packing=True)
    tok = make_tokenizer(cfg)
    it = iter(train_dataset(cfg, tok))
    plain = next(iter(train_dataset(cfg.replace(segment_packing=False), tok)))
    batch = next(it)
    assert np.array_equal(batch["inputs"], plain["inputs"]) and "segment_ids" not in plain
    seg = batch["segment_ids"]
    assert seg.dtype == np.int32 and seg[:, 0].tolist() == [1, 1]
    for r in range(2):
        eos = np.flatnonzero(batch["inputs"][r] == tok.eos_id)
        for e in eos:                                    # after an EOS: a new document
            if e + 1 < cfg.seq_len:
                assert seg[r, e + 1] == seg[r, e] + 1 and not batch["mask"][r, e]
    # the mask drops exactly the predictions from an EOS (into the next document)
    assert np.array_equal(batch["mask"], plain["mask"] & (batch["inputs"] != tok.eos_id))


def test_pretraining_segment_packing_in_evaluation(tmp_path):
    """Held-out batches under segment_packing carry the same segments and mask as training
    batches: the eval loss counts exactly the predictions training makes."""
    path = write_jsonl(tmp_path / "t.jsonl", [{"text": f"held out {i} " * (i % 3 + 1)}
                                              for i in range(30)])
    cfg = DataConfig(source=f"jsonl:{path}", eval_source=f"jsonl:{path}", seq_len=32,
                     batch_size=2, segment_packing=True)
    tok = make_tokenizer(cfg)
    plain = eval_batches(cfg.replace(segment_packing=False), tok, max_batches=3)
    packed = eval_batches(cfg, tok, max_batches=3)
    assert len(packed) == len(plain) and "segment_ids" not in plain[0]
    for a, b in zip(plain, packed):
        assert np.array_equal(a["inputs"], b["inputs"]) and np.array_equal(a["targets"],
                                                                           b["targets"])
        assert np.array_equal(b["mask"], a["mask"] & (b["inputs"] != tok.eos_id))
        seg = b["segment_ids"]
        assert np.all(seg[:, 0] == 1)
        starts = np.flatnonzero(b["inputs"][0][:-1] == tok.eos_id) + 1
        assert all(seg[0, s] == seg[0, s - 1] + 1 for s in starts)
