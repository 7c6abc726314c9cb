"""Looking inside: recording intermediates changes nothing the model computes and agrees with its
own statistics, the recorded edge gates equal a NumPy transcription of DAG-MoE eq. 7-11 that
builds the node pairs, and the plot command writes every PNG that applies to a real (tiny)
checkpoint of a DAG-MoE and a CoE run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import build_once, make_model, single_device_env, tiny_config
from dagmoe_jax.analysis.collection import Collected, collect, gate_sparsity_counts, record
from dagmoe_jax.analysis.report import summary, summary_lines
from dagmoe_jax.families.moe.dag import edge_mask

REPO = Path(__file__).resolve().parent.parent
PNG = b"\x89PNG\r\n\x1a\n"


def randomized(cfg, seed=0, scale=0.3):
    """A model whose every parameter is random (W_up too, so the DAG changes the output)."""
    model = make_model(cfg, seed=seed)
    rng = np.random.default_rng(seed)
    noisy = jax.tree.map(lambda x: x + scale * rng.standard_normal(x.shape).astype(x.dtype),
                         nnx.state(model, nnx.Param))
    nnx.update(model, noisy)
    return model


@pytest.mark.parametrize("block,kind", [("moe", "dag"), ("coe", "sum")])
def test_recording_changes_nothing_and_matches_the_model_statistics(block, kind):
    cfg = tiny_config(block, kind, experts=dict(capacity_factor=8.0))
    model = randomized(cfg)
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 16))
    logits, aux = model(jnp.asarray(tokens))
    assert "intermediates" not in aux                       # off unless asked for
    kept = record(model, tokens)
    # the same computation (jitted here, eager above; the DAG also returns its edge tensor)
    np.testing.assert_allclose(np.asarray(kept["logits"]), np.asarray(logits), rtol=1e-5,
                               atol=1e-5)
    ids = np.asarray(kept["indices"])
    c = cfg.block.iterations if block == "coe" else 1
    k = cfg.block.resolved_top_k if block == "coe" else cfg.block.router.top_k
    assert ids.shape == (cfg.num_layers, c, 32, k)
    n = cfg.block.experts.num_experts
    load = np.stack([np.bincount(ids[l].reshape(-1), minlength=n) / ids[l].size
                     for l in range(cfg.num_layers)])
    np.testing.assert_allclose(load, np.asarray(aux["expert_load"]), rtol=1e-6)
    if kind == "dag":
        a = cfg.block.aggregation
        assert kept["edge_gates"].shape == (cfg.num_layers, a.dag_iters, 32, k, k, a.dag_dim)
    assert "intermediates" not in model(jnp.asarray(tokens))[1]     # switched off again


def _layer_norm(x, scale, bias, eps):
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / np.sqrt(var + eps) * scale + bias


def _silu(x):
    return x / (1.0 + np.exp(-x))


def test_edge_gates_match_numpy_on_one_layer():
    cfg = tiny_config("moe", "dag", experts=dict(capacity_factor=8.0))
    model = randomized(cfg, seed=1)
    tokens = np.random.default_rng(1).integers(0, cfg.vocab_size, (2, 12))
    layer = 1
    kept = record(model, tokens)
    gates = np.asarray(kept["edge_gates"], np.float64)[layer]      # [L, T, K, K, dg]
    inputs = np.asarray(kept["dag_inputs"], np.float64)[layer]     # [L, T, K, d]
    # The layer's parameters read straight from the model state (layer axis indexed here).
    agg = nnx.state(model)["layers"]["block"]["aggregator"]["iterations"]
    p = {k: np.asarray(agg[k][...], np.float64)[layer] for k in
         ("ln_scale", "ln_bias", "w_down", "w_edge", "w_node", "w_up")}
    nodes = inputs[0]
    t, k, _ = nodes.shape
    for it in range(cfg.block.aggregation.dag_iters):
        u = _layer_norm(nodes, p["ln_scale"][it], p["ln_bias"][it], cfg.norm_eps) @ p["w_down"][it]
        pairs = np.concatenate([np.repeat(u[:, :, None], k, axis=2),       # [u_i ; u_j]
                                np.repeat(u[:, None, :], k, axis=1)], axis=-1)
        edge = _silu(pairs @ p["w_edge"][it])                                # eq. 10
        np.testing.assert_allclose(gates[it], edge, rtol=1e-4, atol=1e-5)
        messages = (edge * (pairs @ p["w_node"][it])).sum(axis=2)          # eq. 10-11
        nodes = messages @ p["w_up"][it] + nodes                           # eq. 11
        if it + 1 < cfg.block.aggregation.dag_iters:
            np.testing.assert_allclose(inputs[it + 1], nodes, rtol=1e-4, atol=1e-4)
    assert np.abs(gates).mean() > 1e-3     # not a trivially zero comparison


def test_collect_statistics_are_consistent():
    cfg = tiny_config("coe", "sum")
    model = randomized(cfg, seed=2)
    tokens = np.random.default_rng(2).integers(0, cfg.vocab_size, (2, 16))
    mask = np.ones((2, 16), bool)
    mask[1, 10:] = False                                            # padding is left out
    stats = collect(model, [{"inputs": tokens, "mask": mask}])
    assert stats.tokens == 26
    np.testing.assert_allclose(stats.expert_load.sum(axis=1), 1.0)
    k_t = cfg.block.resolved_top_k
    # every kept token adds k_t x k_t expert pairs between consecutive iterations
    np.testing.assert_allclose(stats.coactivation.sum(axis=(2, 3)), 26 * k_t * k_t)
    assert stats.gate_mean is None

    dag = collect(randomized(tiny_config("moe", "dag"), seed=3), [{"inputs": tokens, "mask": mask}])
    kept = record(randomized(tiny_config("moe", "dag"), seed=3), tokens)
    gates = np.asarray(kept["edge_gates"])[0][:, mask.reshape(-1)]
    magnitude = np.abs(gates).mean(-1)                              # [L, T', K, K]
    np.testing.assert_allclose(dag.gate_mean[0], magnitude.mean(axis=1), rtol=1e-5)
    np.testing.assert_allclose(dag.gate_std[0], magnitude.std(axis=1), rtol=1e-3, atol=1e-6)
    assert dag.gate_samples.shape[2] == 26 and dag.coactivation is None


def test_edge_gate_sparsity_on_a_synthetic_record():
    """The sparsity of known gates: per layer and iteration, the share of |e| < 0.1 over the
    graph's pairs and d_g channels, and of pairs whose mean |e| is below it."""
    rng = np.random.default_rng(4)
    gates = rng.uniform(-1, 1, size=(2, 3, 5, 4, 4, 6))
    gates[0, 1, :, 0, 1] = 0.01 * rng.uniform(-1, 1, size=(5, 6))     # one switched-off pair
    for edges in ("all", "ranked", "self"):
        mask = edge_mask(4, edges)
        below, pairs_below, n_values, n_pairs = gate_sparsity_counts(gates, mask, 0.1)
        kept = np.abs(gates)[:, :, :, mask]
        for l in range(2):
            for it in range(3):
                values = kept[l, it]                                    # [T, P, dg]
                assert below[l, it] == np.sum(values < 0.1)
                assert pairs_below[l, it] == np.sum(values.mean(-1) < 0.1)
        assert n_values == 5 * mask.sum() * 6 and n_pairs == 5 * mask.sum()
    _, pairs_below, _, _ = gate_sparsity_counts(gates, edge_mask(4, "all"), 0.1)
    assert pairs_below[0, 1] >= 5 and pairs_below[1, 1] <= pairs_below[0, 1]
    stats = Collected(tokens=5, block="moe", aggregation="dag", expert_load=None,
                      coactivation=None, gate_mean=None, gate_std=None, gate_samples=None,
                      gate_sparsity=np.array([[0.5, 0.25]]),
                      pair_sparsity=np.array([[0.125, 0.0]]), sparsity_threshold=0.1)
    blob = json.loads(json.dumps(summary(stats)))
    assert blob["edge_gates"] == {"threshold": 0.1, "gate_sparsity": [[0.5, 0.25]],
                                  "pair_sparsity": [[0.125, 0.0]]}
    lines = summary_lines(blob)
    assert lines[1] == "  layer 0: iteration 1 0.500 / 0.125, iteration 2 0.250 / 0.000"
    assert summary_lines({"tokens": 5, "block": "coe", "aggregation": "sum"}) == []


@pytest.mark.parametrize("edges", ["all", "self"])
def test_collect_reports_the_edge_gate_sparsity_of_the_recorded_gates(edges):
    cfg = tiny_config("moe", "dag", aggregation=dict(dag_edges=edges))
    tokens = np.random.default_rng(5).integers(0, cfg.vocab_size, (2, 16))
    mask = np.ones((2, 16), bool)
    mask[0, 12:] = False
    stats = collect(randomized(cfg, seed=4), [{"inputs": tokens, "mask": mask}])
    gates = np.asarray(record(randomized(cfg, seed=4), tokens)["edge_gates"])[:, :, mask.ravel()]
    pairs = edge_mask(cfg.block.router.top_k, edges)
    magnitude = np.abs(gates)[:, :, :, pairs]                          # [layers, L, T', P, dg]
    np.testing.assert_allclose(stats.gate_sparsity, (magnitude < 0.1).mean(axis=(2, 3, 4)))
    np.testing.assert_allclose(stats.pair_sparsity, (magnitude.mean(-1) < 0.1).mean(axis=(2, 3)))
    assert stats.gate_sparsity.shape == (cfg.num_layers, cfg.block.aggregation.dag_iters)
    assert 0 < stats.gate_sparsity.mean() < 1
    if edges == "self":     # the recorded off-diagonal zeros are not edges and do not count
        assert np.all(np.asarray(gates)[:, :, :, ~pairs] == 0)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Two 4-step smoke runs trained side by side: the smoke DAG-MoE and a CoE variant (built
    once for the whole run: conftest.build_once)."""
    return {name: Path(path) for name, path in
            build_once(tmp_path_factory, "analysis", _train_runs).items()}


def _train_runs(root: Path) -> dict:
    specs = {"dag": [], "coe": ["--gin_file=variants/coe_g128_l2.gin"]}
    procs = {}
    for name, extra in specs.items():
        procs[name] = subprocess.Popen(
            [sys.executable, str(REPO / "train.py"), "--gin_file=train/smoke.gin", *extra,
             f"--run_dir={root / name}", "--no_progress", "--gin.RunConfig.steps=4",
             "--gin.OptimConfig.warmup_steps=1", "--gin.RunConfig.task_eval_examples=0",
             "--gin.RunConfig.tensorboard=False"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=single_device_env(),
            cwd=root)
    for name, proc in procs.items():
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err
    return {name: str(root / name) for name in specs}


def analyze(run_dir: Path, out: Path, *args) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "dagmoe_jax.cli.analyze", f"--run_dir={run_dir}",
                             f"--out={out}", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=single_device_env(), cwd=REPO)


@pytest.fixture(scope="module")
def analyzed(runs, tmp_path_factory):
    """The plot command on both runs, side by side: (returncode, stdout, stderr, out dir)."""
    root = tmp_path_factory.mktemp("plots")
    procs = {"dag": analyze(runs["dag"], root / "dag", "--batches=2"),
             "coe": analyze(runs["coe"], root / "coe", "--batches=1", "--data=synthetic:lcs")}
    results = {}
    for name, proc in procs.items():
        out, err = proc.communicate(timeout=300)
        results[name] = (proc.returncode, out, err, root / name)
    return results


def assert_pngs(out: Path, names):
    for name in names:
        data = (out / f"{name}.png").read_bytes()
        assert data.startswith(PNG) and len(data) > 2000, name


@pytest.mark.slow
def test_plot_command_on_a_dag_run(analyzed):
    code, stdout, stderr, out = analyzed["dag"]
    assert code == 0, stderr
    assert_pngs(out, ("expert_load", "edge_gates", "edge_gate_hist", "dropped_fraction",
                      "load_balance"))
    assert "edge-gate sparsity over" in stdout and "  layer 1: iteration 1 " in stdout
    assert ", iteration 2 " in stdout
    assert len(json.loads((out / "summary.json").read_text())["edge_gates"]["gate_sparsity"]) == 2
    assert "skipped coactivation: co-activation between iterations is for CoE runs" in stdout
    assert not (out / "coactivation.png").exists()
    assert "doe_gates" not in stdout              # DoE's own plot: its family's analysis alone


@pytest.mark.slow
def test_plot_command_on_a_coe_run_with_other_data(analyzed):
    code, stdout, stderr, out = analyzed["coe"]
    assert code == 0, stderr
    assert_pngs(out, ("expert_load", "coactivation", "dropped_fraction", "load_balance"))
    assert "skipped edge_gates: edge gates are for DAG-MoE runs" in stdout
    assert not (out / "edge_gates.png").exists()


def test_plot_command_errors_are_one_line(tmp_path, capsys):
    from dagmoe_jax.cli.analyze import main

    for argv in ([f"--run_dir={tmp_path / 'nowhere'}", f"--out={tmp_path}"], ["--out=x"],
                 ["--run_dir=x", "--out=y", "--batches=0"], ["--bogus"]):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith("error: ") and len(err.strip().splitlines()) == 1, err
    assert main(["--help"]) == 0 and "--run_dir" in capsys.readouterr().out
