"""The offline instruction set and downstream tasks of the pipeline in miniature
(benchmarks/experiments/instructions.py): answers are right, distractors are wrong and
distinct, evaluation prompts never repeat a training instruction, and the harness reads the
task folder."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from benchmarks.experiments.instructions import (ALL_SKILLS, DOMAINS, DUME_DOMAINS, SKILLS, draw,
                                      instruction_records, write_tasks)


def solve(instruction: str) -> str:
    """Each skill's answer, recomputed from the instruction's text."""
    if m := re.fullmatch(r"Add (\d+) and (\d+)\.", instruction):
        return str(int(m[1]) + int(m[2]))
    if m := re.fullmatch(r"Which is the largest: (.*)\?", instruction):
        return str(max(int(x) for x in m[1].split(", ")))
    if m := re.fullmatch(r"Sort the digits (.*) in increasing order\.", instruction):
        return " ".join(sorted(m[1].split()))
    if m := re.fullmatch(r'Reverse the word "(\w+)"\.', instruction):
        return m[1][::-1]
    if m := re.fullmatch(r'How many times does "(\w)" appear in "(\w+)"\?', instruction):
        return str(m[2].count(m[1]))
    if m := re.fullmatch(r"What number comes (after|before) (\d+)\?", instruction):
        return str(int(m[2]) + (1 if m[1] == "after" else -1))
    if m := re.fullmatch(r'How many letters are in "(\w+)"\?', instruction):
        return str(len(m[1]))
    if m := re.fullmatch(r'Write "(\w+)" in capital letters\.', instruction):
        return m[1].upper()
    raise AssertionError(instruction)


@pytest.mark.parametrize("skill", ALL_SKILLS)
def test_answers_are_right_and_distractors_wrong(skill):
    rng = np.random.default_rng(0)
    for _ in range(50):
        instruction, response, wrong = draw(skill, rng)
        assert solve(instruction) == response
        assert len(set(wrong)) == 3 and response not in wrong


def test_records_and_tasks(tmp_path):
    records = instruction_records(SKILLS, 120, seed=0)
    assert records == instruction_records(SKILLS, 120, seed=0)
    assert all(r["output"] == solve(r["instruction"]) for r in records)
    names = write_tasks(tmp_path, lambda i: f"Q: {i}\nA: ", per_skill=5, exclude=records)
    assert names == {d: [f"instruct_{d}_mc", f"instruct_{d}_gen"] for d in DOMAINS}
    train = {r["instruction"] for r in records}
    for domain in DOMAINS:
        docs = [json.loads(line) for line in
                (tmp_path / f"instruct_{domain}_mc.jsonl").read_text().splitlines()]
        assert len(docs) == 5 * len(DOMAINS[domain])
        for doc in docs:
            instruction = doc["prompt"][len("Q: "):-len("\nA: ")]
            assert instruction not in train
            assert doc["choices"][doc["label"]] == solve(instruction)
    lm_eval = pytest.importorskip("lm_eval")
    from lm_eval.tasks import TaskManager
    local = TaskManager(include_path=str(tmp_path), include_defaults=False)
    assert set(sum(names.values(), [])) <= set(local.all_tasks)
    del lm_eval


def test_dume_domains_tasks(tmp_path):
    """DUME's four domains: every skill once, two per domain, a task pair per domain; the
    pipeline's two domains keep their six skills."""
    assert len(ALL_SKILLS) == len(set(ALL_SKILLS)) and set(SKILLS) < set(ALL_SKILLS)
    assert set(sum(DUME_DOMAINS.values(), ())) <= set(ALL_SKILLS)
    assert all(len(skills) == 2 for skills in DUME_DOMAINS.values())
    records = instruction_records(sum(DUME_DOMAINS.values(), ()), 80, seed=0)
    names = write_tasks(tmp_path, lambda i: i, per_skill=3, exclude=records,
                        domains=DUME_DOMAINS)
    assert list(names) == list(DUME_DOMAINS)
    for domain, skills in DUME_DOMAINS.items():
        docs = [json.loads(line) for line in
                (tmp_path / f"instruct_{domain}_gen.jsonl").read_text().splitlines()]
        assert sorted({d["skill"] for d in docs}) == sorted(skills)
        assert all(solve(d["prompt"]) == d["answer"] for d in docs)


def test_dume_statistics_read_instruction_data_whole(tmp_path):
    """DUME's reasoning setting: an ``instruct:`` domain source gives the statistics pass its
    conversations in the chat format, every real token counted (prompts included)."""
    from dagmoe_jax.data import DataConfig
    from benchmarks.experiments.instructions import write_jsonl
    from dagmoe_jax.upcycle.command import domain_batches

    path = write_jsonl(tmp_path / "math.jsonl", instruction_records(DOMAINS["math"], 12))
    cfg = DataConfig(source=f"instruct:{path}", instruct_format="alpaca", seq_len=64,
                     batch_size=4, tokenizer="byte")
    batches = domain_batches(cfg, 2)
    assert len(batches) == 2
    for batch in batches:
        assert np.array_equal(batch["mask"], batch["segment_ids"] != 0)
    text = bytes(int(t) for t in batches[0]["inputs"][0] if t).decode()
    assert text.startswith("### Instruction:\n")
