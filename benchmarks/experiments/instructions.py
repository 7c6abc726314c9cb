"""An instruction set and downstream tasks built offline, for the papers' pipeline in miniature.

The seeds fine-tune on Alpaca-style instruction data (DAG-MoE Q3: Alpaca, MetaMathQA, ...) and
score multiple-choice and generation benchmarks. Neither can be downloaded here, so this module
writes small stand-ins from nine skills whose answers are computed exactly. The pipeline's six
form two domains (:data:`DOMAINS`); DUME's four-expert table uses eight of them in four domains
of two (:data:`DUME_DOMAINS`; the DUME setting needs experts that differ, each good at its own
domain: ``add`` is left out there, its expert stayed at chance at the pipeline's budget):

======== ====== ========== ===========================================  ================
skill    domain DUME       instruction                                  response
======== ====== ========== ===========================================  ================
add      math              ``Add 23 and 48.``                           ``71``
next            numbers    ``What number comes after 347?``             ``348``
previous        numbers    ``What number comes before 347?``            ``346``
max      math   ordering   ``Which is the largest: 4, 9, 2?``           ``9``
sort     math   ordering   ``Sort the digits 7 3 9 1 in increasing...`` ``1 3 7 9``
reverse  text   spelling   ``Reverse the word "qcable".``               ``elbacq``
upper    text   spelling   ``Write "rivet" in capital letters.``        ``RIVET``
count    text   counting   ``How many times does "a" appear in "..."?`` ``3``
length          counting   ``How many letters are in "rivet"?``         ``5``
======== ====== ========== ===========================================  ================

* :func:`instruction_records`: Alpaca records (``instruction``, ``input``, ``output``) of some
  skills, for fine-tuning (``write_jsonl``).
* :func:`write_tasks`: an lm-evaluation-harness task folder (YAML + jsonl, read with
  ``--include_path``) with, per domain, a multiple-choice task (``acc``, ``acc_norm``: the
  answer against three distractors of the same skill) and a generation task (exact match of
  the greedy response, stopping at the end of the line), on problems drawn from another seed
  than the training records (so the evaluation never sees a training prompt, up to the
  chance collisions of small problem spaces, which :func:`write_tasks` removes).

Prompts are formatted by a ``render(instruction) -> str`` given by the caller, the same
function that formats the fine-tuning data, so a model is scored in the format it learned.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import numpy as np

LETTERS = "abcdefghijklmnopqrstuvwxyz"
DOMAINS: Dict[str, Tuple[str, ...]] = {"math": ("add", "max", "sort"),
                                       "text": ("reverse", "count", "upper")}
SKILLS: Tuple[str, ...] = DOMAINS["math"] + DOMAINS["text"]
DUME_DOMAINS: Dict[str, Tuple[str, ...]] = {"numbers": ("next", "previous"),
                                            "ordering": ("max", "sort"),
                                            "spelling": ("reverse", "upper"),
                                            "counting": ("count", "length")}
ALL_SKILLS: Tuple[str, ...] = SKILLS + ("next", "previous", "length")


def _digits(rng, n):
    return [int(x) for x in rng.choice(10, n, replace=False)]


def draw(skill: str, rng: np.random.Generator) -> Tuple[str, str, List[str]]:
    """One problem of ``skill``: (instruction, response, three distinct wrong responses)."""
    if skill == "add":
        a, b = (int(x) for x in rng.integers(10, 90, 2))
        right = a + b
        wrong = {right + d for d in (-10, -1, 1, 10, 2, -2)} - {right}
        return f"Add {a} and {b}.", str(right), [str(w) for w in _pick(rng, sorted(wrong))]
    if skill in ("next", "previous"):
        n = int(rng.integers(100, 1000))
        step = 1 if skill == "next" else -1
        right = n + step
        wrong = {n - step, n, n + 2 * step, n + 10 * step, n + 11 * step, n + 101 * step}
        word = "after" if skill == "next" else "before"
        return (f"What number comes {word} {n}?", str(right),
                [str(w) for w in _pick(rng, sorted(wrong - {right}))])
    if skill == "max":
        xs = _digits(rng, 3)
        return (f"Which is the largest: {', '.join(map(str, xs))}?", str(max(xs)),
                [str(x) for x in _pick(rng, sorted(set(xs) - {max(xs)}) + [min(xs) - 1
                                                                           if min(xs) else 10])])
    if skill == "sort":
        xs = _digits(rng, 4)
        right = " ".join(map(str, sorted(xs)))
        wrong = set()
        while len(wrong) < 3:
            perm = " ".join(map(str, rng.permutation(xs)))
            if perm != right:
                wrong.add(perm)
        return (f"Sort the digits {' '.join(map(str, xs))} in increasing order.", right,
                sorted(wrong))
    word = "".join(rng.choice(list(LETTERS), int(rng.integers(4, 7))))
    if skill == "reverse":
        right = word[::-1]
        others = {right[1:] + right[0], word, word[1:][::-1] + word[0]} - {right}
        while len(others) < 3:                   # a palindrome, or repeated letters
            others.add(right + str(rng.integers(10)))
        return f'Reverse the word "{word}".', right, sorted(others)[:3]
    if skill == "count":
        word = "".join(rng.choice(list("abcde"), int(rng.integers(6, 10))))
        letter = "abcde"[int(rng.integers(5))]
        right = word.count(letter)
        return (f'How many times does "{letter}" appear in "{word}"?', str(right),
                [str(w) for w in _pick(rng, [x for x in range(0, 6) if x != right])])
    if skill == "length":
        word = "".join(rng.choice(list(LETTERS), int(rng.integers(3, 10))))
        right = len(word)
        return (f'How many letters are in "{word}"?', str(right),
                [str(w) for w in _pick(rng, [x for x in range(2, 11) if x != right])])
    if skill == "upper":
        others = [word.capitalize(), word, word.upper()[:-1] + word[-1]]
        return f'Write "{word}" in capital letters.', word.upper(), others
    raise ValueError(f"skill {skill!r} is invalid: expected one of {', '.join(ALL_SKILLS)}")


def _pick(rng, values: Sequence, n: int = 3) -> list:
    values = list(values)
    return [values[i] for i in sorted(rng.choice(len(values), n, replace=False))]


def instruction_records(skills: Iterable[str], count: int, seed: int = 0) -> List[dict]:
    """``count`` Alpaca records, the skills in turn, drawn with ``seed``."""
    skills = tuple(skills)
    rng = np.random.default_rng(seed)
    records = []
    for i in range(count):
        instruction, response, _ = draw(skills[i % len(skills)], rng)
        records.append({"instruction": instruction, "input": "", "output": response})
    return records


def write_jsonl(path, records: Iterable[dict]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


_MC_YAML = """task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
output_type: multiple_choice
test_split: test
doc_to_text: "{{{{prompt}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: label
target_delimiter: ""
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: acc_norm
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
"""

_GEN_YAML = """task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
output_type: generate_until
test_split: test
doc_to_text: "{{{{prompt}}}}"
doc_to_target: "{{{{answer}}}}"
target_delimiter: ""
generation_kwargs:
  until:
    - "\\n"
  max_gen_toks: 12
  do_sample: false
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
"""


def write_tasks(out_dir, render: Callable[[str], str], *, per_skill: int = 24, seed: int = 1,
                exclude: Iterable[dict] = (),
                domains: Optional[Dict[str, Tuple[str, ...]]] = None) -> Dict[str, List[str]]:
    """Write the evaluation tasks into ``out_dir`` (module docstring) and return their names by
    domain, ``{'math': ['instruct_math_mc', 'instruct_math_gen'], 'text': [...]}``.
    ``exclude``: training records whose instructions the tasks must not contain. ``domains``:
    skills by domain (default :data:`DOMAINS`; :data:`DUME_DOMAINS` for DUME's table)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    seen = {r["instruction"] for r in exclude}
    rng = np.random.default_rng(seed)
    names: Dict[str, List[str]] = {}
    for domain, skills in (domains or DOMAINS).items():
        mc, gen = [], []
        for skill in skills:
            found, tries = 0, 0
            while found < per_skill and tries < 100 * per_skill:
                tries += 1
                instruction, response, wrong = draw(skill, rng)
                if instruction in seen:
                    continue
                seen.add(instruction)
                found += 1
                label = int(rng.integers(4))
                choices = list(wrong)
                choices.insert(label, response)
                prompt = render(instruction)
                mc.append({"prompt": prompt, "choices": choices, "label": label,
                           "skill": skill})
                gen.append({"prompt": prompt, "answer": response, "skill": skill})
            if found < per_skill:
                raise ValueError(f"skill {skill!r} has only {found} problems outside the "
                                 f"training records: lower per_skill={per_skill} or the "
                                 f"number of training records")
        names[domain] = []
        for kind, docs, template in (("mc", mc, _MC_YAML), ("gen", gen, _GEN_YAML)):
            name = f"instruct_{domain}_{kind}"
            data = write_jsonl(out / f"{name}.jsonl", docs)
            (out / f"{name}.yaml").write_text(template.format(name=name, data=data.resolve()))
            names[domain].append(name)
    return names
