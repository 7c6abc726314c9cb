"""A step time to plan on: the roofline's floor scaled by what published runs measured, with
the error those runs show.

The roofline (:mod:`dagmoe_jax.compile.roofline`) prices each instruction of a compiled
program at its chip's datasheet peak; its floor ``max(compute, collectives, offload)`` is what
the step could not beat. Real steps run slower by an amount no datasheet gives (the matrix
units' efficiency at the program's shapes, vector-bound fusions, scheduling gaps, collectives
left exposed), so the prediction is the floor times a scale fitted on runs whose step time
was measured and published, each compiled here with the configuration it ran
(``benchmarks/calibration.py``):

    predicted = scale x floor,   scale = geometric mean over the fit runs of measured / floor

Its error is the spread of ``measured / predicted`` over the fit runs (the lowest and highest),
and each held-out run's error is stated apart (those runs are not in the fit). TPU runs
(v6e, v5p) calibrate TPU chips and the H200 steps this project measured calibrate GPUs; a
chip without a run of its own gets its platform's scale with a line saying it is unverified
there. Pallas kernels the runs did not use (the Triton DAG module, which the H200 ran much
further from its floor than XLA's programs: benchmarks/RESULTS.md) are outside the
calibration, and the report says so.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Dict, Optional, Sequence, Tuple

from dagmoe_jax.compile.roofline import program_cost


@dataclasses.dataclass(frozen=True)
class CalibrationRun:
    """One measured run and the roofline terms of its program compiled here (seconds per
    step, per chip)."""

    name: str
    source: str            # where the measured step time is published
    chip: str              # compile.chips.CHIPS key
    moe: bool
    measured: float        # seconds per step, as logged
    compute: float         # the roofline's compute (every instruction on the cores)
    matmul_bound: float    # the part of compute bound by matmul FLOPs
    collectives: float
    offload: float         # host transfers
    held_out: bool = False
    exchange: float = 0.0  # the all-to-all part of collectives

    @property
    def floor(self) -> float:
        """The roofline's floor (``roofline.Cost.overlapped_seconds``)."""
        return max(self.compute + self.exchange, self.collectives - self.exchange, self.offload)

    @property
    def summed(self) -> float:
        """The roofline's sum (compute + collectives: nothing overlapped)."""
        return self.compute + self.collectives


_R = "AI-Hypercomputer/tpu-recipes training/"
_H200 = "benchmarks/RESULTS.md, 'The GPU kernels on an H200 (2026-11-28)'"
TPU_RUNS: Tuple[CalibrationRun, ...] = (
    # name, the README logging the measured step, chip, MoE, measured s/step, then the
    # roofline's compute, its matmul-bound part, collectives and host transfers (seconds)
    CalibrationRun("llama3.1-8b v6e-8", _R + "trillium/Llama3.1-8B-MaxText/v6e-8/README.md",
                   "v6e", False, 3.443, 2.0008, 1.71, 0.2035, 0.7157),
    CalibrationRun("mistral-7b v6e-8", _R + "trillium/Mistral-7B-MaxText/README.md", "v6e",
                   False, 6.32, 3.6685, 3.1945, 0.1897, 1.4313, held_out=True),
    CalibrationRun("llama3.1-70b v6e-32",
                   _R + "trillium/Llama3.1-70B-MaxText/v6e-32/README.md", "v6e", False, 17.79,
                   10.5781, 9.8622, 2.0384, 1.5194),
    CalibrationRun("mixtral-8x7b v6e-256", _R + "trillium/Mixtral-8x7B-MaxText/README.md",
                   "v6e", True, 13.484, 8.8305, 7.8029, 2.3118, 1.4313),
    CalibrationRun("mixtral-8x22b v6e-256", _R + "trillium/Mixtral-8x22B-MaxText/README.md",
                   "v6e", True, 24.706, 17.133, 15.3665, 4.7414, 2.3698),
    CalibrationRun("llama4-scout v5p-1024",
                   _R + "v5p/Llama4-Scout-17B-16E-Maxtext/README.md", "v5p", True, 31.652,
                   22.1817, 20.603, 4.3768, 2.0972, exchange=0.0067),
    CalibrationRun("llama4-maverick v5p-256",
                   _R + "v5p/Llama4-Maverick-17B-128E-Maxtext/README.md", "v5p", True, 24.792,
                   15.4432, 8.8682, 6.6736, 3.5652, held_out=True, exchange=0.0015),
)
"""MaxText recipes (``benchmarks/calibration.py --cost``: the terms of MaxText 0.2.5's program
for each recipe's configuration, compiled here by libtpu 0.0.48.1; two held out of the fit)."""

GPU_RUNS: Tuple[CalibrationRun, ...] = tuple(
    CalibrationRun(name, _H200, "h200", True, measured, estimate, 0.0, 0.0, 0.0)
    for name, measured, estimate in (
        # the variants' training steps measured on the H200 (16 x 1,024 tokens, bf16) beside
        # the roofline's estimate of the same compiled programs (one GPU: compute only);
        # the Triton DAG module's rows are left out (their kernels, not in the calibration)
        ("MoE-s h200", 0.033, 0.017), ("MoE-s + shared h200", 0.034, 0.018),
        ("DAG-MoE-s L 2 h200", 0.044, 0.024), ("MoE-s capacity h200", 0.032, 0.018),
        ("MoE-l h200", 0.080, 0.036), ("MoE-l + shared h200", 0.083, 0.038),
        ("DAG-MoE-l L 2 h200", 0.118, 0.062), ("MoE-l capacity h200", 0.072, 0.035)))
"""The H200 steps this project measured (XLA's programs and the 'mgpu' grouped matmul)."""

UNCALIBRATED_KERNELS = ("triton dag forward", "triton dag backward", "pallas dag forward",
                        "pallas dag backward")
"""The DAG module's kernels: no calibration run used them, the roofline mispriced the Triton
ones on the H200, and no TPU has run the Mosaic ones."""


@dataclasses.dataclass(frozen=True)
class Calibration:
    """A platform's fitted scale and its observed error."""

    platform: str
    scale: float
    low: float              # min over fit runs of measured / predicted - 1
    high: float             # max over fit runs of measured / predicted - 1
    fit_runs: Tuple[str, ...]
    chips: Tuple[str, ...]
    held_out: Dict[str, float]   # name: measured / predicted - 1

    def spread(self) -> str:
        return f"{self.low:+.0%}/{self.high:+.0%}"


def fit(platform: str, runs: Sequence[CalibrationRun]) -> Optional[Calibration]:
    """The scale on ``runs``' floors (geometric mean of measured / floor over those not held
    out), their spread and the held-out runs' errors; None without runs."""
    fitted = [r for r in runs if not r.held_out]
    if not fitted:
        return None
    scale = math.exp(sum(math.log(r.measured / r.floor) for r in fitted) / len(fitted))
    errors = [r.measured / (scale * r.floor) - 1 for r in fitted]
    return Calibration(platform, scale, min(errors), max(errors),
                       tuple(r.name for r in fitted), tuple(sorted({r.chip for r in runs})),
                       {r.name: r.measured / (scale * r.floor) - 1
                        for r in runs if r.held_out})


CALIBRATIONS = {p: c for p, c in (("tpu", fit("tpu", TPU_RUNS)), ("gpu", fit("gpu", GPU_RUNS)))
                if c is not None}


@dataclasses.dataclass(frozen=True)
class Prediction:
    """A predicted step time with its range (the calibration's spread applied)."""

    seconds: float
    low_seconds: float
    high_seconds: float
    calibration: Calibration
    verified: bool          # the chip has calibration runs of its own

    def line(self, floor: float, tokens: int, chips: int, chip_name: str,
             steps: int = 0) -> str:
        """The report's prediction line (and, with ``steps``, the run's chip-hours)."""
        c = self.calibration
        held = (", held out " + ", ".join(f"{n} {e:+.0%}" for n, e in c.held_out.items())
                if c.held_out else "")
        text = (f"  predicted: {self.seconds * 1e3:.2f} ms ({self.low_seconds * 1e3:.2f}-"
                f"{self.high_seconds * 1e3:.2f}), {tokens / self.seconds:,.0f} tokens/s: the "
                f"floor {floor * 1e3:.2f} ms x {c.scale:.2f}, calibration runs {c.spread()} "
                f"({len(c.fit_runs)} runs on {'/'.join(c.chips)}{held})")
        if not self.verified:
            text += (f"; no calibration run on {chip_name}: the {'/'.join(c.chips)} scale, "
                     f"unverified there")
        if steps:
            hours = steps * chips / 3600
            text += (f"\n  the run's {steps:,} steps: {self.seconds * hours:,.0f} chip-hours "
                     f"({self.low_seconds * hours:,.0f}-{self.high_seconds * hours:,.0f}) on "
                     f"{chips} {chip_name}")
        return text


def predict(floor: float, chip) -> Optional[Prediction]:
    """The calibrated step time of a program whose roofline floor is ``floor`` seconds on
    ``chip`` (a :class:`~dagmoe_jax.compile.chips.Chip`); None where the platform has no
    calibration."""
    c = CALIBRATIONS.get(chip.platform)
    if c is None or floor <= 0:
        return None
    seconds = c.scale * floor
    return Prediction(seconds, seconds * (1 + c.low), seconds * (1 + c.high), c,
                      chip.name in c.chips)


def terms(hlo_text: str, chip, chips: int, gmm_occupancy: float = 1.0) -> dict:
    """A compiled program's roofline terms, as :class:`CalibrationRun` holds them."""
    cost = program_cost(hlo_text, chip, chips, gmm_occupancy=gmm_occupancy)
    return dict(compute=cost.compute_seconds, matmul_bound=cost.matmul_bound_seconds,
                collectives=cost.collective_seconds, offload=cost.offload_seconds,
                exchange=cost.exchange_seconds, floor=cost.overlapped_seconds,
                matmul_flops=cost.matmul_flops, hbm_bytes=cost.hbm_bytes,
                offload_bytes=cost.offload_bytes)


def describe_fit(runs: Sequence[CalibrationRun]) -> str:
    """The calibration table: per run its terms, measured / floor and measured / predicted,
    then how the spread of measured / X across runs changes with what X counts."""
    c = fit("", runs)
    lines = [f"{'run':<26}{'measured':>9}{'compute':>9}{'matmul':>8}{'coll.':>8}{'offload':>8}"
             f"{'sum':>8}{'floor':>8}{'m/sum':>7}{'m/floor':>8}{'m/pred':>7}"]
    for r in runs:
        lines.append(f"{r.name + (' *' if r.held_out else ''):<26}{r.measured:>9.3f}"
                     f"{r.compute:>9.3f}{r.matmul_bound:>8.3f}{r.collectives:>8.3f}"
                     f"{r.offload:>8.3f}{r.summed:>8.3f}{r.floor:>8.3f}"
                     f"{r.measured / r.summed:>7.2f}{r.measured / r.floor:>8.2f}"
                     f"{r.measured / (c.scale * r.floor):>7.2f}")
    for label, of in (("the sum", lambda r: r.summed), ("the floor", lambda r: r.floor),
                      ("matmul-bound only", lambda r: r.matmul_bound),
                      ("compute only", lambda r: r.compute)):
        ratios = [r.measured / of(r) for r in runs if of(r) > 0]
        if ratios:
            lines.append(f"measured / {label}: {min(ratios):.2f}-{max(ratios):.2f} "
                         f"(max/min {max(ratios) / min(ratios):.2f})")
    lines.append(f"scale {c.scale:.3f} on {len(c.fit_runs)} runs, spread {c.spread()}; held "
                 f"out (*): " + (", ".join(f"{n} {e:+.1%}" for n, e in c.held_out.items())
                                 or "none"))
    return "\n".join(lines)
