"""Readers of the offline task data beside this file (lm-evaluation-harness ``custom_dataset``
functions: each returns the task's splits as a ``datasets.DatasetDict``)."""

import json
from pathlib import Path

import datasets

HERE = Path(__file__).resolve().parent


def _read(name: str) -> datasets.DatasetDict:
    lines = (HERE / name).read_text(encoding="utf-8").splitlines()
    docs = [json.loads(line) for line in lines if line.strip()]
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(docs)})


def mc(**_kwargs):
    return _read("mc.jsonl")


def rolling(**_kwargs):
    return _read("rolling.jsonl")


def gen(**_kwargs):
    return _read("gen.jsonl")
