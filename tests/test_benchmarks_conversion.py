"""benchmarks/moe_conversion.py without training: its pre-trained model is an OLMoE to the
exporter, every fine-tuning request is a conversion or router-training change that the
library accepts from that source (so the four runs start where the report says), and the report
reads its own JSON (paired differences, spread markers)."""

from __future__ import annotations

import argparse

from benchmarks import moe_conversion as bench
from dagmoe_jax.hf.export import hf_family
from dagmoe_jax.families.moe.conversion import converted_config, is_conversion


def test_the_source_is_an_olmoe_and_each_request_is_what_the_variant_says():
    args = argparse.Namespace(**bench.DEFAULTS)
    source = bench.source_config(args)
    assert hf_family(source) == "olmoe"
    requests = {v: bench.variant_request(args, v) for v in bench.VARIANTS}
    assert not is_conversion(source, requests["moe"].block)
    assert converted_config(source, requests["dag"].block).block.aggregation.dag_dim == 32
    coe = converted_config(source, requests["coe"].block).block
    assert (coe.kind, coe.iterations, coe.resolved_top_k, coe.iteration_scales) == (
        "coe", 2, 2, True)
    router = requests["moe_auxfree"].block.router
    assert (router.aux_free_bias_rate, router.balance_coef) == (0.001, 0.0)


def test_the_report_pairs_seeds_and_marks_the_spread():
    records = [{"variant": v, "seed": s, "loss": 2.0 + d + 0.01 * s, "imbalance": 1.5}
               for s in range(3) for v, d in (("moe", 0.0), ("dag", -0.1), ("coe", 0.0),
                                              ("moe_auxfree", 0.0))]
    records[6]["loss"] += 0.02                   # coe, seed 1: a difference inside the spread
    results = {"budget": dict(bench.DEFAULTS), "records": records, "pretrained_loss": 2.5,
               "start": {"moe": 3.0, "dag": 3.0, "coe": 3.0 + 1e-7},
               "params": {v: 1000 for v in bench.VARIANTS}}
    report = bench.format_report(results)
    rows = {line.split(" | ")[0].strip("| "): line for line in report.splitlines()
            if line.startswith("| ") and not line.startswith("| model")}
    assert "-0.1000 ± 0.0000 |" in rows["dag"]                 # beyond the spread: no '~'
    assert rows["coe"].split(" | ")[4].endswith("~")
    assert "largest gap 1.0e-07" in report


def test_report_reprints_saved_results_and_refuses_a_bad_file(tmp_path, capsys):
    """--report FILE prints the saved results' report without training
    (benchmarks.common.report_or_run); an unreadable file is one line and exit 2."""
    import json
    results = {"budget": dict(bench.DEFAULTS), "pretrained_loss": 2.5,
               "records": [{"variant": "moe", "seed": 0, "loss": 2.0, "imbalance": 1.4}],
               "start": {"moe": 3.0}, "params": {"moe": 1000}}
    (tmp_path / "r.json").write_text(json.dumps(results))
    assert bench.main([f"--report={tmp_path / 'r.json'}"]) == 0
    assert "| moe | 1,000 | 3.0000 |" in capsys.readouterr().out
    assert bench.main([f"--report={tmp_path / 'missing.json'}"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: cannot read") and "\n" not in err
