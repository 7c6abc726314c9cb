"""Conversations -> token ids + per-token loss weights, by the tokenizer's own chat template.

A conversation is a list of ``{'role': 'system' | 'user' | 'assistant', 'content': str}``.
:class:`ChatEncoder` turns it into ``(ids, weights)``: ``weights[i]`` is 1 where token i is
an assistant's (its reply and the EOS that ends the turn) and 0 elsewhere (system and user
turns, role headers, the BOS).

Templates:

* a Hugging Face ``chat_template`` (``tokenizer_config.json`` beside the tokenizer.json, or
  ``chat_template.jinja`` there, or a ``.jinja`` file named by ``DataConfig.chat_template``),
  rendered with jinja2 as ``transformers`` renders it: an ``ImmutableSandboxedEnvironment``
  with ``trim_blocks`` and ``lstrip_blocks``, ``raise_exception``, ``strftime_now`` and a
  ``tojson`` filter; variables ``messages``, ``add_generation_prompt``, ``bos_token`` and
  ``eos_token``;
* the plain template (byte and SentencePiece tokenizers, or ``chat_template='plain'``)::

      <system content>\\n\\n                       (a system turn)
      ### Instruction:\\n<user content>\\n\\n         (a user turn)
      ### Response:\\n<assistant content><EOS>       (an assistant turn; trained: content + EOS)

Boundaries are exact because the conversation is rendered turn by turn: for assistant turn k
the prefix ``messages[:k]`` with the generation prompt, then ``messages[:k + 1]``; the text
between is the assistant's. Each piece is tokenized on its own and the ids concatenated. In
a template's assistant piece, tokens after its last end-of-turn token (a newline after
``<|im_end|>``) are not trained; a piece without one is trained whole. The end-of-turn token
is ``tokenizer_config.json``'s ``eos_token`` when it is a single token, else the tokenizer's
EOS.
"""

from __future__ import annotations

import datetime
import json
import os
from typing import List, Optional, Sequence, Tuple

from dagmoe_jax.data.tokenizers import Tokenizer, folder_config, token_text

ROLES = ("system", "user", "assistant")
PLAIN = {"system": ("", "\n\n"), "user": ("### Instruction:\n", "\n\n"),
         "assistant": ("### Response:\n", "")}


def hf_template(tokenizer_path: str) -> Tuple[Optional[str], str, str]:
    """(chat template or None, bos_token, eos_token) of the Hugging Face folder holding
    ``tokenizer_path``: ``tokenizer_config.json``'s ``chat_template`` (a string, or the one
    named 'default' of a list), else a ``chat_template.jinja`` file beside it."""
    folder = os.path.dirname(os.path.abspath(os.path.expanduser(tokenizer_path)))
    config = folder_config(folder, "tokenizer_config.json")
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template}
        template = named.get("default")
    jinja_file = os.path.join(folder, "chat_template.jinja")
    if template is None and os.path.isfile(jinja_file):
        with open(jinja_file, encoding="utf-8") as f:
            template = f.read()
    return template, token_text(config.get("bos_token")), token_text(config.get("eos_token"))


def compile_template(source: str):
    """The jinja2 template as ``transformers`` compiles a chat template."""
    # pylint: disable=import-outside-toplevel
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    def strftime_now(fmt):
        return datetime.datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env.from_string(source)


def check_messages(messages, where: str = "a conversation") -> list:
    """``messages`` as a list of {'role', 'content'} dicts; a one-line ValueError otherwise."""
    ok = isinstance(messages, (list, tuple)) and len(messages) > 0
    out = []
    for m in messages if ok else ():
        if not (isinstance(m, dict) and m.get("role") in ROLES
                and isinstance(m.get("content"), str)):
            ok = False
            break
        out.append({"role": m["role"], "content": m["content"]})
    if not ok or not any(m["role"] == "assistant" for m in out):
        raise ValueError(f"{where}: 'messages' must be a non-empty list of {{'role': one of "
                         f"{', '.join(ROLES)}, 'content': str}} with an assistant turn")
    return out


class ChatEncoder:
    """messages -> (ids, weights) (module docstring). Picklable (the tokenizer pickles by path
    and the template is compiled again), so grain worker processes can use it.

    template: a jinja chat template, or None for the plain template. bos_token / eos_token:
    the strings the template reads (defaults: '' and the EOS token's own text).
    """

    def __init__(self, tokenizer: Tokenizer, template: Optional[str] = None,
                 bos_token: str = "", eos_token: str = ""):
        self.tokenizer, self.template = tokenizer, template
        self.bos_token = bos_token
        self.eos_token = eos_token or (tokenizer.decode([tokenizer.eos_id]) if template else "")
        self._compiled = compile_template(template) if template is not None else None
        # The id that ends an assistant turn: the template's eos_token when it is one token
        # (Llama-3's '<|eot_id|>', ChatML's '<|im_end|>'), else the tokenizer's EOS.
        end = tokenizer.encode(self.eos_token) if template and self.eos_token else []
        self.end_id = end[0] if len(end) == 1 else tokenizer.eos_id

    def __getstate__(self):
        return {k: v for k, v in self.__dict__.items() if k != "_compiled"}

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._compiled = compile_template(self.template) if self.template is not None else None

    def render(self, messages: Sequence[dict], add_generation_prompt: bool = False) -> str:
        """The template's text of ``messages``."""
        if self._compiled is None:
            text = "".join(PLAIN[m["role"]][0] + m["content"] + PLAIN[m["role"]][1]
                           for m in messages)
            return text + (PLAIN["assistant"][0] if add_generation_prompt else "")
        return self._compiled.render(messages=list(messages),
                                     add_generation_prompt=add_generation_prompt,
                                     bos_token=self.bos_token, eos_token=self.eos_token)

    def pieces(self, messages: Sequence[dict]) -> List[Tuple[str, bool]]:
        """(text, is the assistant's) pieces whose concatenation is the whole rendering."""
        messages = list(messages)
        if self._compiled is None:
            return self._plain_pieces(messages)
        out, done = [], ""
        for k, m in enumerate(messages):
            if m["role"] == "assistant":
                head = self._extend(done, self.render(messages[:k], True), k)
                out.append((head[len(done):], False))
                done = head
            full = self._extend(done, self.render(messages[:k + 1]), k)
            out.append((full[len(done):], m["role"] == "assistant"))
            done = full
        return [(text, trained) for text, trained in out if text]

    def _extend(self, done: str, text: str, k: int) -> str:
        if not text.startswith(done):
            raise ValueError(f"the chat template does not render turn {k} as an extension of "
                             "the turns before it, so the assistant's tokens cannot be told "
                             "apart: set DataConfig.chat_template='plain' or another template")
        return text

    @staticmethod
    def _plain_pieces(messages: Sequence[dict]) -> List[Tuple[str, bool]]:
        out = []
        for m in messages:
            head, tail = PLAIN[m["role"]]
            if m["role"] == "assistant":
                out += [(head, False), (m["content"], True), (None, True)]  # None: the EOS id
            else:
                out.append((head + m["content"] + tail, False))
        return out

    def encode(self, messages: Sequence[dict]) -> Tuple[List[int], List[int]]:
        """(token ids, loss weights 0/1) of a conversation (module docstring)."""
        ids, weights = [], []
        eos = self.end_id
        for text, trained in self.pieces(messages):
            piece = [self.tokenizer.eos_id] if text is None else self.tokenizer.encode(text)
            w = [int(trained)] * len(piece)
            if trained and self._compiled is not None and eos in piece:
                last = len(piece) - 1 - piece[::-1].index(eos)
                w[last + 1:] = [0] * (len(piece) - last - 1)
            ids += piece
            weights += w
        return ids, weights
