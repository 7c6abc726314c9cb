"""A run's tokenizer as a Hugging Face model directory holds it, so that an exported model
(:func:`dagmoe_jax.hf.export.export_hf`) is read back, scored or upcycled with the ids it
was trained on.

* ``'byte'`` (:class:`~dagmoe_jax.data.tokenizers.ByteTokenizer`): a ``tokenizer.json`` of the
  ``tokenizers`` library that gives exactly its ids: every utf-8 byte is one token whose id is
  the byte (a byte-level BPE without merges, the bytes spelled as GPT-2 spells them), and EOS is
  the token of byte 0, as in the byte tokenizer; ``tokenizer_config.json`` names it. One
  difference stays: a tool that registers the EOS as a special token (``transformers``) reads
  the text character U+0100, the spelling of byte 0, as EOS; the byte tokenizer never does.
* ``'hf'``: the run's ``tokenizer.json`` copied, with the ``tokenizer_config.json`` beside it
  (or one naming the run's ``DataConfig.eos_token``) and the ``generation_config.json`` beside
  it (an imported folder's own, which replaces the one written from the ids).
* ``'sentencepiece'``: the model file copied as ``tokenizer.model`` (the name Llama's
  SentencePiece tokenizer reads).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Dict, List

from dagmoe_jax.data import DataConfig

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
GENERATION_CONFIG_FILE = "generation_config.json"
SENTENCEPIECE_FILE = "tokenizer.model"


def byte_spelling() -> Dict[int, str]:
    """GPT-2's byte -> printable character map (``bytes_to_unicode`` of its ``encoder.py``):
    printable Latin-1 bytes spell themselves, the others the characters from U+0100 on, in
    byte order. The ``tokenizers`` library's ``ByteLevel`` pre-tokenizer maps bytes the same
    way."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    spelling, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            spelling[byte] = chr(byte)
        else:
            spelling[byte] = chr(256 + extra)
            extra += 1
    return spelling


def byte_level_tokenizer():
    """A ``tokenizers.Tokenizer`` whose ids 0-255 are the utf-8 bytes (module docstring):
    byte-level BPE without merges, no special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers  # noqa: PLC0415

    spelling = byte_spelling()
    tokenizer = Tokenizer(models.BPE(vocab={spelling[b]: b for b in range(256)}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def byte_tokenizer_json(path: Path) -> None:
    """Write the ``tokenizer.json`` of the byte tokenizer (module docstring) to ``path``."""
    byte_level_tokenizer().save(str(path))


def export_tokenizer(data_cfg: DataConfig, out: Path) -> List[str]:
    """Write the tokenizer of a run trained with ``data_cfg`` into the model directory ``out``
    (module docstring); returns the names of the files written."""
    out = Path(out)
    if data_cfg.tokenizer == "byte":
        byte_tokenizer_json(out / TOKENIZER_FILE)
        config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": byte_spelling()[0],
                  "model_max_length": int(1e30)}
    elif data_cfg.tokenizer == "hf":
        source = Path(data_cfg.tokenizer_path).expanduser()
        shutil.copyfile(source, out / TOKENIZER_FILE)
        generation = source.parent / GENERATION_CONFIG_FILE
        if generation.is_file():      # the folder's own (its EOS ids, sampling defaults)
            shutil.copyfile(generation, out / GENERATION_CONFIG_FILE)
        beside = source.parent / TOKENIZER_CONFIG_FILE
        if beside.is_file():
            shutil.copyfile(beside, out / TOKENIZER_CONFIG_FILE)
            return [TOKENIZER_FILE, TOKENIZER_CONFIG_FILE]
        config = {"tokenizer_class": "PreTrainedTokenizerFast"}
        if data_cfg.eos_token:
            config["eos_token"] = data_cfg.eos_token
    else:
        shutil.copyfile(Path(data_cfg.tokenizer_path).expanduser(), out / SENTENCEPIECE_FILE)
        return [SENTENCEPIECE_FILE]
    (out / TOKENIZER_CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    return [TOKENIZER_FILE, TOKENIZER_CONFIG_FILE]
