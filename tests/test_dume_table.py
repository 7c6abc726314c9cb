"""DUME's Table 3 report (benchmarks/experiments/dume_table.py): the normalised average is each
score over its domain expert's, averaged per domain then over domains; the diagonal oracle comes
from the experts; every row and the normalised-average column are printed; orderings are
seed-paired."""

from __future__ import annotations

import pytest

from benchmarks.experiments.dume_table import (MERGED, format_report, normalised, rows,
                                    with_diagonal)

DOMAINS = ["a", "b"]
COLUMNS = ["a MC", "a gen", "b MC", "b gen"]


def results(seeds=(0, 1, 2)) -> dict:
    """Made-up scores: expert a scores 0.8 / 0.4 on a, expert b 0.6 / 0 on b (a zero expert
    score: that task has no ratio); every merged model half of each expert's, DUME+ more."""
    records = []
    for seed in seeds:
        jitter = 0.01 * seed
        records.append({"model": "expert a", "seed": seed, "a MC": 0.8, "a gen": 0.4,
                        "b MC": 0.3, "b gen": 0.0})
        records.append({"model": "expert b", "seed": seed, "a MC": 0.2, "a gen": 0.0,
                        "b MC": 0.6, "b gen": 0.0})
        for model in MERGED:
            if model == "oracle (diagonal)":
                continue
            scale = 0.75 + jitter if model == "DUME+" else 0.5
            records.append({"model": model, "seed": seed, "a MC": 0.8 * scale,
                            "a gen": 0.4 * scale, "b MC": 0.6 * scale, "b gen": 0.1})
    return {"columns": {c: c for c in COLUMNS}, "domains": DOMAINS, "records": records,
            "stats_batches": 8, "router_steps": 60, "router_lr": 1e-3}


def test_normalised_average_per_domain_then_over_domains():
    res = results()
    records = with_diagonal(res["records"], DOMAINS, COLUMNS)
    diagonal = [r for r in records if r["model"] == "oracle (diagonal)"]
    assert len(diagonal) == 3 and diagonal[0]["a MC"] == 0.8 and diagonal[0]["b MC"] == 0.6
    norm = normalised(records, DOMAINS, COLUMNS)
    assert norm["oracle (diagonal)"][0] == {"a": 1.0, "b": 1.0, "average": 1.0}
    assert norm["averaging"][0] == pytest.approx({"a": 0.5, "b": 0.5, "average": 0.5})
    # expert a on b: 0.3 / 0.6 (b gen: its expert scored 0, no ratio)
    assert norm["expert a"][1] == pytest.approx({"a": 1.0, "b": 0.5, "average": 0.75})


def test_report_has_every_row_the_normalised_column_and_orderings():
    report = format_report(results())
    assert "| model | a MC | a gen | b MC | b gen | norm. avg |" in report
    for model in rows(DOMAINS):
        assert f"| {model} |" in report, model
    assert "| averaging | 0.400 ± 0.000 | 0.200 ± 0.000 | 0.300 ± 0.000 | 0.100 ± 0.000 | " \
           "50.0 ± 0.0 |" in report
    assert "| oracle (diagonal) | 100.0 ± 0.0 | 100.0 ± 0.0 | 100.0 ± 0.0 |" in report
    assert "* DUME+ - DUME k2: +26.0 ± 1.0 points over 3 seeds: holds" in report
    assert "* DUME k1 (prompts) - averaging: +0.0 ± 0.0 points over 3 seeds: inside" in report
    one = format_report(results(seeds=(0,)))
    assert "over 1 seeds: inside the seed spread" in one
