"""Hugging Face Llama checkpoints in and out of the library's dense Transformer, without torch.

A Hugging Face Llama directory holds ``config.json`` and either ``model.safetensors`` or shards
listed by ``model.safetensors.index.json``. :func:`load_hf_llama` reads the tensors lazily with
the ``safetensors`` NumPy API (one tensor in host memory at a time; bfloat16 through
``ml_dtypes``) into a ``block='dense'`` :class:`~dagmoe_jax.model.Transformer`;
:mod:`~dagmoe_jax.hf.export` writes one back. The mapping (docs/design.md section 7):

* ``nn.Linear`` weights are stored [out, in] and the library's matrices [in, out]: every
  projection is transposed; q/k/v go to [d, heads, head_dim] (rows of ``q_proj`` are
  head-major) and ``o_proj`` to [heads, head_dim, d].
* RoPE: Hugging Face's ``rotate_half`` is the half-split layout of
  :func:`~dagmoe_jax.model.attention.apply_rope`, so no permutation is needed.
* ``tie_word_embeddings``: the LM head is ``embed_tokens`` transposed; export ties them again
  when the two are equal.
* ``rms_norm_eps``, ``head_dim``, ``intermediate_size`` and RoPE carry over to
  ``ModelConfig``: ``rope_theta`` and the scaling ('default', 'linear', or Llama 3.1/3.2's
  'llama3') in either layout transformers has written (:func:`rope_from_hf`: transformers 5's
  ``rope_parameters``, 4.x's ``rope_scaling``); export writes both.

What the library's Llama cannot express (attention or MLP biases, a sliding window, another
architecture, another activation or RoPE scaling, quantised weights) is a one-line
``ValueError`` naming the field.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Optional, Tuple, Union

import ml_dtypes  # noqa: F401  (registers bfloat16 with NumPy before safetensors reads one)
import numpy as np
from flax import nnx

from dagmoe_jax.config import ExecutionConfig, ModelConfig, default_ffn_hidden
from dagmoe_jax.families.dense.config import DenseConfig
from dagmoe_jax.data.tokenizers import folder_config, token_text
from dagmoe_jax.hf import deepseek
from dagmoe_jax.hf.moe import FAMILIES as MOE_FAMILIES
from dagmoe_jax.hf.moe import layer_tensor_names, moe_block_config, moe_block_params
from dagmoe_jax.hf.rope import rope_from_hf
from dagmoe_jax.families.moe.conversion import converted_config, converted_params
from dagmoe_jax.model.params import set_params
from dagmoe_jax.model import Transformer
from dagmoe_jax.model.settle import settle
from dagmoe_jax.validate import first_line

PathLike = Union[str, Path]
CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

# Tensors a Llama checkpoint may carry that hold no parameter (older exports store RoPE's
# inverse frequencies, which config.json determines).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def read_hf_config(path: PathLike) -> dict:
    """``config.json`` of a Hugging Face model directory, or a one-line error. A DeepSeek-V3's
    ``num_nextn_predict_layers`` reads as the multi-token prediction modules its checkpoint
    holds (:func:`dagmoe_jax.hf.deepseek.mtp_layers_held`: transformers saves none)."""
    file = Path(path) / CONFIG_FILE
    if not file.is_file():
        raise ValueError(f"{file} does not exist: pass a Hugging Face model directory "
                         f"(config.json + model.safetensors)")
    try:
        hf = json.loads(file.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{file} is not valid JSON ({err.msg}, line {err.lineno})") from None
    except UnicodeDecodeError as err:
        raise ValueError(f"{file} is not UTF-8 text ({err.reason} at byte {err.start}): is it "
                         f"a config.json?") from None
    if isinstance(hf, dict) and hf.get("model_type") == "deepseek_v3" and hf.get(
            "num_nextn_predict_layers"):
        names = SafetensorsReader(path, family_name("deepseek_v3")).keys()
        hf["num_nextn_predict_layers"] = deepseek.mtp_layers_held(set(names), hf)
    return hf


def tokenizer_settings(path: PathLike) -> Dict[str, str]:
    """What a Hugging Face model directory's ``tokenizer_config.json`` says about its special
    tokens: ``{'eos_token': ..., 'bos_token': ...}`` for those it names (a string, or a dict
    with ``content``, as transformers writes added tokens); empty without the file."""
    blob = folder_config(str(path), "tokenizer_config.json")
    texts = {key: token_text(blob.get(key)) for key in ("eos_token", "bos_token")}
    return {key: text for key, text in texts.items() if text}


def _unsupported(field: str, value, why: str) -> ValueError:
    return ValueError(f"Hugging Face config {field}={json.dumps(value)} is not supported: {why}")


# Every top-level config.json field the importer knows. READ: turned into the ModelConfig or
# checked to be what the library's Llama computes (a bias, another activation, a sliding
# window, partial RoPE, quantisation are refused by name). NO_EFFECT: fields that do not
# change the forward pass of an imported model (bookkeeping, token ids, the storage dtype,
# training-only dropout, Llama's pretraining_tp, which slices the same matmuls). Any other
# field is refused by name: a field a newer transformers adds must be read here, or listed
# as harmless, before it can be ignored (tests/test_hf_llama.py lists LlamaConfig's).
READ_FIELDS = frozenset({
    "model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings",
    "rms_norm_eps", "rope_theta", "rope_scaling", "rope_parameters", "tie_word_embeddings",
    "hidden_act", "attention_bias", "mlp_bias", "sliding_window", "partial_rotary_factor",
    "quantization_config"})
NO_EFFECT_FIELDS = frozenset({
    "_name_or_path", "architectures", "transformers_version", "dtype", "torch_dtype",
    "bos_token_id", "eos_token_id", "pad_token_id", "attention_dropout", "initializer_range",
    "pretraining_tp", "use_cache", "output_attentions", "output_hidden_states", "return_dict",
    "is_encoder_decoder", "chunk_size_feed_forward", "id2label", "label2id", "problem_type"})


def model_config_from_hf(hf: dict, **overrides) -> ModelConfig:
    """The ``ModelConfig`` of a Hugging Face ``config.json``: a Llama as a dense model, a
    Mixtral, OLMoE or Qwen3-MoE as an MoE (:mod:`dagmoe_jax.hf.moe`) (``overrides``: other
    ModelConfig fields, e.g. ``param_dtype``). Unsupported fields are one-line errors."""
    model_type = hf.get("model_type")
    family = MOE_FAMILIES.get(model_type)
    is_deepseek = model_type in deepseek.TYPES
    if model_type != "llama" and family is None and not is_deepseek:
        raise _unsupported("model_type", model_type, "the importable architectures are "
                           f"{', '.join(['llama', *MOE_FAMILIES, *deepseek.TYPES])}")
    known = READ_FIELDS | NO_EFFECT_FIELDS | (family.fields if family else frozenset())
    known |= deepseek.FIELDS if is_deepseek else frozenset()
    unknown = sorted(set(hf) - known)
    if unknown:
        raise ValueError(f"Hugging Face config field {unknown[0]}={json.dumps(hf[unknown[0]])} "
                         f"is unknown to the importer: it may change the model, so it is not "
                         f"ignored (remove it from config.json if it does not)")
    if hf.get("hidden_act", "silu") != "silu":
        raise _unsupported("hidden_act", hf["hidden_act"], "Llama's MLP is SwiGLU ('silu')")
    for field in ("attention_bias", "mlp_bias"):
        if hf.get(field):
            raise _unsupported(field, hf[field], "the library's Llama has no linear biases")
    # Qwen3-MoE writes a window it does not use unless use_sliding_window (refused there)
    if hf.get("sliding_window") is not None and not (family and "use_sliding_window" in hf):
        raise _unsupported("sliding_window", hf["sliding_window"],
                           "the library's attention is full causal")
    if float(hf.get("partial_rotary_factor", 1.0)) != 1.0:
        raise _unsupported("partial_rotary_factor", hf["partial_rotary_factor"],
                           "the library's RoPE rotates every head dimension")
    if hf.get("quantization_config") is not None:
        raise _unsupported("quantization_config", hf["quantization_config"].get("quant_method"),
                           "import an unquantised (float32/bfloat16/float16) checkpoint")
    for field in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                  *(() if family else ("intermediate_size",))):
        if not isinstance(hf.get(field), int):
            raise ValueError(f"Hugging Face config {field} is missing or not an integer: is "
                             f"this a Llama config.json?")
    heads, d = hf["num_attention_heads"], hf["hidden_size"]
    head_dim = hf.get("head_dim") or d // heads
    rope_theta, rope_scaling = rope_from_hf(hf)
    if is_deepseek:
        block, extra = None, deepseek.deepseek_fields(hf)
    elif family is None:
        ffn = hf["intermediate_size"]
        block, extra = DenseConfig(ffn_hidden=None if ffn == default_ffn_hidden(d) else ffn), {}
    else:
        block, extra = moe_block_config(hf, family)
    fields = dict(    # a width that is the default is written as the default (None)
        vocab_size=hf["vocab_size"], d_model=d,
        num_layers=hf["num_hidden_layers"], num_heads=heads,
        num_kv_heads=hf.get("num_key_value_heads") or heads,
        head_dim=None if head_dim * heads == d else head_dim, block=block,
        max_seq_len=int(hf.get("max_position_embeddings", 2048)),
        rope_theta=rope_theta, norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        rope_scaling=rope_scaling)
    fields.update(extra)
    fields.update(overrides)
    return ModelConfig(**fields)


FAMILY_NAMES = {"llama": "Llama", "mixtral": "Mixtral", "olmoe": "OLMoE",
                "qwen3_moe": "Qwen3-MoE", "deepseek_v2": "DeepSeek-V2",
                "deepseek_v3": "DeepSeek-V3"}
"""How messages name the family a folder's ``model_type`` declares."""


def family_name(model_type: Optional[str]) -> str:
    """The family ``model_type`` names, as messages write it (e.g. 'Mixtral')."""
    return FAMILY_NAMES.get(model_type or "", str(model_type))


def _safe_open(file: Path):
    """``safetensors.safe_open`` of ``file`` (numpy), a damaged file (truncated, empty, not
    safetensors) a one-line ValueError naming it."""
    from safetensors import SafetensorError, safe_open  # pylint: disable=import-outside-toplevel
    try:
        return safe_open(str(file), framework="numpy")
    except (SafetensorError, OSError) as err:
        raise ValueError(f"{file} is not a readable safetensors file ({first_line(err)}): it "
                         f"is truncated or damaged; copy or download it again") from None


class SafetensorsReader:
    """Lazy access to the tensors of a Hugging Face model directory (single file or shards).

    ``reader[name]`` opens the shard holding ``name`` and reads that tensor only; a shard named
    by the index but absent from the directory, or one whose header is damaged (a truncated
    download), is a one-line error when the reader is made. ``family``: how a missing tensor's
    message names the model (:func:`family_name`).
    """

    def __init__(self, path: PathLike, family: str = "Llama"):
        self.family = family
        path = Path(path)
        index, single = path / INDEX_FILE, path / SINGLE_FILE
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except json.JSONDecodeError as err:
                raise ValueError(f"{index} is not valid JSON ({err.msg}, line {err.lineno}): "
                                 f"download it again") from None
            except UnicodeDecodeError as err:
                raise ValueError(f"{index} is not UTF-8 text ({err.reason} at byte "
                                 f"{err.start}): download it again") from None
            except (KeyError, TypeError):
                raise ValueError(f"{index} has no 'weight_map': is it a safetensors "
                                 f"index?") from None
            self.files = {name: path / shard for name, shard in weight_map.items()}
            missing = sorted({str(f.name) for f in self.files.values() if not f.is_file()})
            if missing:
                raise ValueError(f"shard {missing[0]} listed in {index} is missing from {path}"
                                 f"{f' (and {len(missing) - 1} more)' if len(missing) > 1 else ''}"
                                 f": download every shard")
            for shard in sorted(set(self.files.values())):
                with _safe_open(shard):       # the header checks the file covers its tensors
                    pass
        elif single.is_file():
            with _safe_open(single) as f:
                self.files = {name: single for name in f.keys()}
        else:
            raise ValueError(f"{path} has neither {SINGLE_FILE} nor {INDEX_FILE}: only "
                             f"safetensors checkpoints can be imported")

    def keys(self) -> List[str]:
        return list(self.files)

    def __contains__(self, name: str) -> bool:
        return name in self.files

    def __getitem__(self, name: str) -> np.ndarray:
        if name not in self.files:
            raise ValueError(f"tensor {name} is missing from the checkpoint: is it a "
                             f"{self.family} checkpoint of this config.json?")
        with _safe_open(self.files[name]) as f:
            return f.get_tensor(name)


def layer_names(i: int) -> Dict[str, str]:
    """The Hugging Face names of layer ``i``'s tensors outside an MoE block (a Llama's, with
    the q/k norms of OLMoE and Qwen3-MoE)."""
    p = f"model.layers.{i}."
    return {"attn_norm": p + "input_layernorm.weight", "q": p + "self_attn.q_proj.weight",
            "k": p + "self_attn.k_proj.weight", "v": p + "self_attn.v_proj.weight",
            "o": p + "self_attn.o_proj.weight", "block_norm": p + "post_attention_layernorm.weight",
            "gate": p + "mlp.gate_proj.weight", "up": p + "mlp.up_proj.weight",
            "down": p + "mlp.down_proj.weight", "q_norm": p + "self_attn.q_norm.weight",
            "k_norm": p + "self_attn.k_norm.weight"}


def backbone_keys(cfg: ModelConfig) -> Tuple[str, ...]:
    """The :func:`layer_names` keys a model of ``cfg`` reads besides its block's own."""
    keys = ("attn_norm", "q", "k", "v", "o", "block_norm")
    keys += ("gate", "up", "down") if cfg.block.hf_family == "llama" else ()
    return keys + (("q_norm", "k_norm") if cfg.qk_norm != "none" else ())


def _check_names(reader: SafetensorsReader, cfg: ModelConfig, tied: bool,
                 model_type: str = "llama") -> None:
    """Refuse checkpoints with tensors this mapping would silently drop (biases, extra heads)."""
    known = {"model.embed_tokens.weight", "model.norm.weight"}
    if not tied:
        known.add("lm_head.weight")
    if model_type in deepseek.TYPES:
        known |= deepseek.tensor_names(cfg)
    for i in range(cfg.num_layers if model_type not in deepseek.TYPES else 0):
        known.update(layer_names(i)[k] for k in backbone_keys(cfg))
        if model_type in MOE_FAMILIES:
            known.update(layer_tensor_names(MOE_FAMILIES[model_type],
                                            cfg.block.experts.num_experts, i).values())
    extra = sorted(n for n in reader.keys()
                   if n not in known and not n.endswith(_IGNORED_SUFFIXES))
    if extra:
        raise ValueError(f"checkpoint tensor {extra[0]} has no place in a "
                         f"{family_name(model_type)} of this config.json{f' (and {len(extra) - 1} more)' if len(extra) > 1 else ''}"
                         f": biases and other architectures are not supported")


def _expect(name: str, array: np.ndarray, shape: Tuple[int, ...]) -> np.ndarray:
    if tuple(array.shape) != tuple(shape):
        raise ValueError(f"checkpoint tensor {name} has shape {tuple(array.shape)}, but "
                         f"config.json implies {tuple(shape)}")
    return array


def hf_tensors_to_params(cfg: ModelConfig, get: Callable[[str], np.ndarray], tied: bool,
                         model_type: str = "llama", rope_pairs: bool = True
                         ) -> Iterator[Tuple[Tuple[str, ...], np.ndarray]]:
    """(library parameter path, float32 array) of a Llama checkpoint (or of one of the MoE
    families of :mod:`dagmoe_jax.hf.moe`, or a DeepSeek of :mod:`dagmoe_jax.hf.deepseek`, by
    ``model_type``), one parameter at a time (layer parameters stacked [layers, ...]);
    ``get(name)`` reads one Hugging Face tensor; ``rope_pairs``: a DeepSeek's RoPE columns are
    stored interleaved (:func:`dagmoe_jax.hf.deepseek.interleaved`)."""
    d, h, kv, hd = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.resolved_head_dim
    f, v = cfg.resolved_ffn_hidden, cfg.vocab_size

    def read(name, shape):
        return _expect(name, get(name), shape).astype(np.float32, copy=False)

    # Each array is yielded as read, never kept in this generator's frame: the streaming merge
    # (upcycle/stream.py) pauses one generator per model, and a kept embedding would hold one
    # vocabulary-sized array per model at once. A tied head reads the embedding again.
    yield ("embed",), read("model.embed_tokens.weight", (v, d))
    yield ("lm_head",), read("model.embed_tokens.weight" if tied else "lm_head.weight", (v, d)).T
    yield ("final_norm", "scale"), read("model.norm.weight", (d,))
    if model_type in deepseek.TYPES:      # MLA, dense first layers, shared experts
        yield from deepseek.deepseek_params(cfg, read, rope_pairs)
        return
    per_layer = {
        ("attn_norm", "scale"): ("attn_norm", (d,), lambda w: w),
        ("attn", "w_q"): ("q", (h * hd, d), lambda w: w.T.reshape(d, h, hd)),
        ("attn", "w_k"): ("k", (kv * hd, d), lambda w: w.T.reshape(d, kv, hd)),
        ("attn", "w_v"): ("v", (kv * hd, d), lambda w: w.T.reshape(d, kv, hd)),
        ("attn", "w_o"): ("o", (d, h * hd), lambda w: w.T.reshape(h, hd, d)),
        ("block_norm", "scale"): ("block_norm", (d,), lambda w: w),
    }
    if cfg.block.hf_family == "llama":             # the dense block: Llama's MLP
        per_layer.update({("block", "w_gate"): ("gate", (f, d), lambda w: w.T),
                          ("block", "w_up"): ("up", (f, d), lambda w: w.T),
                          ("block", "w_down"): ("down", (d, f), lambda w: w.T)})
    if cfg.qk_norm != "none":       # [head_dim] shared by the heads, or [heads * head_dim]
        head = cfg.qk_norm == "head"
        per_layer[("attn", "q_norm")] = ("q_norm", (hd,) if head else (h * hd,),
                                         lambda w: w if head else w.reshape(h, hd))
        per_layer[("attn", "k_norm")] = ("k_norm", (hd,) if head else (kv * hd,),
                                         lambda w: w if head else w.reshape(kv, hd))
    for path, (key, shape, to_ours) in per_layer.items():
        yield ("layers",) + path, np.stack(
            [to_ours(read(layer_names(i)[key], shape)) for i in range(cfg.num_layers)])
    if model_type in MOE_FAMILIES:
        yield from moe_block_params(cfg, MOE_FAMILIES[model_type], read)


def load_hf_llama(path: PathLike, *, rngs: Optional[nnx.Rngs] = None,
                  execution: Optional[ExecutionConfig] = None, convert_to=None, **overrides):
    """A :class:`~dagmoe_jax.model.Transformer` holding a Hugging Face checkpoint: a Llama as
    a dense model, an MoE family as the MoE block (:mod:`dagmoe_jax.hf.moe`).

    ``overrides``: ModelConfig fields to change (``param_dtype='bfloat16'``, ``max_seq_len``...).
    ``execution``: how it runs (default every choice 'auto'), settled for this machine
    (:func:`dagmoe_jax.model.settle.settle`; ``model.execution``). ``convert_to``: a block
    config an MoE checkpoint is converted to at its outputs
    (:mod:`dagmoe_jax.families.moe.conversion`: a DAG-MoE ``MoEConfig`` or a ``CoEConfig``; the
    parameters the checkpoint does not hold initialised from ``rngs``). Returns (model,
    ModelConfig).
    """

    hf = read_hf_config(path)
    cfg = model_config_from_hf(hf, **overrides)
    reader = SafetensorsReader(path, family_name(hf["model_type"]))
    tied = bool(hf.get("tie_word_embeddings", False)) and "lm_head.weight" not in reader
    _check_names(reader, cfg, tied, hf["model_type"])
    params = hf_tensors_to_params(cfg, reader.__getitem__, tied, hf["model_type"],
                                  rope_pairs=hf["model_type"] not in deepseek.TYPES
                                  or deepseek.interleaved(hf))
    if convert_to is not None:
        source, cfg = cfg, converted_config(cfg, convert_to)
        params = converted_params(params, source, cfg)
    settled = settle(cfg, execution)
    make = lambda: Transformer(cfg, execution=settled, rngs=rngs or nnx.Rngs(0))  # noqa: E731
    # Built abstractly (shapes only, no initialisation), each parameter then placed as it is
    # read: importing needs about the model's size in memory, never a random model besides. A
    # conversion initialises the parameters the checkpoint does not hold.
    model = make() if convert_to is not None else nnx.eval_shape(make)
    set_params(model, params, source="the checkpoint")
    return model, cfg
