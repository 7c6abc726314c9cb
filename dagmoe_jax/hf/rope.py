"""RoPE in a Hugging Face ``config.json``: read into the library's ``rope_theta`` and
``RopeScalingConfig`` (:func:`rope_from_hf`), written back (:func:`rope_to_hf`), for every
architecture :mod:`dagmoe_jax.hf.llama` imports."""

from __future__ import annotations

import json
from typing import Tuple

from dagmoe_jax.config import ModelConfig, RopeScalingConfig


def _unsupported(field: str, value, why: str) -> ValueError:
    return ValueError(f"Hugging Face config {field}={json.dumps(value)} is not supported: {why}")


# The keys each supported rope_type may carry (Hugging Face's ``rope_parameters`` /
# ``rope_scaling``); any other key, or another rope_type, is refused by name.
ROPE_KEYS = {
    "default": (),
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor",
               "original_max_position_embeddings"),
    "yarn": ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale",
             "mscale_all_dim", "attention_factor", "truncate"),
}
# YaRN's optional keys: our RopeScalingConfig field, and the value that means "not set".
YARN_OPTIONAL = {"beta_fast": ("beta_fast", 32.0), "beta_slow": ("beta_slow", 1.0),
                 "mscale": ("mscale", 0.0), "mscale_all_dim": ("mscale_all_dim", 0.0),
                 "attention_factor": ("attention_factor", 0.0), "truncate": ("truncate", True)}
_ROPE_COMMON = ("rope_type", "type", "rope_theta")


def rope_from_hf(hf: dict) -> Tuple[float, RopeScalingConfig]:
    """(rope_theta, ``RopeScalingConfig``) of a Hugging Face config, in every layout
    ``transformers`` has written: ``rope_parameters`` (transformers 5: ``rope_type`` and
    ``rope_theta`` inside it) or ``rope_scaling`` beside a top-level ``rope_theta`` (4.x), the
    type as ``rope_type`` or ``type``. Supported: 'default', 'linear', 'llama3', 'yarn'; any
    other type ('dynamic', 'longrope', ...), an unknown key, or the two layouts disagreeing is
    a one-line error naming the field, never a silent default. YaRN's
    ``original_max_position_embeddings`` is read as transformers reads it: a top-level field of
    that name first, then the entry's, then ``max_position_embeddings``; its ``factor``, where
    null, is ``max_position_embeddings`` over it."""
    params, legacy = hf.get("rope_parameters"), hf.get("rope_scaling")
    field, entry = (("rope_parameters", params) if params is not None
                    else ("rope_scaling", legacy))
    entry = dict(entry or {})
    if params is not None and legacy is not None:
        for key, value in legacy.items():
            if key in entry and entry[key] != value and key != "type":
                raise ValueError(f"Hugging Face config rope_scaling.{key}={json.dumps(value)} "
                                 f"disagrees with rope_parameters.{key}="
                                 f"{json.dumps(entry[key])}: fix config.json")
    theta = entry.get("rope_theta", hf.get("rope_theta", 10000.0))
    if "rope_theta" in entry and "rope_theta" in hf and float(hf["rope_theta"]) != float(theta):
        raise ValueError(f"Hugging Face config rope_theta={hf['rope_theta']} disagrees with "
                         f"{field}.rope_theta={theta}: fix config.json")
    kind = entry.get("rope_type", entry.get("type", "default"))
    if kind not in ROPE_KEYS:
        raise _unsupported(f"{field}.rope_type", kind,
                           f"supported RoPE types are {', '.join(ROPE_KEYS)}")
    for key in entry:
        if key not in ROPE_KEYS[kind] + _ROPE_COMMON:
            raise _unsupported(f"{field}.{key}", entry[key],
                               f"rope_type {kind!r} takes no such key (the library would "
                               f"ignore it)")
    try:
        if kind == "linear":
            return float(theta), RopeScalingConfig(kind="linear", factor=float(entry["factor"]))
        if kind == "llama3":
            return float(theta), RopeScalingConfig(
                kind="llama3", factor=float(entry["factor"]),
                low_freq_factor=float(entry["low_freq_factor"]),
                high_freq_factor=float(entry["high_freq_factor"]),
                original_max_position=int(entry["original_max_position_embeddings"]))
        if kind == "yarn":
            return float(theta), _yarn(hf, entry)
    except KeyError as err:
        raise ValueError(f"Hugging Face config {field} lacks {err.args[0]!r}, which rope_type "
                         f"{kind!r} needs") from None
    return float(theta), RopeScalingConfig()


def _yarn(hf: dict, entry: dict) -> RopeScalingConfig:
    """The 'yarn' ``RopeScalingConfig`` of a config's RoPE entry (:func:`rope_from_hf`)."""
    original = hf.get("original_max_position_embeddings",
                      entry.get("original_max_position_embeddings",
                                hf.get("max_position_embeddings")))
    if original is None:
        raise KeyError("original_max_position_embeddings")
    factor = entry["factor"]
    if factor is None:
        factor = hf["max_position_embeddings"] / original
    fields = {ours: (default if entry.get(key) is None else entry[key])
              for key, (ours, default) in YARN_OPTIONAL.items()}
    if not isinstance(fields["truncate"], bool):
        raise _unsupported("rope_parameters.truncate", fields["truncate"], "expected true or false")
    return RopeScalingConfig(kind="yarn", factor=float(factor),
                             original_max_position=int(original),
                             **{k: v if k == "truncate" else float(v) for k, v in fields.items()})


def rope_to_hf(cfg: ModelConfig) -> dict:
    """The RoPE fields of an exported ``config.json``: ``rope_parameters`` (read by
    transformers 5) and the same scaling as ``rope_scaling`` beside ``rope_theta`` (read by
    transformers 4.x, which ignores ``rope_parameters``), so either version loads it."""
    rs = cfg.rope_scaling
    scaling = {"none": None, "linear": {"rope_type": "linear", "factor": rs.factor},
               "llama3": {"rope_type": "llama3", "factor": rs.factor,
                          "low_freq_factor": rs.low_freq_factor,
                          "high_freq_factor": rs.high_freq_factor,
                          "original_max_position_embeddings": rs.original_max_position},
               "yarn": {"rope_type": "yarn", "factor": rs.factor,
                        "original_max_position_embeddings": rs.original_max_position,
                        **{key: getattr(rs, ours) for key, (ours, unset)
                           in YARN_OPTIONAL.items() if getattr(rs, ours) != unset}}}[rs.kind]
    params = {"rope_type": "default", **(scaling or {}), "rope_theta": cfg.rope_theta}
    return {"rope_theta": cfg.rope_theta, "rope_scaling": scaling, "rope_parameters": params}
