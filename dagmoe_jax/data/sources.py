"""Record sources: random-access sequences of text (``len(src)``, ``src[i] -> str``).

Each works as a grain ``RandomAccessDataSource`` (``grain.MapDataset.source(src)``) and pickles
(grain worker processes), holding only paths and small offset tables, and reading lazily:

* :class:`SyntheticSource`: record i of a split is generated from ``(synthetic_seed, stream, i)``.
* :class:`TextSource`: plain text files, one document per run of non-blank lines.
* :class:`JsonlSource`: one JSON object per line, its ``text_key`` string.
* :class:`ArrayRecordSource`: ArrayRecord files through ``grain.sources.ArrayRecordDataSource``.
* :class:`TfdsSource`: ``tfds.data_source`` of an already prepared dataset.

Every problem found while opening a source is a one-line ``ValueError`` naming the
``DataConfig`` field, e.g. ``DataConfig.source='text:foo/*.txt' matched no file: ...``.
"""

from __future__ import annotations

import codecs
import glob
import json
import logging
import os
from typing import Sequence

import numpy as np

from dagmoe_jax.validate import first_line
from dagmoe_jax.data.config import DataConfig, parse_source
from dagmoe_jax.data.parquet import ParquetSource
from dagmoe_jax.data.tasks import generate

logger = logging.getLogger(__name__)

TRAIN_STREAM, HELDOUT_STREAM, TASK_EVAL_STREAM = 0, 1, 2
_MAGIC = set("*?[")


def _where(field: str, spec: str) -> str:
    return f"DataConfig.{field}={spec!r}"


def expand_globs(patterns: Sequence[str], field: str, spec: str) -> list[str]:
    """Files matched by ``patterns``, each pattern's matches sorted, duplicates dropped.

    A literal path that does not exist, a directory, or a glob matching no file is a one-line
    ``ValueError``.
    """
    files: list[str] = []
    for pattern in patterns:
        path = os.path.expanduser(pattern)
        if not _MAGIC & set(path):
            if not os.path.exists(path):
                raise ValueError(f"{_where(field, spec)} names a path that does not exist: "
                                 f"{path!r} (relative to {os.getcwd()!r})")
            if os.path.isdir(path):
                raise ValueError(f"{_where(field, spec)} names a directory {path!r}: use a glob "
                                 f"such as '{path.rstrip('/')}/*.txt'")
            matches = [path]
        else:
            matches = sorted(p for p in glob.glob(path, recursive=True) if os.path.isfile(p))
            if not matches:
                raise ValueError(f"{_where(field, spec)} matched no file: check the glob "
                                 f"{pattern!r} (relative to {os.getcwd()!r})")
        files.extend(m for m in matches if m not in files)
    return files


class SyntheticSource:
    """``num_records`` task examples, record i drawn from ``default_rng([seed, stream, i])``.

    The task is ``tasks[i % len(tasks)]`` (balanced) and the size uniform in
    ``[min_size, max_size]``. Different ``stream`` values give independent examples (the train
    and held-out splits use different streams); nothing is stored.
    """

    def __init__(self, tasks: Sequence[str], num_records: int, *, stream: int, seed: int,
                 min_size: int, max_size: int):
        self.tasks, self.num_records = tuple(tasks), int(num_records)
        self.stream, self.seed = int(stream), int(seed)
        self.min_size, self.max_size = int(min_size), int(max_size)

    def __len__(self) -> int:
        return self.num_records

    def example(self, index: int):
        """The :class:`~dagmoe_jax.data.tasks.Example` of record ``index``."""
        index = int(index) % self.num_records
        rng = np.random.default_rng([self.seed, self.stream, index])
        size = int(rng.integers(self.min_size, self.max_size + 1))
        return generate(self.tasks[index % len(self.tasks)], rng, size)

    def __getitem__(self, index: int) -> str:
        return self.example(index).text


class _Indexed:
    """Files plus one (file, start, end) byte range per record; subclasses scan the files in
    ``_ranges`` and turn a range's bytes into text in ``__getitem__``."""

    def __init__(self, files: Sequence[str], *args):
        self.files = list(files)
        ranges = [(k, start, end) for k, path in enumerate(self.files)
                  for start, end in self._ranges(path, *args)]
        table = np.asarray(ranges, np.int64).reshape(-1, 3)
        self._file, self._start, self._end = table[:, 0], table[:, 1], table[:, 2]

    def _ranges(self, path: str, *args):
        raise NotImplementedError

    def __len__(self) -> int:
        return len(self._start)

    def _read(self, index: int) -> bytes:
        index = int(index) % len(self)
        with open(self.files[self._file[index]], "rb") as f:
            f.seek(int(self._start[index]))
            return f.read(int(self._end[index] - self._start[index]))


class Piece(str):
    """The text of a record that is not a document's end: a long document is read as pieces
    of at most ``TextSource.MAX_PIECE_BYTES`` (memory stays flat in document length), and the
    tokenized stream appends EOS only after a document's last piece."""

    continues = True

    def __reduce__(self):
        return Piece, (str(self),)


class _TextCheck:
    """Finds the first sign that a text file is not UTF-8 text: a NUL byte (a binary file) or
    an invalid UTF-8 sequence (Latin-1 or another 8-bit encoding). Such bytes would train as
    U+FFFD replacement characters (or NULs) without a word, so the first one found in a file
    is logged as a warning, once per file and process."""

    warned: set = set()

    def __init__(self, path: str):
        self.path = path
        self._decoder = codecs.getincrementaldecoder("utf-8")("strict")

    def feed(self, block: bytes, pos: int) -> None:
        """Check ``block`` (the file's bytes from offset ``pos``; empty at the end)."""
        if self._decoder is None:
            return
        problem = None
        nul = block.find(b"\0")
        try:
            self._decoder.decode(block[:nul] if nul >= 0 else block, final=not block)
        except UnicodeDecodeError as err:
            offset = pos + err.start
            problem = (f"is not UTF-8 text (byte 0x{err.object[err.start]:02x} at offset "
                       f"{offset} is not valid UTF-8; Latin-1?): its undecodable bytes train as "
                       f"U+FFFD replacement characters; convert it (iconv -f latin1 -t utf-8) "
                       f"or leave it out") if err.start < len(err.object) else (
                       "ends inside a UTF-8 character (truncated?)")
        if problem is None and nul >= 0:
            problem = (f"looks binary (a NUL byte at offset {pos + nul}), not text: leave it "
                       f"out of DataConfig.source")
        if problem is not None:
            self._decoder = None
            if self.path not in self.warned:
                self.warned.add(self.path)
                logger.warning("%s %s", self.path, problem)


class TextSource(_Indexed):
    """Plain text files; a document is a maximal run of non-blank lines (its final newline
    dropped). Blank (whitespace-only) lines separate documents and are not part of any.

    A document longer than :data:`MAX_PIECE_BYTES` is several records: consecutive pieces cut
    after a whitespace (or, failing one, at a UTF-8 character boundary), every piece but the
    last a :class:`Piece`. Files are scanned in blocks, so neither indexing nor reading ever
    holds more than a block or a piece of one document, however long its lines.
    """

    MAX_PIECE_BYTES = 1 << 16
    _BLOCK = 1 << 20

    def __init__(self, files: Sequence[str]):
        self._last = []          # per record: whether it ends its document
        super().__init__(files)
        self._last = np.asarray(self._last, bool)

    def _ranges(self, path: str):
        for start, end in self._documents(path):
            while end - start > self.MAX_PIECE_BYTES:
                cut = self._cut(path, start, start + self.MAX_PIECE_BYTES)
                self._last.append(False)
                yield start, cut
                start = cut
            self._last.append(True)
            yield start, end

    def _documents(self, path: str):
        """(start, end) byte ranges of the documents of ``path``, read block by block (lines
        are found with ``bytes.find``, so a line of any length costs one block of memory).
        The blocks are checked for UTF-8 on the way (:class:`_TextCheck`)."""
        pos, start, end = 0, None, 0
        line_start, line_blank, last = 0, True, b""
        check = _TextCheck(path)
        with open(path, "rb") as f:
            while True:
                block = f.read(self._BLOCK)
                check.feed(block, pos)
                if not block:
                    break
                offset = 0
                while True:
                    newline = block.find(b"\n", offset)
                    segment = block[offset:newline if newline >= 0 else len(block)]
                    if line_blank and segment.strip():
                        line_blank = False
                    if segment:
                        last = segment[-1:]
                    if newline < 0:
                        break
                    if not line_blank:
                        start = line_start if start is None else start
                        at = pos + newline
                        end = at - 1 if last == b"\r" and at > line_start else at
                    elif start is not None:
                        yield start, end
                        start = None
                    line_start, line_blank, last = pos + newline + 1, True, b""
                    offset = newline + 1
                pos += len(block)
        if not line_blank:                                             # no final newline
            start = line_start if start is None else start
            end = pos - 1 if last == b"\r" else pos
        if start is not None:
            yield start, end

    @staticmethod
    def _cut(path: str, start: int, limit: int) -> int:
        """Where to end a piece at or before ``limit`` (> ``start``): after the last whitespace
        of its final 4 KiB, else at the last UTF-8 character boundary."""
        lo = max(start + 1, limit - 4096)
        with open(path, "rb") as f:
            f.seek(lo)
            tail = f.read(limit - lo + 1)        # + the byte at ``limit`` (a boundary test)
        for i in range(len(tail) - 2, -1, -1):
            if tail[i] in b" \t\n":
                return lo + i + 1
        for i in range(len(tail) - 1, 0, -1):
            if tail[i] & 0xC0 != 0x80:             # not a continuation byte: a boundary
                return lo + i
        return limit

    def __getitem__(self, index: int) -> str:
        text = self._read(index).decode("utf-8", errors="replace")
        return text if self._last[int(index) % len(self)] else Piece(text)


class JsonlSource(_Indexed):
    """JSON-lines files: each non-blank line a JSON object whose ``text_key`` is a string.

    Lines whose text is empty are skipped. A line that is not a JSON object, or lacks
    ``text_key``, is a one-line ``ValueError`` naming the file and line (checked on opening).
    """

    def __init__(self, files: Sequence[str], text_key: str, where: str):
        self.text_key = text_key
        super().__init__(files, where)

    def _ranges(self, path: str, where: str):
        pos = 0
        with open(path, "rb") as f:
            for lineno, line in enumerate(f, 1):
                if line.strip() and self._text(line, f"{path} line {lineno}", where):
                    yield pos, pos + len(line)
                pos += len(line)

    def _text(self, line: bytes, place: str, where: str) -> str:
        try:
            obj = json.loads(line)
        except ValueError as err:
            raise ValueError(f"{where}: {place} is not valid JSON ({first_line(err)})") from None
        if not isinstance(obj, dict) or not isinstance(obj.get(self.text_key), str):
            raise ValueError(f"{where}: {place} has no string under DataConfig.text_key="
                             f"{self.text_key!r}: fix the file or set text_key")
        return obj[self.text_key]

    def __getitem__(self, index: int) -> str:
        return self._text(self._read(index), f"record {index}", "jsonl")


def record_text(raw: bytes, text_key: str) -> str:
    """An ArrayRecord record as text: a JSON object's ``text_key``, else the utf-8 bytes."""
    text = raw.decode("utf-8", errors="replace")
    if text.lstrip().startswith("{"):
        try:
            obj = json.loads(text)
        except ValueError:
            return text
        if isinstance(obj, dict):
            if text_key not in obj:
                raise ValueError(f"an ArrayRecord JSON record has no DataConfig.text_key="
                                 f"{text_key!r} (keys: {', '.join(map(repr, obj))})")
            return str(obj[text_key])
    return text


class ArrayRecordSource:
    """ArrayRecord files read with ``grain.sources.ArrayRecordDataSource``; see
    :func:`record_text` for how a record becomes text."""

    def __init__(self, files: Sequence[str], text_key: str, where: str):
        import grain  # pylint: disable=import-outside-toplevel

        self.text_key = text_key
        try:
            self._source = grain.sources.ArrayRecordDataSource(list(files))
        except Exception as err:  # pylint: disable=broad-except  (any reader failure)
            raise ValueError(f"{where} could not be read as ArrayRecord files: "
                             f"{first_line(err)}") from None

    def __len__(self) -> int:
        return len(self._source)

    def __getitem__(self, index: int) -> str:
        return record_text(self._source[int(index) % len(self)], self.text_key)


class TfdsSource:
    """Feature ``text_key`` of split ``split`` of a TFDS dataset prepared in ``data_dir``.

    Read with ``tfds.data_source(..., download=False)``: the dataset must have been prepared
    with ``file_format='array_record'`` (TFDS random access needs it). No TensorFlow needed.
    """

    def __init__(self, name: str, split: str, data_dir: str, text_key: str, where: str):
        import tensorflow_datasets as tfds  # pylint: disable=import-outside-toplevel

        self.text_key = text_key
        place = data_dir or "TFDS's default data_dir"
        fix = (f"prepare it there first (builder.download_and_prepare(file_format="
               f"'array_record')) or set DataConfig.tfds_data_dir")
        try:
            builder = tfds.builder(name, data_dir=data_dir or None)
            prepared = builder.is_prepared()
        except Exception:  # pylint: disable=broad-except  (DatasetNotFoundError and kin)
            prepared = False
        if not prepared:
            raise ValueError(f"{where} is not prepared in {place}: {fix}")
        features = list(builder.info.features.keys())
        if text_key not in features:
            raise ValueError(f"DataConfig.text_key={text_key!r} is not a feature of {where} "
                             f"(features: {', '.join(map(repr, features))})")
        try:
            self._source = tfds.data_source(name, split=split, data_dir=data_dir or None,
                                            download=False)
        except NotImplementedError:  # prepared in another file format (tfrecord)
            raise ValueError(f"{where} is prepared in {place} in a format without random "
                             f"access: prepare it again with file_format='array_record'") from None
        except Exception as err:  # pylint: disable=broad-except  (unknown split, ...)
            raise ValueError(f"{where} split {split!r} cannot be read: "
                             f"{first_line(err)}") from None

    def __len__(self) -> int:
        return len(self._source)

    def __getitem__(self, index: int) -> str:
        value = self._source[int(index) % len(self)][self.text_key]
        if isinstance(value, np.ndarray) and value.ndim == 0:
            value = value.item()
        return value.decode("utf-8", errors="replace") if isinstance(value, bytes) else str(value)


def open_source(cfg: DataConfig, field: str, *, split: str = "", stream: int = TRAIN_STREAM):
    """The records of ``cfg.<field>`` (``'source'`` or ``'eval_source'``).

    ``split`` is the TFDS split (default ``cfg.split``); ``stream`` picks the synthetic stream
    (with ``num_synthetic`` records for :data:`TRAIN_STREAM`, else ``num_synthetic_eval``).
    A source with no records is a one-line ``ValueError`` ('... is empty').
    """
    spec = getattr(cfg, field)
    kind, args = parse_source(spec, field)
    where = _where(field, spec)
    if kind == "synthetic":
        n = cfg.num_synthetic if stream == TRAIN_STREAM else cfg.num_synthetic_eval
        src = SyntheticSource(args, n, stream=stream, seed=cfg.synthetic_seed,
                              min_size=cfg.task_min_size, max_size=cfg.task_max_size)
    elif kind == "tfds":
        src = TfdsSource(args[0], split or cfg.split, cfg.tfds_data_dir, cfg.text_key, where)
    else:
        files = expand_globs(args, field, spec)
        if kind == "text":
            src = TextSource(files)
        elif kind == "jsonl":
            src = JsonlSource(files, cfg.text_key, where)
        elif kind == "parquet":
            src = ParquetSource(files, cfg.text_key, where)   # data/parquet.py
        else:
            src = ArrayRecordSource(files, cfg.text_key, where)
    if len(src) == 0:
        raise ValueError(f"{where} is empty: it has no records with non-empty text; point it "
                         "at data")
    return src
