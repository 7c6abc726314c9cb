"""Exact-answer scoring, DP depths and the benchmark variants, without training anything.

Scoring is checked with crafted predictions (a causal rule standing in for a model), including
that teacher-forced scoring gives exactly the verdict of greedy decoding with the same rule."""

from __future__ import annotations

import numpy as np
import pytest

from dagmoe_jax.families.moe.budget import coe_budget_residual
from dagmoe_jax.config import ModelConfig
from dagmoe_jax.families.moe.budget import dag_params_per_layer
from dagmoe_jax.data import ByteTokenizer, DataConfig, task_eval_batches
from dagmoe_jax.data.tasks import TASKS, generate, get_task, parse, parse_answer
from benchmarks.experiments.dp_depth import dp_depth, dp_depth_closed_form
from benchmarks.experiments.scoring import (accuracy_by_size, eval_seq_len, majority_baseline,
                                 max_example_tokens, mean_std, score_batches,
                                 seed_statistics)
from benchmarks.experiments.variants import (VARIANTS, budget_params, matched_dag_dim,
                                  variant_config)
from conftest import make_model

TOK = ByteTokenizer()
CFG = DataConfig(source="synthetic:lis,edit_distance,lcs", seq_len=64)


def batches_for(task, sizes=(3, 5), n=12, batch_size=5, seq_len=48):
    return task_eval_batches(CFG, TOK, num_examples=n, size=sizes, batch_size=batch_size,
                             tasks=[task], seq_len=seq_len)


def reference_answer(row_targets, row_mask) -> str:
    return TOK.decode([int(t) for t in row_targets[row_mask]])


@pytest.mark.parametrize("task", sorted(TASKS))
def test_masked_targets_are_the_dp_answer(task):
    for batch in batches_for(task):
        for inputs, targets, mask in zip(batch["inputs"], batch["targets"], batch["mask"]):
            answer = reference_answer(targets, mask)
            line = TOK.decode([int(t) for t in inputs[1:]]).split("\n")[0]  # after the EOS
            name, parsed, _ = parse(line)
            assert name == task
            assert parse_answer(answer) == get_task(task).solve(parsed)
            assert answer.endswith("\n")


def test_scoring_crafted_predictions_is_exact():
    batches = batches_for("lis", sizes=(3, 6), n=14, batch_size=4)
    perfect = score_batches(lambda b: b["targets"], batches)
    assert perfect["correct"].all() and len(perfect["correct"]) == 14
    assert set(accuracy_by_size(perfect["correct"], perfect["size"]).values()) == {1.0}

    # Wrong on one answer token of every row whose global index is even; a change outside the
    # answer (mask False) never matters.
    counter = {"row": 0}

    def predict(batch):
        pred = batch["targets"].copy()
        for r in range(len(pred)):
            answer_cols = np.flatnonzero(batch["mask"][r])
            prompt_cols = np.flatnonzero(~batch["mask"][r])
            pred[r, prompt_cols] = (pred[r, prompt_cols] + 1) % 256
            if (counter["row"] + r) % 2 == 0:
                col = answer_cols[len(answer_cols) // 2]
                pred[r, col] = (pred[r, col] + 7) % 256
        counter["row"] += len(pred)
        return pred

    scored = score_batches(predict, batches)
    expected = np.arange(14) % 2 == 1
    np.testing.assert_array_equal(scored["correct"], expected)
    by_size = accuracy_by_size(scored["correct"], scored["size"])
    for n, acc in by_size.items():
        rows = scored["size"] == n
        assert acc == pytest.approx(expected[rows].mean())
    assert sorted(by_size) == sorted(set(scored["size"].tolist()))

    # Logits instead of ids: argmax is taken.
    logits = lambda b: np.eye(256, dtype=np.float32)[b["targets"]]
    assert score_batches(logits, batches)["correct"].all()


def _rule(prefix: str, faulty: bool) -> str:
    """A causal stand-in for a model: after '=', write the DP answer (the last digit wrong
    when ``faulty``), then keep writing 'z'. Before '=', echo 'q' (never scored)."""
    head, eq, tail = prefix.partition("=")
    if not eq:
        return "q"
    answer = f" {get_task(parse(head + '=')[0]).solve(parse(head + '=')[1])}\n"
    if faulty:
        answer = answer[:-2] + ("0" if answer[-2] != "0" else "1") + "\n"
    return answer[len(tail)] if len(tail) < len(answer) else "z"


def test_teacher_forced_verdict_equals_greedy_decoding():
    batches = batches_for("edit_distance", sizes=(2, 5), n=10, batch_size=10)
    faulty = {i: i % 3 == 0 for i in range(10)}

    def predict(batch):
        out = np.zeros_like(batch["targets"])
        for r, row in enumerate(batch["inputs"]):
            text = TOK.decode([int(t) for t in row[1:]])   # row[0] is EOS
            for p in range(row.shape[0]):
                prefix = text[:p]                           # tokens 1..p -> predict p + 1
                out[r, p] = ord(_rule(prefix, faulty[r])) if p >= 1 else ord("q")
        return out

    verdicts = score_batches(predict, batches)["correct"]
    batch = batches[0]
    for r in range(10):
        prompt = TOK.decode([int(t) for t in batch["inputs"][r][1:]]).split("=")[0] + "="
        generated = ""
        while not generated.endswith("\n") and len(generated) < 8:   # greedy decoding
            generated += _rule(prompt + generated, faulty[r])
        reference = reference_answer(batch["targets"][r], batch["mask"][r])
        assert bool(verdicts[r]) == (generated == reference) == (not faulty[r])


def test_majority_baseline_and_seed_statistics():
    batches = batches_for("lis", sizes=(2, 2), n=40, batch_size=16)
    answers = [reference_answer(t, m) for b in batches for t, m in zip(b["targets"], b["mask"])]
    top = max(answers.count(a) for a in set(answers))
    assert majority_baseline(batches) == pytest.approx(top / 40)
    assert mean_std([0.5, 0.7, 0.9]) == pytest.approx((0.7, 0.2))
    assert mean_std([0.25]) == (0.25, 0.0)


def test_paired_difference_against_a_hand_t_test():
    from benchmarks.experiments.scoring import paired_difference
    a = {0: 7.0, 1: 7.1, 2: 7.05, 5: 9.0}          # seed 5 has no partner: left out
    b = {0: 6.8, 1: 6.95, 2: 6.9}
    got = paired_difference(a, b)
    diffs = np.array([0.2, 0.15, 0.15])
    assert got["seeds"] == 3
    assert got["mean"] == pytest.approx(diffs.mean())
    assert got["std"] == pytest.approx(diffs.std(ddof=1))
    # t = mean / (std / sqrt 3) = 0.1667 / 0.0167 = 10 > 4.303 (t_0.975, 2 dof)
    assert got["beyond_spread"] is True
    noisy = paired_difference({0: 7.0, 1: 7.1, 2: 6.9}, {0: 6.9, 1: 7.2, 2: 6.85})
    # diffs 0.1, -0.1, 0.05: mean 0.0167, std 0.104, t = 0.28 < 4.303
    assert noisy["beyond_spread"] is False
    assert paired_difference({0: 1.0}, {0: 0.0})["beyond_spread"] is False   # one seed: never
    stats = seed_statistics([{4: 0.5, 8: 0.1}, {4: 0.7, 8: 0.3}])
    assert stats[4] == pytest.approx((0.6, np.sqrt(0.02)))
    assert stats[8] == pytest.approx((0.2, np.sqrt(0.02)))


@pytest.mark.parametrize("task", sorted(TASKS))
def test_eval_seq_len_bounds_every_example(task):
    rng = np.random.default_rng(0)
    for size in (1, 4, 13, 24):
        bound = max_example_tokens(task, size)
        for _ in range(200):
            assert 1 + len(generate(task, rng, size).text) <= bound
    assert eval_seq_len([task], [4, 24]) >= max_example_tokens(task, 24) - 1
    assert eval_seq_len([task], [4, 24]) % 16 == 0
    # the bound is what task_eval_batches needs: no error at that length
    task_eval_batches(CFG, TOK, num_examples=20, size=24, batch_size=20, tasks=[task],
                      seq_len=eval_seq_len([task], [24]))


@pytest.mark.parametrize("task", sorted(TASKS))
def test_dp_depth_closed_forms(task):
    rng = np.random.default_rng(1)
    for size in range(1, 9):
        for _ in range(10):
            inputs = get_task(task).draw(rng, size)
            assert dp_depth(task, inputs) == dp_depth_closed_form(task, inputs)
    if task == "lis":   # DAG-MoE Fig. 5: [3, 1, 2, 4] has LIS 3 (1, 2, 4), one more level for y
        assert dp_depth("lis", ((3, 1, 2, 4),)) == 4
    else:
        assert dp_depth(task, ("ab", "abc")) == 5


def test_variants_add_equal_parameters():
    from dagmoe_jax.model.accounting import account

    base = ModelConfig(vocab_size=256, d_model=64, num_layers=2, num_heads=4, num_kv_heads=2,
                       max_seq_len=64).replace(block=dict(
                           experts=dict(num_experts=16, expert_hidden=32), router=dict(top_k=4)))
    budget = budget_params(64, 32)
    assert budget == dag_params_per_layer(64, 32, 2)
    reference = account(variant_config(base, "moe", 32)).total_params
    for name in VARIANTS[1:]:
        cfg = variant_config(base, name, 32)
        added = (account(cfg).total_params - reference) / base.num_layers
        if name == "mlp_small":   # the ablation's own size: 3 d (d_g / 2), not the budget
            assert added == 3 * 64 * 16
            continue
        if name == "dag_self":            # the DAG L 2 module's own parameters
            assert added == budget
        if name == "coe":                 # the second router counts in CoE's budget
            shared = variant_config(base, name, 32).block.experts.shared_hidden
            assert added - budget == coe_budget_residual(64, 32, 2, 16, shared) == -64
        assert abs(added - budget) <= 0.01 * budget, (name, added, budget)
    assert (variant_config(base, "dag_l1", 32).block.aggregation.dag_dim
            == matched_dag_dim(64, budget, 1))
    assert variant_config(base, "coe", 32).block.resolved_top_k == 2
    assert variant_config(base, "moe", 32).block.aggregation.kind == "sum"
    with pytest.raises(ValueError, match="variant 'dag' is invalid"):
        variant_config(base, "dag", 32)


def test_model_predictor_padding_and_dispatch():
    from conftest import tiny_config
    from benchmarks.experiments.scoring import model_predictor

    model = make_model(tiny_config("moe", "dag", vocab_size=256, max_seq_len=64))
    batches = task_eval_batches(CFG, TOK, num_examples=5, size=4, batch_size=3, tasks=["lis"],
                                seq_len=32)
    padded = model_predictor(model, rows=4, dispatch="dropless")
    plain = model_predictor(model, dispatch="dropless")
    for batch in batches:                      # rows 3 and 2, both padded to 4
        got = padded(batch)
        assert got.shape == batch["targets"].shape
        np.testing.assert_array_equal(got, plain(batch))


def test_quality_summary_pairs_seeds_against_moe_and_the_shared_expert():
    from benchmarks.experiments.quality import format_report, summarize
    ppl = {"moe": [7.0, 7.2, 7.1], "moe_shared": [6.8, 7.0, 6.9], "dag_l2": [6.7, 6.9, 6.8]}
    runs = [{"variant": v, "seed": s, "loss": float(np.log(p)), "perplexity": p,
             "params": 100 + 10 * (v != "moe"), "description": v}
            for v, values in ppl.items() for s, p in enumerate(values)]
    summary = summarize(runs)
    dag = summary["dag_l2"]
    assert dag["paired_improvement"]["mean"] == pytest.approx(0.3)     # 7.1 - 6.8 per seed
    assert dag["paired_improvement"]["std"] == pytest.approx(0.0, abs=1e-12)
    assert dag["paired_vs_shared"]["mean"] == pytest.approx(0.1)
    assert "paired_vs_shared" not in summary["moe_shared"] and "paired_vs_shared" not in summary["moe"]
    assert dag["added_params"] == 10 and dag["paper_ppl_improvement"] == 0.587
    budget = {"variants": list(ppl), "seeds": [0, 1, 2], "eval_source": "", "source": "text:x",
              "steps": 1, "batch_size": 1, "seq_len": 1}
    text = format_report({"budget": budget, "summary": summary, "tokens_per_run": 1,
                          "paper_source": "p"})
    assert "+0.100 ± 0.000" in text and "vs shared" in text


def test_quality_ladder_pairs_relative_gaps_per_rung_and_their_change():
    from benchmarks.experiments.quality import (QualityBudget, format_ladder, ladder_budgets,
                                     ladder_gaps, parse_tokens, summarize)
    assert [parse_tokens(t) for t in ("400000", "400K", "0.4M", "1.6m")] == [
        400_000, 400_000, 400_000, 1_600_000]
    with pytest.raises(ValueError, match="0.4M"):
        parse_tokens("lots")
    base = QualityBudget(source="text:x", batch_size=16, seq_len=128)
    assert [b.steps for b in ladder_budgets(base, [1_600_000, 400_000])] == [195, 781]

    def rung(tokens, moe, dag):                # perplexities per seed
        runs = [{"variant": v, "seed": s, "loss": float(np.log(p)), "perplexity": p,
                 "params": 1, "description": v}
                for v, values in (("moe", moe), ("dag_l2", dag)) for s, p in enumerate(values)]
        return {"tokens_per_run": tokens, "budget": {"variants": ["moe", "dag_l2"]},
                "runs": runs, "summary": summarize(runs)}
    rungs = [rung(100_000, [10.0, 10.0, 10.0], [10.1, 10.0, 10.2]),    # -1, 0, -2 %
             rung(400_000, [8.0, 8.0, 8.0], [7.6, 7.68, 7.6])]          # +5, +4, +5 %
    gaps = ladder_gaps(rungs)["dag_l2"]
    assert gaps[0]["mean"] == pytest.approx(-1.0) and not gaps[0]["beyond_spread"]
    assert gaps[1]["mean"] == pytest.approx(14 / 3) and gaps[1]["beyond_spread"]
    assert gaps[1]["change"]["mean"] == pytest.approx(14 / 3 + 1.0)   # 6, 4, 7 points
    text = format_ladder({"ladder": rungs})
    assert "0.1M tokens" in text and "0.4M tokens" in text and "+4.67 ± 0.58*" in text


def test_reasoning_pairs_seeds_against_moe_in_and_out_of_distribution():
    from benchmarks.experiments.reasoning import format_report, paired_vs_reference
    budget = {"tasks": ["lis"], "variants": ["moe", "dag_l2"], "seeds": [0, 1, 2], "steps": 1,
              "batch_size": 1, "seq_len": 1, "train_sizes": [4, 12], "sizes": [4, 8, 16],
              "eval_examples": 1}
    acc = {"moe": [(0.5, 0.6, 0.1), (0.6, 0.6, 0.2), (0.4, 0.5, 0.1)],
           "dag_l2": [(0.6, 0.7, 0.1), (0.7, 0.7, 0.3), (0.5, 0.6, 0.2)]}
    runs = [{"task": "lis", "variant": v, "seed": s, "accuracy": dict(zip(("4", "8", "16"), a))}
            for v, rows in acc.items() for s, a in enumerate(rows)]
    paired = paired_vs_reference({"budget": budget, "runs": runs})
    cells = paired[("lis", "dag_l2")]
    assert cells["in_distribution"]["mean"] == pytest.approx(0.1)     # +0.1 at 4 and 8, each seed
    assert cells["in_distribution"]["beyond_spread"] is True
    assert cells["longer"]["mean"] == pytest.approx(0.2 / 3)           # 0, +0.1, +0.1
    assert cells["longer"]["beyond_spread"] is False
    results = {"budget": budget, "runs": runs, "tokens_per_run": 1,
               "dp_depth": {"lis": "L"}, "majority_baseline": {},
               "variants": {v: {"params": 1, "added_params": 0, "description": v} for v in acc},
               "summary": {"lis": {}}}
    assert "+10.0 ±  0.0*" in format_report(results)
