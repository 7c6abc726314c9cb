"""Tokenizers: utf-8 bytes, SentencePiece, or a HuggingFace ``tokenizers`` tokenizer.json.

All three share the small :class:`Tokenizer` interface the pipeline needs. Nothing is
downloaded: SentencePiece and HF tokenizers are read from local files. They pickle by path (the
file is read again on unpickling), so grain worker processes can use them. :class:`CheckTokens`
is the pipelines' last step: a batch with an id outside the model's vocabulary is a one-line
error where it is made.
"""

from __future__ import annotations

import abc
import hashlib
import json
import os
from typing import Optional, Sequence

import grain
import numpy as np

from dagmoe_jax.validate import first_line
from dagmoe_jax.data.config import DataConfig

HF_EOS_CANDIDATES = ("</s>", "<|endoftext|>", "<eos>")
HF_PAD_CANDIDATES = ("<pad>", "[PAD]", "<|pad|>")


class Tokenizer(abc.ABC):
    """Text <-> token ids. ``eos_id`` ends every record; ``pad_id`` fills padding (masked)."""

    @property
    @abc.abstractmethod
    def vocab_size(self) -> int:
        """Number of ids; every id is in [0, vocab_size)."""

    @property
    @abc.abstractmethod
    def eos_id(self) -> int:
        """End-of-sequence id appended to each record."""

    @property
    @abc.abstractmethod
    def pad_id(self) -> int:
        """Id written at padding positions (never a target: the mask is False there)."""

    @property
    def bos_id(self) -> Optional[int]:
        """The beginning-of-sequence id the tokenizer names, or None (the default: none)."""
        return None

    @property
    def special_ids(self) -> frozenset:
        """Ids that ``decode(..., skip_special_tokens=True)`` leaves out (default: EOS)."""
        return frozenset({self.eos_id})

    @abc.abstractmethod
    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Ids of ``text``. With ``add_special_tokens`` (default False, what training uses) the
        tokenizer's own post-processing adds what it adds (a Llama 3 tokenizer.json its BOS;
        ``transformers``' default); without it, nothing is added."""

    @abc.abstractmethod
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """Text of ``ids``; ``skip_special_tokens`` leaves out :attr:`special_ids`."""

    def piece_bytes(self) -> list[bytes]:
        """Each id's text as utf-8 bytes, decoded alone: DoE aligns tokens with words through
        these (:mod:`dagmoe_jax.families.doe.topics.assign`)."""
        return [self.decode([i]).encode("utf-8") for i in range(self.vocab_size)]


class ByteTokenizer(Tokenizer):
    """utf-8 bytes as ids: vocabulary 256, EOS = pad = 0 (NUL, which text never contains)."""

    vocab_size = 256
    eos_id = 0
    pad_id = 0

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        del add_special_tokens          # nothing to add: no BOS, and EOS ends records only
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """utf-8 decode with errors='replace'; ids outside [0, 256) (a model's vocabulary may be
        larger) also decode to U+FFFD. EOS decodes to '\x00' (left out with
        ``skip_special_tokens``)."""
        ids = [int(i) for i in ids if not (skip_special_tokens and int(i) == self.eos_id)]
        data = bytes(i if 0 <= i < 256 else 0xFF for i in ids)  # 0xFF: never utf-8
        return data.decode("utf-8", errors="replace")

    def piece_bytes(self) -> list[bytes]:
        return [bytes([i]) for i in range(256)]


def _require_file(path: str, field: str = "tokenizer_path") -> str:
    if not path or not os.path.isfile(os.path.expanduser(path)):
        raise FileNotFoundError(f"DataConfig.{field}={path!r} is not a file: point it at a "
                                "local tokenizer model")
    return os.path.expanduser(path)


class _FromFile(Tokenizer):
    """A tokenizer loaded from a file; pickles as its path and EOS token."""

    KIND = "tokenizer"

    def __init__(self, path: str, eos_token: str = ""):
        self._path = _require_file(path)
        self._eos_token = eos_token
        try:
            self._load()
        except ValueError:
            raise
        except Exception as err:  # noqa: BLE001 -- the libraries raise RuntimeError, Exception
            raise ValueError(f"DataConfig.tokenizer_path={path!r} is not a {self.KIND} "
                             f"({first_line(err)}): point it at one") from None

    @abc.abstractmethod
    def _load(self) -> None:
        """Read ``self._path`` and set the ids."""

    def __getstate__(self):
        return {"path": self._path, "eos_token": self._eos_token}

    def __setstate__(self, state):
        self.__init__(state["path"], state["eos_token"])

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def eos_id(self) -> int:
        return self._eos_id

    @property
    def pad_id(self) -> int:
        return self._pad_id


class SentencePieceTokenizer(_FromFile):
    """A SentencePiece model file. EOS: ``eos_token`` if given, else the model's EOS.

    Pad is the model's pad id, or EOS when the model has none. Note that SentencePiece's
    default normalisation may not round-trip every string (e.g. newlines, repeated spaces);
    train with ``normalization_rule_name='identity'`` and ``remove_extra_whitespaces=False``
    (and '\\n' as a user-defined symbol) for exact round trips.
    """

    KIND = "SentencePiece model"

    def _load(self) -> None:
        import sentencepiece  # pylint: disable=import-outside-toplevel

        self._sp = sentencepiece.SentencePieceProcessor(model_file=self._path)
        self._vocab_size = int(self._sp.get_piece_size())
        if self._eos_token:
            eos = int(self._sp.piece_to_id(self._eos_token))
            if eos == self._sp.unk_id() and self._eos_token != self._sp.id_to_piece(eos):
                raise ValueError(f"DataConfig.eos_token={self._eos_token!r} is not in the "
                                 f"SentencePiece model {self._path}")
        else:
            eos = int(self._sp.eos_id())
            if eos < 0:
                raise ValueError(f"the SentencePiece model {self._path} has no EOS piece: set "
                                 "DataConfig.eos_token to one of its pieces")
        self._eos_id = eos
        pad = int(self._sp.pad_id())
        self._pad_id = pad if pad >= 0 else eos
        self._special_ids = frozenset(i for i in range(self._vocab_size)
                                      if self._sp.is_control(i))

    @property
    def bos_id(self) -> Optional[int]:
        bos = int(self._sp.bos_id())
        return bos if bos >= 0 else None

    @property
    def special_ids(self) -> frozenset:
        return self._special_ids

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Ids of ``text``; ``add_special_tokens`` puts the model's BOS first (as
        ``transformers``' LlamaTokenizer does by default), where it has one."""
        ids = list(self._sp.encode(text, out_type=int))
        return [self.bos_id] + ids if add_special_tokens and self.bos_id is not None else ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """SentencePiece's decoding, which leaves control pieces (BOS, EOS) out either way."""
        del skip_special_tokens
        return self._sp.decode([int(i) for i in ids])

    def piece_bytes(self) -> list[bytes]:
        """Pieces with their word-boundary mark as a space (decoding one piece alone drops a
        leading space); byte-fallback pieces ``<0xNN>`` as that byte; control pieces empty."""
        out = []
        for i in range(self.vocab_size):
            piece = self._sp.id_to_piece(i)
            if self._sp.is_byte(i):
                out.append(bytes([int(piece[3:5], 16)]))
            elif self._sp.is_control(i) or self._sp.is_unknown(i):
                out.append(b"")
            else:
                out.append(piece.replace("\u2581", " ").encode("utf-8"))
        return out


def folder_config(folder: str, name: str) -> dict:
    """The JSON file ``name`` (``tokenizer_config.json``, ``generation_config.json``) of the
    Hugging Face folder ``folder``, or {} when there is none (a one-line error when it is not
    valid JSON)."""
    path = os.path.join(os.path.expanduser(str(folder)), name)
    if not os.path.isfile(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            blob = json.load(f)
    except json.JSONDecodeError as err:
        raise ValueError(f"{path} is not valid JSON ({err.msg}, line {err.lineno}): fix or "
                         "remove it") from None
    except UnicodeDecodeError as err:
        raise ValueError(f"{path} is not UTF-8 text ({err.reason} at byte {err.start}): fix "
                         "or remove it") from None
    return blob if isinstance(blob, dict) else {}


def token_text(value) -> str:
    """A ``tokenizer_config.json`` token entry (a string, or ``{'content': ...}`` as
    transformers writes added tokens) as text ('' for none)."""
    if isinstance(value, dict):
        return str(value.get("content", ""))
    return "" if value is None else str(value)


class HFTokenizer(_FromFile):
    """A HuggingFace ``tokenizers`` tokenizer.json, with its folder's special tokens read as
    ``transformers`` reads them.

    EOS: ``eos_token`` if given, else the ``eos_token`` of ``tokenizer_config.json`` beside the
    file, else the first of ``HF_EOS_CANDIDATES`` in the vocabulary. BOS: that file's
    ``bos_token`` (None without one). Pad: the first of ``HF_PAD_CANDIDATES`` in the
    vocabulary, else EOS. ``encode`` adds no special tokens unless asked (the pipeline appends
    EOS itself); asked, the tokenizer.json's post-processor adds its own (a Llama 3 BOS).
    """

    KIND = "Hugging Face tokenizer.json"

    def _load(self) -> None:
        import tokenizers  # pylint: disable=import-outside-toplevel

        self._tok = tokenizers.Tokenizer.from_file(self._path)
        self._vocab_size = int(self._tok.get_vocab_size(with_added_tokens=True))
        vocab = self._tok.get_vocab(with_added_tokens=True)
        config = folder_config(os.path.dirname(os.path.abspath(self._path)),
                               "tokenizer_config.json")
        named_eos = token_text(config.get("eos_token"))
        names = ((self._eos_token,) if self._eos_token else
                 (named_eos,) if named_eos in vocab else HF_EOS_CANDIDATES)
        eos = next((vocab[n] for n in names if n in vocab), None)
        if eos is None:
            raise ValueError(f"the tokenizer {self._path} has no EOS token among "
                             f"{', '.join(map(repr, names))}: set DataConfig.eos_token to one "
                             "of its tokens")
        self._eos_id = int(eos)
        named_pad = token_text(config.get("pad_token"))
        pads = ((named_pad,) if named_pad in vocab else ()) + HF_PAD_CANDIDATES
        declared = next((vocab[n] for n in pads if n in vocab), None)
        self.declared_pad_id = None if declared is None else int(declared)
        self._pad_id = int(eos if declared is None else declared)
        bos = token_text(config.get("bos_token"))
        self._bos_id = int(vocab[bos]) if bos in vocab else None
        self._special_ids = frozenset(
            int(i) for i, token in self._tok.get_added_tokens_decoder().items() if token.special)

    @property
    def bos_id(self) -> Optional[int]:
        return self._bos_id

    @property
    def special_ids(self) -> frozenset:
        return self._special_ids

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)


def tokenizer_record(cfg: DataConfig, read_from: str = "") -> dict:
    """What a run records of the tokenizer it trains with (``config.json``'s ``tokenizer``):
    its kind, the absolute path of its file and the file's SHA-256 ('' for the byte tokenizer,
    or where the file cannot be read). ``read_from``: where that file is now, until it is moved
    to its path (a run written into a staged directory, :func:`dagmoe_jax.run.paths.
    staged_directory`)."""
    path = os.path.abspath(os.path.expanduser(cfg.tokenizer_path)) if cfg.tokenizer_path else ""
    return {"tokenizer": cfg.tokenizer, "path": path,
            "sha256": file_sha256(read_from or path)}


def file_sha256(path: str) -> str:
    """The SHA-256 of the file at ``path`` in hex ('' when there is none)."""
    if not path or not os.path.isfile(path):
        return ""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def check_tokenizer_record(record: dict, cfg: DataConfig, where: str) -> None:
    """One-line ValueError when ``cfg`` reads text with another tokenizer than ``record``
    (:func:`tokenizer_record` of the run at ``where``) says the run trained with."""
    if not record:
        return                              # a run of an earlier version recorded none
    now = tokenizer_record(cfg)
    if now["tokenizer"] != record.get("tokenizer"):
        raise ValueError(f"the run at {where} trained with the {record.get('tokenizer')!r} "
                         f"tokenizer, not {now['tokenizer']!r}: read it with its own (drop the "
                         "tokenizer override)")
    if record.get("sha256") and now["sha256"] != record["sha256"]:
        what = (f"{now['path']} is not the file it trained with" if now["sha256"] else
                f"{now['path'] or record.get('path')} does not exist")
        raise ValueError(f"the run at {where} trained with the tokenizer file "
                         f"{record.get('path')} (sha256 {record['sha256'][:12]}...), but {what}: "
                         "restore that file, or read a copy of it (dagmoe-sample "
                         "--tokenizer_path=FILE; train.py --mode=eval "
                         "--gin.DataConfig.tokenizer_path=\"'FILE'\")")


def make_tokenizer(cfg: DataConfig) -> Tokenizer:
    """The tokenizer ``cfg.tokenizer`` names, read from ``cfg.tokenizer_path`` if it needs one."""
    if cfg.tokenizer == "byte":
        return ByteTokenizer()
    if cfg.tokenizer == "sentencepiece":
        return SentencePieceTokenizer(cfg.tokenizer_path, cfg.eos_token)
    return HFTokenizer(cfg.tokenizer_path, cfg.eos_token)


def check_tokens(batch: dict, vocab_size: int) -> None:
    """One-line ``ValueError`` if a token id of ``batch`` is outside [0, vocab_size)."""
    for key in ("inputs", "targets"):
        ids = np.asarray(batch[key])
        if ids.size and (ids.max() >= vocab_size or ids.min() < 0):
            bad = int(ids.max()) if ids.max() >= vocab_size else int(ids.min())
            raise ValueError(f"batch[{key!r}] has token id {bad} (max {int(ids.max())}) outside "
                             f"[0, vocab_size={vocab_size}): set ModelConfig.vocab_size >= "
                             "tokenizer.vocab_size")


class CheckTokens(grain.transforms.Map):
    """:func:`check_tokens` as a step of a batch pipeline: a batch with an id outside
    [0, vocab_size) is a one-line error where the batch is made, not in the training loop."""

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size

    def map(self, batch: dict) -> dict:
        check_tokens(batch, self.vocab_size)
        return batch
