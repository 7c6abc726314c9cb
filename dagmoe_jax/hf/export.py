"""The library's models written as Hugging Face folders: a dense model as a Llama, an MoE as
Mixtral, OLMoE or Qwen3-MoE, an MoE with latent attention as DeepSeek-V2 or V3, the inverse
of :mod:`~dagmoe_jax.hf.llama`'s import.

:func:`export_hf` writes ``config.json`` and ``model.safetensors`` (or shards with their
index) that ``transformers`` loads to the same logits, and that the library imports back to
the same model. Which family an MoE becomes is decided by what its attention computes
(:func:`~dagmoe_jax.hf.moe.export_family`: no q/k norms Mixtral, whole-projection norms OLMoE,
per-head norms Qwen3-MoE; MLA a DeepSeek, V3 for a sigmoid router and V2 for a softmax one,
:func:`~dagmoe_jax.hf.deepseek.export_type`); what none of them computes (the DAG module, a
dropping dispatch, shared experts or a selection bias outside DeepSeek) is a one-line
``ValueError`` naming the field, as are the other block families.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Optional, Tuple, Union

import ml_dtypes
import numpy as np
from flax import nnx

from dagmoe_jax.config import ModelConfig
from dagmoe_jax.hf import deepseek
from dagmoe_jax.hf import tokenizer as hf_tokenizer
from dagmoe_jax.hf.llama import CONFIG_FILE, INDEX_FILE, SINGLE_FILE, backbone_keys, layer_names

GENERATION_CONFIG_FILE = "generation_config.json"
from dagmoe_jax.hf.moe import export_family, moe_block_tensors, moe_hf_config
from dagmoe_jax.hf.rope import rope_to_hf
from dagmoe_jax.hf.run import open_run
from dagmoe_jax.model.params import variable
from dagmoe_jax.run.paths import staged_directory

EXPORT_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16}


def hf_family(cfg: ModelConfig) -> str:
    """The Hugging Face ``model_type`` a model of ``cfg`` is exported as: 'llama' for a dense
    model, an MoE's family (:func:`~dagmoe_jax.hf.moe.export_family`); else a one-line
    ValueError."""
    if cfg.mla.enabled:
        if cfg.block.hf_family != "moe":
            raise ValueError(f"ModelConfig.mla with block={cfg.block.kind!r} cannot be "
                             f"exported: Hugging Face's MLA models are DeepSeek-V2 and V3, "
                             f"MoE models (block='moe')")
        return deepseek.export_type(cfg)
    if cfg.mtp.depth:
        raise ValueError(f"MTPConfig.depth={cfg.mtp.depth} cannot be exported without MLA: "
                         f"the Hugging Face family with multi-token prediction is "
                         f"DeepSeek-V3, whose attention is latent (ModelConfig.mla)")
    if cfg.block.hf_family == "llama":
        if cfg.qk_norm != "none":
            raise ValueError(f"ModelConfig.qk_norm={cfg.qk_norm!r} cannot be exported as a "
                             f"Hugging Face Llama, which normalises neither queries nor keys")
        return "llama"
    if cfg.block.hf_family is None:
        raise ValueError(f"ModelConfig.block={cfg.block.kind!r} has no Hugging Face family: a "
                         f"dense model exports as a Llama, an MoE (block='moe') as Mixtral, "
                         f"OLMoE or Qwen3-MoE")
    return export_family(cfg)


def hf_config_from_model(cfg: ModelConfig, *, tie_word_embeddings: bool,
                         dtype: str = "float32", bos_token_id: Optional[int] = None,
                         eos_token_id: Optional[int] = None,
                         pad_token_id: Optional[int] = None) -> dict:
    """The Hugging Face ``config.json`` of ``cfg`` in its family (:func:`hf_family`), with
    the tokenizer's BOS, EOS and padding ids (written null when not given, so that
    transformers does not take its class's defaults, ids of another vocabulary, for them)."""
    family = hf_family(cfg)
    hf = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.resolved_head_dim, "hidden_act": "silu",
        "max_position_embeddings": cfg.max_seq_len, "rms_norm_eps": cfg.norm_eps,
        "attention_bias": False, "tie_word_embeddings": tie_word_embeddings,
        "torch_dtype": dtype, "bos_token_id": bos_token_id, "eos_token_id": eos_token_id,
        "pad_token_id": pad_token_id, **rope_to_hf(cfg),
    }
    if family == "llama":
        hf.update(intermediate_size=cfg.resolved_ffn_hidden, mlp_bias=False)
    elif family in deepseek.TYPES:
        hf.update(deepseek.deepseek_hf_config(cfg, family))
    else:
        hf.update(moe_hf_config(cfg, family))
    return hf


def params_to_hf_tensors(model: nnx.Module, tied: bool) -> Iterator[Tuple[str, np.ndarray]]:
    """(Hugging Face tensor name, float32 array) of a Transformer in its family, the inverse
    of :func:`~dagmoe_jax.hf.llama.hf_tensors_to_params`."""
    cfg = model.cfg
    family = hf_family(cfg)
    d = cfg.d_model
    arr = lambda path: np.asarray(variable(model, path)[...], dtype=np.float32)  # noqa: E731
    yield "model.embed_tokens.weight", arr(("embed",))
    if not tied:
        yield "lm_head.weight", arr(("lm_head",)).T
    yield "model.norm.weight", arr(("final_norm", "scale"))
    if family in deepseek.TYPES:
        yield from deepseek.deepseek_tensors(cfg, arr)
        return
    paths = {"attn_norm": ("attn_norm", "scale"), "q": ("attn", "w_q"), "k": ("attn", "w_k"),
             "v": ("attn", "w_v"), "o": ("attn", "w_o"), "block_norm": ("block_norm", "scale"),
             "gate": ("block", "w_gate"), "up": ("block", "w_up"), "down": ("block", "w_down"),
             "q_norm": ("attn", "q_norm"), "k_norm": ("attn", "k_norm")}
    keys = backbone_keys(cfg)
    stacked = {key: arr(("layers",) + paths[key]) for key in keys}
    to_hf = {"attn_norm": lambda w: w, "block_norm": lambda w: w,
             "q": lambda w: w.reshape(d, -1).T, "k": lambda w: w.reshape(d, -1).T,
             "v": lambda w: w.reshape(d, -1).T, "o": lambda w: w.reshape(-1, d).T,
             "gate": lambda w: w.T, "up": lambda w: w.T, "down": lambda w: w.T,
             # [head_dim] shared by the heads ('head'), or [heads, head_dim] flattened ('full')
             "q_norm": lambda w: w.reshape(-1), "k_norm": lambda w: w.reshape(-1)}
    for i in range(cfg.num_layers):
        for key in keys:
            yield layer_names(i)[key], np.ascontiguousarray(to_hf[key](stacked[key][i]))
    if family != "llama":
        yield from moe_block_tensors(cfg, family, arr)


def _save(tensors: Dict[str, np.ndarray], path: Path, meta: dict) -> None:
    """safetensors' ``save_file`` with the mode of any other new file (0666 less the umask):
    safetensors creates its files 0600."""
    from safetensors.numpy import save_file  # pylint: disable=import-outside-toplevel

    save_file(tensors, str(path), metadata=meta)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)


def export_hf(model: nnx.Module, path: Union[str, Path], *, dtype: str = "float32",
              max_shard_bytes: Optional[int] = None, bos_token_id: Optional[int] = None,
              eos_token_id: Optional[int] = None, pad_token_id: Optional[int] = None) -> Path:
    """Write a dense or MoE Transformer as a Hugging Face folder of its family
    (:func:`hf_family`): ``config.json`` (with the tokenizer's BOS, EOS and padding ids, when
    given), ``generation_config.json`` (those ids, as transformers' ``save_pretrained`` writes
    it from the model's config) and ``model.safetensors``, or shards of at most
    ``max_shard_bytes`` with ``model.safetensors.index.json``, in ``dtype`` ('float32' or
    'bfloat16'). The LM head is tied to the embedding when the two are equal. Returns the
    directory."""
    if dtype not in EXPORT_DTYPES:
        raise ValueError(f"export dtype={dtype!r} is invalid: expected one of "
                         f"{sorted(EXPORT_DTYPES)}")
    cfg = model.cfg
    embed = np.asarray(model.embed[...])
    tied = bool(np.array_equal(embed.T, np.asarray(model.lm_head[...])))
    hf = hf_config_from_model(cfg, tie_word_embeddings=tied, dtype=dtype,
                              bos_token_id=bos_token_id, eos_token_id=eos_token_id,
                              pad_token_id=pad_token_id)
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    shards: List[Dict[str, np.ndarray]] = [{}]
    size = 0
    for name, value in params_to_hf_tensors(model, tied):
        value = np.ascontiguousarray(value, dtype=EXPORT_DTYPES[dtype])
        if max_shard_bytes is not None and shards[-1] and size + value.nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = value
        size += value.nbytes
    meta = {"format": "pt"}
    if len(shards) == 1:
        _save(shards[0], out / SINGLE_FILE, meta)
    else:
        weight_map, total = {}, 0
        for i, shard in enumerate(shards):
            file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            _save(shard, out / file, meta)
            weight_map.update({name: file for name in shard})
            total += sum(v.nbytes for v in shard.values())
        (out / INDEX_FILE).write_text(json.dumps(
            {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n")
    (out / CONFIG_FILE).write_text(json.dumps(hf, indent=2) + "\n")
    # GenerationConfig.from_model_config: the ids that are set (its defaults are None)
    generation = {"_from_model_config": True, **{
        key: hf[key] for key in ("bos_token_id", "eos_token_id", "pad_token_id")
        if hf[key] is not None}}
    (out / GENERATION_CONFIG_FILE).write_text(json.dumps(generation, indent=2) + "\n")
    return out


def declared_pad_id(tokenizer) -> Optional[int]:
    """The padding id a Hugging Face tokenizer declares (its ``pad_token``, or a padding
    token of its vocabulary), None where it falls back to EOS or is no such tokenizer."""
    pad = getattr(tokenizer, "declared_pad_id", None)
    return None if pad is None else int(pad)


def export_run(run_dir: str, out: str, *, dtype: str = "float32", max_shard_mb: int = 0,
               log: Callable[[str], None] = lambda _message: None) -> Path:
    """Export ``run_dir``'s newest checkpoint and its tokenizer into the folder ``out``
    (``dagmoe-export``, :mod:`dagmoe_jax.cli.export`): :func:`export_hf` with the tokenizer's
    BOS and EOS ids, then the tokenizer (:mod:`~dagmoe_jax.hf.tokenizer`), written beside
    ``out`` and moved there when complete (``out`` absent or an empty directory); returns
    ``out``; ``log`` hears the line that says what was written. One-line ``ValueError`` for a
    model no family computes."""
    loaded = open_run(run_dir)
    try:
        family = hf_family(loaded.model_cfg)
    except ValueError as err:
        raise ValueError(f"{run_dir} cannot be exported: {err}") from None
    target = Path(out)
    with staged_directory(target) as partial:
        tokenizer = loaded.tokenizer        # its BOS and EOS ids go into config.json
        export_hf(loaded.model, partial, dtype=dtype,
                  max_shard_bytes=max_shard_mb * 2 ** 20 or None,
                  bos_token_id=tokenizer.bos_id, eos_token_id=tokenizer.eos_id,
                  pad_token_id=declared_pad_id(tokenizer))
        files = hf_tokenizer.export_tokenizer(loaded.data_cfg, partial)
    log(f"exported step {loaded.step} of {run_dir} to {target} ({family}, {dtype} weights, "
        f"tokenizer: {', '.join(files)})")
    return target
