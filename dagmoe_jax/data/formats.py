"""The field mappings of instruction records (``DataConfig.instruct_format``); the records are
read by :mod:`dagmoe_jax.data.instruct_records`. Kept apart so that the config can check a
format without importing the readers."""

from __future__ import annotations

# format -> (prompt field, response field, optional input field, optional system field)
PRESETS = {"alpaca": ("instruction", "output", "input", None),
           "metamath": ("query", "response", None, None),
           "prompt_response": ("prompt", "response", None, "system")}
FORMATS = ("auto", "messages", "sharegpt", *PRESETS, "fields:<prompt>,<response>[,<system>]")
# ShareGPT's turn tags (``from``) -> chat roles, as LlamaFactory's sharegpt format reads them
SHAREGPT_ROLES = {"human": "user", "gpt": "assistant", "system": "system"}


def fields_of(fmt: str) -> list:
    """The field names of a ``'fields:<prompt>,<response>[,<system>]'`` format."""
    return [n.strip() for n in fmt[len("fields:"):].split(",")]


def check_format(value) -> bool:
    """Whether ``value`` is a valid ``DataConfig.instruct_format``."""
    if value in FORMATS[:-1]:
        return True
    if isinstance(value, str) and value.startswith("fields:"):
        names = fields_of(value)
        return len(names) in (2, 3) and all(names)
    return False
