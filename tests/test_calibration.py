"""The calibrated step time (dagmoe_jax/compile/calibration.py), host transfers in the
roofline, accelerator-type topologies and the planner's lines (no compiler needed)."""

import math

import numpy as np
import pytest

from dagmoe_jax.compile import calibration, roofline
from dagmoe_jax.compile.calibration import CalibrationRun, fit, predict
from dagmoe_jax.compile.chips import CHIPS, parse_topology
from dagmoe_jax.compile.search import (MOSAIC_UNDER_TENSOR, Candidate, Outcome,
                                       compile_error_line, within_error)


def _run(name, measured, compute, collectives=0.0, offload=0.0, held_out=False, chip="v6e"):
    return CalibrationRun(name, "src", chip, False, measured, compute, compute / 2,
                          collectives, offload, held_out)


def test_the_fit_is_the_geometric_mean_of_measured_over_floor():
    """scale = exp(mean(log(measured / floor))) over the runs not held out (a NumPy
    transcription); the spread is min/max of measured / predicted - 1 over them; a held-out
    run's error is its own ratio and does not move the scale."""
    runs = [_run("a", 3.0, 2.0), _run("b", 10.0, 4.0, collectives=5.0),   # floor 5 (collectives)
            _run("c", 1.0, 0.3, offload=0.8), _run("d", 7.0, 2.0, held_out=True)]
    floors = np.array([2.0, 5.0, 0.8])
    ratios = np.array([3.0, 10.0, 1.0]) / floors
    scale = float(np.exp(np.log(ratios).mean()))
    c = fit("tpu", runs)
    assert c.scale == pytest.approx(scale)
    assert (c.low, c.high) == pytest.approx((ratios.min() / scale - 1, ratios.max() / scale - 1))
    assert c.held_out == {"d": pytest.approx(7.0 / (scale * 2.0) - 1)}
    assert c.fit_runs == ("a", "b", "c")
    moved = fit("tpu", runs[:3] + [_run("d", 70.0, 2.0, held_out=True)])
    assert moved.scale == pytest.approx(c.scale)
    assert fit("tpu", [_run("d", 1.0, 1.0, held_out=True)]) is None


def test_the_shipped_calibration_covers_what_the_issue_asks():
    """At least six published TPU runs, two or more held out; MoE and dense; v6e and v5p;
    every run's source names its file; the H200 steps calibrate GPUs."""
    tpu = calibration.TPU_RUNS
    assert len(tpu) >= 6 and sum(r.held_out for r in tpu) >= 2
    assert {r.moe for r in tpu} == {True, False} and {r.chip for r in tpu} >= {"v6e", "v5p"}
    assert all(r.source.endswith("README.md") and r.measured > 0 and r.floor > 0 for r in tpu)
    assert set(calibration.CALIBRATIONS) == {"tpu", "gpu"}
    gpu = calibration.CALIBRATIONS["gpu"]
    assert gpu.chips == ("h200",) and 1.5 < gpu.scale < 2.5      # the H200 ran 1.8-2.2x


def test_a_prediction_says_where_it_is_unverified():
    """On a chip with runs of its own the line names the runs' spread; on one without (an
    H100 against the H200's runs) it says the scale is unverified there; the chip-hours of a
    run's steps are the predicted seconds x steps x chips."""
    floor = 0.05
    p = predict(floor, CHIPS["h200"])
    c = calibration.CALIBRATIONS["gpu"]
    assert p.seconds == pytest.approx(c.scale * floor) and p.verified
    assert p.low_seconds < p.seconds < p.high_seconds
    line = p.line(floor, 16384, 8, "h200", steps=1000)
    assert f"x {c.scale:.2f}" in line and c.spread() in line and "unverified" not in line
    hours = p.seconds * 1000 * 8 / 3600
    assert f"{hours:,.0f} chip-hours" in line
    h100 = predict(floor, CHIPS["h100"])
    assert not h100.verified
    assert "no calibration run on h100" in h100.line(floor, 16384, 1, "h100")
    assert predict(0.0, CHIPS["h200"]) is None


HOST_HLO = """HloModule offload, entry_computation_layout={()->bf16[4,256,512]}

ENTRY %main (a: bf16[4,256,512], x: bf16[1,256,512], i: s32[]) -> bf16[4,256,512] {
  %a = bf16[4,256,512]{2,1,0:T(8,128)(2,1)S(5)} parameter(0)
  %x = bf16[1,256,512]{2,1,0:T(8,128)(2,1)} parameter(1)
  %i = s32[] parameter(2)
  %z = s32[] constant(0)
  %up = ((bf16[4,256,512]{2,1,0:T(8,128)(2,1)S(5)}, bf16[1,256,512]{2,1,0:T(8,128)(2,1)}, s32[], s32[], s32[]), bf16[4,256,512]{2,1,0:T(8,128)(2,1)S(5)}, u32[]{:S(2)}) dynamic-update-slice-start(%a, %x, %i, %z, %z)
  %upd = bf16[4,256,512]{2,1,0:T(8,128)(2,1)S(5)} dynamic-update-slice-done(%up)
  %down = ((bf16[4,256,512]{2,1,0:T(8,128)(2,1)S(5)}, s32[], s32[], s32[]), bf16[1,256,512]{2,1,0:T(8,128)(2,1)}, u32[]{:S(2)}) dynamic-slice-start(%upd, %i, %z, %z), dynamic_slice_sizes={1,256,512}
  %got = bf16[1,256,512]{2,1,0:T(8,128)(2,1)} dynamic-slice-done(%down)
  ROOT %r = bf16[4,256,512]{2,1,0:T(8,128)(2,1)S(5)} copy(%upd)
}
"""


def test_host_transfers_move_their_slice_over_the_host_link():
    """An offloaded activation's update sent to host memory and its slice brought back move
    one slice each at the host link's bandwidth, as offload time off the cores (not the
    4x larger host buffer at HBM speed); a copy of a host buffer moves the buffer."""
    chip = CHIPS["v6e"]
    cost = roofline.program_cost(HOST_HLO, chip, devices=1)
    piece, whole = 2 * 256 * 512, 2 * 4 * 256 * 512
    assert cost.offload_bytes == 2 * piece + whole
    assert cost.offload_seconds == pytest.approx((2 * piece + whole) / chip.host_bandwidth)
    assert cost.compute_seconds == 0 and cost.hbm_bytes == 0
    assert cost.overlapped_seconds == cost.offload_seconds
    assert cost.seconds == 0        # the sum leaves the asynchronous transfers out


def test_accelerator_types_name_their_standard_slice():
    """'v5p-8' (cores) is 4 chips in 2x2x1, 'v6e-256' 16x16, 'v5litepod-16' 4x4; a size with
    no standard slice, one line naming the types and the grid form."""
    assert parse_topology("v5p-8") == (CHIPS["v5p"], (2, 2, 1))
    assert parse_topology("v5p-1024") == (CHIPS["v5p"], (8, 8, 8))
    assert parse_topology("v6e-256") == (CHIPS["v6e"], (16, 16))
    assert parse_topology("v5litepod-16") == (CHIPS["v5e"], (4, 4))
    with pytest.raises(ValueError, match=r"v5p-8, v5p-16.*v5p:16x16x16") as err:
        parse_topology("v5p-6")
    assert "\n" not in str(err.value)
    assert CHIPS["a100"].card == "NVIDIA A100 SXM4 80 GB"


def test_the_planner_says_which_meshes_the_error_cannot_order():
    """Meshes within (1 + high) / (1 + low) of the best's predicted tokens/s are within the
    error; a Mosaic kernel's partitioning failure reads as what to change."""
    def outcome(tokens):
        return Outcome(Candidate((1, 1, 1, 1), 1), 1.0, tokens)
    outcomes = [outcome(1000.0), outcome(900.0), outcome(700.0), Outcome(Candidate((2, 1, 1, 1), 1),
                                                                        error="out of memory")]
    close = within_error(outcomes, -0.1, 0.15)          # bound 1.15 / 0.9 = 1.278
    assert [o.tokens_per_second for o in close] == [1000.0, 900.0]
    assert 1000 / 700 > 1.15 / 0.9 > 1000 / 900
    assert within_error(outcomes, 0.0, 0.0) == outcomes[:1]
    err = NotImplementedError("Mosaic kernels cannot be automatically partitioned. Please "
                              "wrap the call in a shard_map.\nmore")
    assert compile_error_line(err) == MOSAIC_UNDER_TENSOR
    assert compile_error_line(ValueError("bad\nmore")) == "bad"
    assert math.isclose(len(MOSAIC_UNDER_TENSOR.splitlines()), 1)


def test_window_taps_match_a_brute_force_count_with_dilation():
    """Taps landing on input elements (not padding, not the holes of a dilated input) equal an
    explicit enumeration, for every mix of padding, stride and the two dilations; XLA:TPU's
    batched product over E experts (window E, lhs_dilate E, stride E - 1, padded E - 1 each
    side) meets one tap per output."""
    from dagmoe_jax.compile.matmul_flops import _window_taps

    def brute(size, window, out, pad_lo, stride, ld, rd):
        dilated = {i * ld for i in range(size)}
        return sum(1 for o in range(out) for k in range(window)
                   if o * stride + k * rd - pad_lo in dilated)

    rng = np.random.default_rng(0)
    for _ in range(300):
        size, window = int(rng.integers(1, 9)), int(rng.integers(1, 9))
        ld, rd, stride = (int(x) for x in rng.integers(1, 4, size=3))
        pad_lo, out = int(rng.integers(0, 6)), int(rng.integers(1, 12))
        assert _window_taps(size, window, out, pad_lo, stride, ld, rd) == brute(
            size, window, out, pad_lo, stride, ld, rd)
    e = 8
    assert _window_taps(e, e, e, e - 1, e - 1, e, 1) == e


@pytest.mark.skipif(__import__("dagmoe_jax.compile.chips", fromlist=["x"]).tpu_compiler_missing()
                    is not None, reason="libtpu is not installed (.ci/run installs it)")
def test_the_compile_report_predicts_with_its_calibration(capsys):
    """A tiny training step compiled for 'v5p-8' (the accelerator type a user reserves):
    the roofline line says it is not a step time, and the prediction line gives the floor
    times the TPU calibration's scale, its spread, the runs behind it and the run's
    chip-hours for its steps."""
    import jax
    from dagmoe_jax.compile.__main__ import main
    with jax.default_matmul_precision("default"):
        code = main(["--gin_file=models/tiny.gin", "--gin.ModelConfig.compute_dtype='bfloat16'",
                     "--gin.DataConfig.batch_size=8", "--gin.DataConfig.seq_len=128",
                     "--gin.RunConfig.steps=1000", "--programs=train", "--topology=v5p-8"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "compiling for v5p-8: 4 v5p chips" in out and "TPU v5p" in out
    roof = next(line for line in out.splitlines() if "roofline at datasheet peak" in line)
    floor = float(roof.split("floor ")[1].split()[0]) / 1e3
    line = next(line for line in out.splitlines() if line.strip().startswith("predicted:"))
    c = calibration.CALIBRATIONS["tpu"]
    predicted = float(line.split("predicted: ")[1].split()[0]) / 1e3
    assert predicted == pytest.approx(c.scale * floor, rel=0.02, abs=2e-5)
    assert c.spread() in line and f"{len(c.fit_runs)} runs on {'/'.join(c.chips)}" in line
    assert "held out" in line and "unverified" not in line
    assert "the run's 1,000 steps:" in out and "chip-hours" in out


def test_the_floor_keeps_the_exchanges_on_the_critical_path():
    """All-to-all exchanges (the experts wait for their tokens) add to compute in the floor;
    the other collectives and host transfers overlap it; a calibration run's floor is the
    same expression."""
    cost = roofline.Cost(compute_seconds=1.0, collective_seconds=0.9, offload_seconds=0.4,
                         collectives={"ragged-all-to-all": {"count": 1, "bytes": 0.0,
                                                            "seconds": 0.3},
                                      "all-gather": {"count": 1, "bytes": 0.0, "seconds": 0.6}})
    assert cost.exchange_seconds == 0.3
    assert cost.overlapped_seconds == pytest.approx(1.3)
    assert roofline.Cost(compute_seconds=1.0, collective_seconds=2.0).overlapped_seconds == 2.0
    run = CalibrationRun("r", "s", "v5p", True, 2.0, 1.0, 0.5, 0.9, 0.4, exchange=0.3)
    assert run.floor == pytest.approx(cost.overlapped_seconds)


def test_mesh_replica_groups_with_a_sub_axis():
    """Shardy's mesh-named replica groups: whole axes multiply their sizes; a sub-axis
    'fsdp':(4)8 (8 of fsdp's devices, after 4) counts 8 (MaxText's Llama4-Maverick program)."""
    from dagmoe_jax.compile.hlo import group_size
    mesh = "replica_groups=mesh['data'=2,'fsdp'=32,'tensor'=4]"
    assert group_size(f"{mesh} {{'fsdp':(4)8}}, dimensions={{0}}", 256) == (8, None)
    assert group_size(f"{mesh} {{'fsdp','tensor'}}, x", 256) == (128, None)
    assert group_size(f"{mesh} {{'tensor'}}, x", 256) == (4, None)
