"""Instruction records -> conversations (lists of {'role', 'content'} messages).

An ``instruct:<glob>[,<glob>...]`` source (:class:`~dagmoe_jax.data.config.DataConfig`) reads
JSON-lines files (``.jsonl`` / ``.json``: one JSON object a line) and Parquet files
(``.parquet``, with pyarrow), in sorted order of each glob. ``DataConfig.instruct_format``
says how a record becomes a conversation (:data:`FORMATS`):

* ``'alpaca'``: ``instruction``, optional ``input``, ``output`` -> user ``instruction`` (plus
  ``'\\n\\n' + input`` when the input is non-empty), assistant ``output``;
* ``'metamath'``: ``query``, ``response`` (MetaMathQA);
* ``'prompt_response'``: ``prompt``, ``response``, optional ``system``;
* ``'messages'``: ``messages``, a list of ``{'role': 'system' | 'user' | 'assistant',
  'content': str}`` (OpenAI-style chat datasets; ``conversations`` is read too);
* ``'sharegpt'``: ``conversations``, a list of ``{'from': 'system' | 'human' | 'gpt',
  'value': str}`` (ShareGPT: SlimOrca, ...; the roles as LlamaFactory's sharegpt format maps
  them, any other, such as a tool's turn, refused by name);
* ``'fields:<prompt>,<response>[,<system>]'``: any other field names;
* ``'auto'`` (default): per record, the first of messages (or sharegpt, when the turns have
  ``from`` / ``value``), alpaca, metamath, prompt_response whose fields the record has.

A record short of a field of its mapping (an Alpaca record without ``output``) is an incomplete
record: a one-line ``ValueError`` naming the file, the line (the row of a Parquet file) and
the field. A record whose fields are another mapping's is a one-line ``ValueError`` naming the
mappings to choose from. All records are read when the source opens.
"""

from __future__ import annotations

import json
from typing import List, Optional, Sequence, Tuple

from dagmoe_jax.data.chat import check_messages
from dagmoe_jax.data.formats import PRESETS, SHAREGPT_ROLES, fields_of
from dagmoe_jax.data.sources import expand_globs

_HELP = ("set DataConfig.instruct_format to the records' mapping: 'alpaca' (instruction/input/"
         "output), 'metamath' (query/response), 'prompt_response' (prompt/response), "
         "'messages' (a list of {role, content}), 'sharegpt' (conversations of {from, value}) "
         "or 'fields:<prompt>,<response>[,<system>]'")


def _mapping(fmt: str) -> Tuple[str, str, Optional[str], Optional[str]]:
    if fmt in PRESETS:
        return PRESETS[fmt]
    names = fields_of(fmt)
    return names[0], names[1], None, names[2] if len(names) > 2 else None


def _incomplete(record: dict, fields: Sequence[Optional[str]]) -> bool:
    """Whether a record short of a field of mapping ``fields`` is incomplete rather than of
    another format: it has a field of the mapping and none of another mapping's."""
    known = {n for preset in PRESETS.values() for n in preset if n} | {
        "messages", "conversations", *(n for n in fields if n)}
    theirs = known & set(record)
    return bool(theirs) and theirs <= set(fields)


def _detect(record: dict) -> str:
    """The format of a record under 'auto' ('' for none): the first whose fields it has, else
    one whose prompt field (or its own response field) it has and no other's (an incomplete
    record, reported by the field it lacks)."""
    if "messages" in record or "conversations" in record:
        turns = record.get("messages", record.get("conversations"))
        first = turns[0] if isinstance(turns, (list, tuple)) and turns else None
        return "sharegpt" if isinstance(first, dict) and "from" in first else "messages"
    for name, (prompt, response, _, _) in PRESETS.items():
        if prompt in record and response in record:
            return name
    for name, fields in PRESETS.items():
        prompt, response = fields[:2]
        own = all(response not in other[:2] for key, other in PRESETS.items() if key != name)
        if (prompt in record or (own and response in record)) and _incomplete(record, fields):
            return name
    return ""


def to_messages(record, fmt: str, where: str) -> List[dict]:
    """The conversation of one record under format ``fmt`` (module docstring)."""
    if not isinstance(record, dict):
        raise ValueError(f"{where}: not a JSON object: {_HELP}")
    if fmt == "auto":
        fmt = _detect(record)
        if not fmt:
            raise ValueError(f"{where}: no known instruction fields among "
                             f"{sorted(record)[:8]}: {_HELP}")
    if fmt == "messages":
        messages = record.get("messages", record.get("conversations"))
        if messages is None:
            raise ValueError(f"{where}: no 'messages' field: {_HELP}")
        return check_messages(messages, where)
    if fmt == "sharegpt":
        return sharegpt_messages(record.get("conversations", record.get("messages")), where)
    prompt, response, extra, system = _mapping(fmt)
    for name in (prompt, response):
        if isinstance(record.get(name), str):
            continue
        if not _incomplete(record, (prompt, response, extra, system)):
            raise ValueError(f"{where}: no string field {name!r} (instruct_format={fmt!r}): "
                             f"{_HELP}")
        value = record.get(name)
        what = (f"no {name!r} field" if name not in record else f"its {name!r} is "
                f"{'null' if value is None else type(value).__name__}, not a string")
        raise ValueError(f"{where}: an incomplete {fmt!r} record: {what} (it has "
                         f"{', '.join(sorted(record)[:8])}): add its {name!r} or drop the "
                         "record")
    user = record[prompt]
    if extra and isinstance(record.get(extra), str) and record[extra].strip():
        user = f"{user}\n\n{record[extra]}"
    messages = [{"role": "user", "content": user},
                {"role": "assistant", "content": record[response]}]
    if system and isinstance(record.get(system), str) and record[system]:
        messages.insert(0, {"role": "system", "content": record[system]})
    return messages


def sharegpt_messages(turns, where: str) -> List[dict]:
    """ShareGPT ``turns`` (``[{'from', 'value'}]``) as ``{'role', 'content'}`` messages, the
    roles by :data:`~dagmoe_jax.data.formats.SHAREGPT_ROLES` (human -> user, gpt -> assistant,
    system -> system); other keys of a turn (SlimOrca's ``weight``) are ignored. A turn of any
    other role is a one-line ``ValueError`` that names it."""
    if not isinstance(turns, (list, tuple)) or not turns:
        raise ValueError(f"{where}: no 'conversations' list of ShareGPT turns: {_HELP}")
    messages = []
    for i, turn in enumerate(turns):
        if not (isinstance(turn, dict) and isinstance(turn.get("value"), str)):
            raise ValueError(f"{where}: turn {i} is not a ShareGPT {{'from', 'value': str}} "
                             f"turn: {_HELP}")
        role = SHAREGPT_ROLES.get(turn.get("from"))
        if role is None:
            raise ValueError(f"{where}: ShareGPT role {turn.get('from')!r} (turn {i}) is not "
                             f"supported: only {', '.join(SHAREGPT_ROLES)} turns train here "
                             f"(drop or rewrite the others)")
        messages.append({"role": role, "content": turn["value"]})
    return check_messages(messages, where)


def _rows(path: str):
    """(where, record) of each record of a file: Parquet (``.parquet``), ArrayRecord
    (``.array_record``, each record a JSON object in utf-8), a JSON array (a ``.json`` file
    whose text starts with '[', as Alpaca's ``alpaca_data.json``) or JSON lines (the rest)."""
    # pylint: disable=import-outside-toplevel
    if path.endswith(".parquet"):
        import pyarrow.parquet as pq

        for i, row in enumerate(pq.read_table(path).to_pylist()):
            yield f"{path} row {i}", row
        return
    if path.endswith(".array_record"):
        import grain

        source = grain.sources.ArrayRecordDataSource([path])
        for i in range(len(source)):
            try:
                record = json.loads(bytes(source[i]).decode("utf-8"))
            except (UnicodeDecodeError, json.JSONDecodeError):
                raise ValueError(f"{path} record {i}: not a JSON object in utf-8 (instruct: "
                                 "ArrayRecord files hold one JSON record each)") from None
            yield f"{path} record {i}", record
        return
    if path.endswith(".json"):
        with open(path, "rb") as f:
            text = _utf8(f.read(), path)
        if text.lstrip().startswith("["):
            try:
                records = json.loads(text)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}: not a JSON array ({err.msg} at line "
                                 f"{err.lineno})") from None
            for i, record in enumerate(records):
                yield f"{path} item {i}", record
            return
    with open(path, "rb") as f:
        for i, raw in enumerate(f, start=1):
            line = _utf8(raw, f"{path} line {i}")
            if line.strip():
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as err:
                    raise ValueError(f"{path} line {i}: not JSON ({err.msg})") from None
                yield f"{path} line {i}", record


def _utf8(data: bytes, where: str) -> str:
    """``data`` decoded as UTF-8, or a one-line ValueError naming ``where`` (a file cut in the
    middle of a character, or not text)."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"{where}: not UTF-8 text ({err.reason} at byte {err.start}): is the "
                         f"file cut short or binary?") from None


class InstructSource:
    """The conversations of the files of an ``instruct:`` spec, in order; random access."""

    def __init__(self, files: Sequence[str], fmt: str):
        self.files, self.format = list(files), fmt
        self.records = [to_messages(record, fmt, where)
                        for path in self.files for where, record in _rows(path)]

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, i: int) -> List[dict]:
        return self.records[int(i)]


def open_instruct(args: Sequence[str], fmt: str, field: str, spec: str) -> InstructSource:
    """The :class:`InstructSource` of an ``instruct:`` spec's globs (one-line errors for a
    missing file or an empty source)."""
    src = InstructSource(expand_globs(args, field, spec), fmt)
    if len(src) == 0:
        raise ValueError(f"DataConfig.{field}={spec!r} is empty: it has no records; point it "
                         "at data")
    return src
