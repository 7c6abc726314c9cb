"""The reasoning, quality and downstream benchmarks run end to end on their --micro budgets (two
variants each, to keep the suite short; the variants' configs are checked in
test_eval_scoring.py)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from conftest import benchmark_command, single_device_env

pytestmark = pytest.mark.slow          # subprocesses of the benchmark drivers

REPO = Path(__file__).resolve().parent.parent

def start(name: str, *args: str) -> subprocess.Popen:
    return subprocess.Popen(benchmark_command(name, "--micro", *args),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=single_device_env(), cwd=REPO)


def finish(proc: subprocess.Popen) -> subprocess.CompletedProcess:
    out, err = proc.communicate(timeout=400)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


# Each test starts its own benchmark: a module fixture starting all three would run each of them
# once per xdist worker that runs one of these tests (twice, on the suite's two workers).
VARIANTS = {"reasoning": "--variants=moe,dag_l1", "quality": "--variants=moe,coe",
            "downstream": "--variants=moe_shared,dag_l2"}


def run_micro(name: str, root: Path) -> subprocess.CompletedProcess:
    return finish(start(name, VARIANTS[name], f"--out={root / name}"))


def test_reasoning_micro_end_to_end(tmp_path):
    root = tmp_path
    out = root / "reasoning"
    result = run_micro("reasoning", root)
    assert result.returncode == 0, result.stderr[-2000:]
    results = json.loads((out / "reasoning.json").read_text())
    assert results["budget"]["tasks"] == ["lis"] and results["budget"]["sizes"] == [4, 8, 14]
    assert {(r["variant"], r["seed"]) for r in results["runs"]} == {("moe", 0), ("dag_l1", 0)}
    for run in results["runs"]:
        assert run["step"] == 20 and (Path(run["run_dir"]) / "checkpoints").is_dir()
        assert sorted(run["accuracy"]) == ["14", "4", "8"]
        assert all(0.0 <= a <= 1.0 for a in run["accuracy"].values())
    cells = results["summary"]["lis"]["dag_l1"]
    assert set(cells) == {"4", "8", "14"} and all(len(c) == 2 for c in cells.values())
    assert results["variants"]["dag_l1"]["added_params"] > 0
    assert results["variants"]["moe"]["added_params"] == 0
    # the table: one row per variant, sizes as columns, the longer-than-trained one starred
    assert "14*" in result.stdout and "DAG-MoE L 1" in result.stdout
    assert "(majority answer)" in result.stdout and "L(dp) = LIS + 1" in result.stdout
    bad = finish(start("reasoning", "--variants=dag", f"--out={out}"))
    assert bad.returncode == 2 and "variant 'dag' is invalid" in bad.stderr


def test_quality_micro_end_to_end(tmp_path, stdlib_corpus):
    root = tmp_path
    out = root / "quality"
    stdlib_corpus(out / "corpus")       # built once for the run (conftest)
    result = run_micro("quality", root)
    assert result.returncode == 0, result.stderr[-2000:]
    results = json.loads((out / "quality.json").read_text())
    corpus = results["corpus"]
    assert corpus["train_bytes"] > 500_000 and corpus["heldout_bytes"] > 10_000
    train_text = Path(corpus["train_path"]).read_text()
    held_text = Path(corpus["heldout_path"]).read_text()
    held_docs = [d for d in held_text.split("\n\n") if len(d) > 200][:50]
    assert held_docs and not any(d in train_text for d in held_docs)   # split by file
    summary = results["summary"]
    assert summary["moe"]["ppl_improvement"] == 0.0
    coe = summary["coe"]
    assert coe["relative_improvement"] == (summary["moe"]["perplexity"][0]
                                           - coe["perplexity"][0]) / summary["moe"]["perplexity"][0]
    assert coe["paper_ppl_improvement"] == 0.480
    assert "paper Δppl" in result.stdout and "Ablation Study table" in result.stdout
    for run in results["runs"]:
        assert run["step"] == 10 and 1.0 < run["perplexity"] < 256.0
    # --report re-prints the same table from the JSON without training
    again = subprocess.run(benchmark_command("quality", f"--report={out / 'quality.json'}"),
                           capture_output=True, text=True,
                           env=single_device_env(), cwd=REPO, timeout=120)
    assert again.returncode == 0, again.stderr[-2000:]
    table = [line for line in again.stdout.splitlines() if line.startswith(("MoE", "CoE"))]
    assert len(table) == 2 and all(line in result.stdout for line in table)


def test_downstream_micro_end_to_end(tmp_path, stdlib_corpus):
    """Pre-training, fine-tuning and harness scoring of two variants."""
    root = tmp_path
    out = root / "downstream"
    stdlib_corpus(out / "corpus")
    result = run_micro("downstream", root)
    assert result.returncode == 0, result.stderr[-2000:]
    results = json.loads((out / "downstream.json").read_text())
    records = results["records"]
    assert [(r["variant"], r["stage"]) for r in records] == [
        ("moe_shared", "pre-trained"), ("moe_shared", "fine-tuned"),
        ("dag_l2", "pre-trained"), ("dag_l2", "fine-tuned")]
    # each accuracy is a whole number of the task's items answered right; bits per byte are
    # finite; and the fine-tuned run was scored, not the pre-trained one again
    for column in ("math MC", "math gen", "text MC", "text gen"):
        domain, kind = column.split()
        items = len((out / "tasks" / f"instruct_{domain}_{kind.lower()}.jsonl")
                    .read_text().splitlines())
        for r in records:
            right = r[column] * items
            assert abs(right - round(right)) < 1e-6 and 0 <= round(right) <= items, (column, r)
    for r in records:
        assert 0 < r["text bpb"] < 64
    for pre, tuned in (records[:2], records[2:]):
        assert pre["text bpb"] != tuned["text bpb"]
    sft = json.loads((Path(records[1]["run_dir"]) / "config.json").read_text())
    assert sft["run"]["init_from"] == records[0]["run_dir"]
    assert sft["data"]["source"].startswith("instruct:")
    assert "| DAG-MoE L 2 | fine-tuned |" in result.stdout
    assert "Seed-paired difference from MoE + shared expert" in result.stdout


def test_dume_reasoning_micro_end_to_end(tmp_path, stdlib_corpus):
    """DUME's Table 3 in miniature on its own (its corpus built as the pipeline builds it): four
    experts, every row of the table, the normalised average; a test of its own, so that the two
    halves of downstream.py run on both workers."""
    from benchmarks.experiments.dume_table import rows
    from benchmarks.experiments.instructions import DUME_DOMAINS

    out = tmp_path / "downstream"
    stdlib_corpus(out / "corpus")
    dume = subprocess.run(benchmark_command("downstream", "--micro", "--dume", f"--out={out}"),
                          capture_output=True, text=True,
                          env=single_device_env(), cwd=REPO, timeout=400)
    assert dume.returncode == 0, dume.stderr[-2000:]
    merged = json.loads((out / "dume.json").read_text())
    every = rows(DUME_DOMAINS)
    assert [r["model"] for r in merged["records"]] == [
        m for m in every if m != "oracle (diagonal)"]          # the diagonal: from the experts
    seed0 = out / "dume" / "seed0"
    hf = seed0 / "hf" / "numbers"
    assert json.loads((hf / "config.json").read_text())["model_type"] == "llama"
    assert (seed0 / "dume_k1" / "dume_stats" / "domain_3.npz").is_file()
    for trained, trainable in (("dume_plus", "router"), ("btx", "router"),
                               ("dag", "aggregator")):
        config = json.loads((seed0 / trained / "config.json").read_text())
        assert config["run"]["trainable"] == trainable
        assert (seed0 / trained / "checkpoints" / str(merged["router_steps"])).is_dir()
    again = subprocess.run(benchmark_command("downstream", f"--report={out / 'dume.json'}"),
                           capture_output=True, text=True,
                           env=single_device_env(), cwd=REPO, timeout=120)
    assert again.returncode == 0
    assert "| norm. avg |" in again.stdout
    for model in every:
        assert f"| {model} |" in again.stdout, model
