"""lm-evaluation-harness's ``LM`` interface for any run directory: the model named ``dagmoe``.

``lm_eval --model dagmoe --model_args run_dir=R`` (with ``--include_path`` or after
``import dagmoe_jax.harness.lm``), ``python -m dagmoe_jax.harness --run_dir R``, or
``lm_eval.simple_evaluate(model=DagmoeLM(run_dir=R), ...)`` from a notebook.

The three request types, as the harness's Hugging Face model (``HFLM``) defines them:

* Tokens as HFLM makes them. A text is encoded with the tokenizer's own post-processing (a
  Llama 3 tokenizer.json adds its BOS; ``add_bos_token`` true or false overrides it, as HFLM
  passes it on as ``add_special_tokens``), except a text that already starts with the document
  prefix's text. The document prefix (``prefix_token_id``) is the tokenizer's BOS where its
  ``tokenizer_config.json`` names one, else its EOS.
* ``loglikelihood``: the harness splits each (context, continuation) text pair into ids
  (trailing spaces of the context move to the continuation; the continuation's ids are those of
  ``context + continuation`` after the context's), an empty context becomes the document
  prefix, and :meth:`Scorer.loglikelihood` scores them in batches, longest first, truncating
  from the left what exceeds the window.
* ``loglikelihood_rolling``: the text's ids in the harness's own disjoint windows of
  ``max_length`` tokens (``lm_eval.utils.get_rolling_token_windows`` with a context of 1 and
  the document prefix before the first token), each window scored as a loglikelihood request;
  their sum.
* ``generate_until``: greedy (``do_sample`` false or temperature 0, the default) or sampled
  KV-cache decoding of up to ``max_gen_toks`` tokens. A row stops at the tokenizer's EOS, at
  every ``eos_token_id`` of the ``generation_config.json`` beside the tokenizer (as
  ``transformers``' ``generate`` does), and, when the prompts were rendered with the run's chat
  template, at the template's end-of-turn token; and, inside the decoding loop, once a stop
  string (the request's ``until`` and the EOS token's text) appears as lm-eval's own rule
  finds it (:class:`~dagmoe_jax.decoding.generate.StopStrings`). The text is decoded without
  special tokens and cut at the first stop string. Requests sharing generation settings run
  together in batches, longest prompt first.

Every block type works (dense, MoE with any aggregation, CoE, DoE with its topics tracked from
the prompt, DUME-merged and upcycled models: they are run directories like any other), on one
device or sharded data-parallel over all of them (``mesh='auto'`` with more than one device).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import List, Optional, Tuple

from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import Collator
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from tqdm import tqdm

from dagmoe_jax.decoding.generate import StopStrings
from dagmoe_jax.evaluation.scoring import Scorer

DEFAULT_MAX_GEN_TOKS = 256


def _flag(value) -> bool:
    """A boolean model argument, given as a bool or as the harness's strings."""
    if isinstance(value, str):
        if value.lower() not in ("true", "false", "1", "0"):
            raise ValueError(f"expected true or false, got {value!r}")
        return value.lower() in ("true", "1")
    return bool(value)


# HFLM's model arguments this model reads the same way, and those it refuses (with why).
REFUSED_ARGS = {
    "trust_remote_code": "a run's model is the library's own code; there is no remote code "
                         "to trust",
    "parallelize": "spread a model over devices with mesh='auto'",
    "peft": "merge adapters before importing the model",
    "revision": "runs are local directories with no revisions",
}
DTYPES = ("auto", "float32", "bfloat16")


@register_model("dagmoe")
class DagmoeLM(TemplateLM):
    """A dagmoe_jax model for lm-evaluation-harness.

    run_dir: a run directory (``train.py``, the upcycle command, DUME merges): its newest
      checkpoint, tokenizer and model family; or ``hf:FOLDER``, a Hugging Face Llama folder
      with its tokenizer.json (:func:`dagmoe_jax.hf.run.load_hf_run`), which ``pretrained=
      FOLDER`` also names, as for HFLM. Or pass a loaded ``run``
      (:class:`dagmoe_jax.run.LoadedRun`) from Python.
    batch_size: rows per compiled call (default 8), or 'auto': the largest power of two up to
      ``max_batch_size`` (default 64) whose compiled scoring call at the full window fits the
      device's memory (:meth:`Scorer.fit_batch_size`).
    max_length: the scoring window (default: the model's ``max_seq_len``).
    max_gen_toks: the generation length when a task gives none (default 256).
    add_bos_token: as HFLM's: None (default) lets the tokenizer's post-processing decide, True
      or False adds or leaves out its special tokens on every encoded text.
    prefix_token_id: the id before a document scored from its start (rolling, empty context);
      default the tokenizer's BOS, else its EOS (HFLM's).
    dtype: 'auto' (default: the run's ``ModelConfig.compute_dtype``), 'float32' or
      'bfloat16': the dtype the model computes in while scoring and generating (the
      parameters stay as stored; the LM head's products accumulate in float32 either way).
    mesh: 'auto' (default: data-parallel over every device when there is more than one) or
      'none' (one device).
    prefix_eos: put the EOS id before every context and prompt (default false; the library's
      own option, not HFLM's: a run trained on EOS-separated records may score better with it).
    seed: the sampling seed of ``generate_until`` requests that sample.
    device: accepted and unused (JAX places the model); HFLM's other arguments are refused by
      name (:data:`REFUSED_ARGS`), and any unknown one is an error, never ignored.
    """

    def __init__(self, run_dir: Optional[str] = None, *, run=None, batch_size=8,
                 max_length=None, max_gen_toks=DEFAULT_MAX_GEN_TOKS, mesh: str = "auto",
                 add_bos_token=None, prefix_token_id=None, dtype="auto", prefix_eos=False,
                 seed=0, pretrained=None, device=None, max_batch_size=None, **others):
        super().__init__()
        del device        # the harness passes its own --device; JAX places the model
        for name in others:
            why = REFUSED_ARGS.get(name, "it is not an argument of the dagmoe model (run_dir, "
                                   "pretrained, batch_size, max_length, max_gen_toks, "
                                   "add_bos_token, prefix_token_id, dtype, mesh, prefix_eos, "
                                   "seed)")
            raise ValueError(f"model argument {name}={others[name]!r} is refused: {why}")
        # Imported here: loading the model stack is slow, and the class must register fast.
        # pylint: disable=import-outside-toplevel
        import jax
        from dagmoe_jax.decoding.generate import computing_in
        from dagmoe_jax.hf.run import HF_PREFIX, is_hf, open_run
        from dagmoe_jax.parallel import MeshConfig, make_mesh
        from dagmoe_jax.run.extensions import extension_for

        if pretrained is not None:
            if run_dir is not None:
                raise ValueError("DagmoeLM takes one of run_dir and pretrained (a Hugging Face "
                                 "folder, the same as run_dir=hf:FOLDER)")
            run_dir = HF_PREFIX + str(pretrained)
        if (run is None) == (run_dir is None):
            raise ValueError("DagmoeLM needs exactly one of run_dir (a run directory) and run")
        if str(mesh) not in ("auto", "none"):
            raise ValueError(f"mesh={mesh!r} is invalid: expected 'auto' or 'none'")
        if str(dtype) not in DTYPES:
            raise ValueError(f"dtype={dtype!r} is refused: expected one of "
                             f"{', '.join(DTYPES)} (the dtype the model computes in)")
        device_mesh = (make_mesh(MeshConfig()) if mesh == "auto" and jax.device_count() > 1
                       else None)
        hf_folder = run is None and is_hf(run_dir)
        if run is None:
            run = open_run(run_dir, mesh=device_mesh)
        self.run, self.run_dir = run, None if run_dir is None else str(run_dir)
        self.tokenizer_obj = run.tokenizer
        features = None
        if self.run_dir is not None and not hf_folder:
            features = extension_for(run.model_cfg).decoding_features(
                self.run_dir, run.data_cfg, run.tokenizer)
        auto_batch = str(batch_size).startswith("auto")     # lm_eval's auto or auto:N
        model = run.model if str(dtype) == "auto" else computing_in(run.model, str(dtype))
        self.scorer = Scorer(model, batch_size=1 if auto_batch else int(batch_size),
                             max_length=None if max_length is None else int(max_length),
                             features=features, mesh=device_mesh)
        if auto_batch:
            self.scorer.batch_size = self.scorer.fit_batch_size(
                64 if max_batch_size is None else int(max_batch_size))
        self.max_gen_toks = int(max_gen_toks)
        self.add_bos_token = None if add_bos_token is None else _flag(add_bos_token)
        self.custom_prefix_token_id = None if prefix_token_id is None else int(prefix_token_id)
        self.prefix_eos = _flag(prefix_eos)
        self.seed = int(seed)
        self._chat = None
        self._texts = {}                # token id -> its text (the prefixes tok_encode checks)
        self.chat_applied = False       # set when the harness renders a prompt as a chat

    # -------------------------------------------------------------------------- tokenization

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer_obj.eos_id

    @property
    def prefix_token_id(self) -> int:
        """HFLM's: the given id, else the tokenizer's BOS, else its EOS."""
        if self.custom_prefix_token_id is not None:
            return self.custom_prefix_token_id
        bos = self.tokenizer_obj.bos_id
        return self.eot_token_id if bos is None else bos

    @property
    def max_length(self) -> int:
        return self.scorer.max_length

    def tok_encode(self, string: str, add_special_tokens=None, left_truncate_len=None,
                   **kwargs) -> List[int]:
        """The ids of ``string`` as HFLM's ``tok_encode`` makes them: ``add_special_tokens``,
        else ``add_bos_token``, else the tokenizer's default (its post-processing), except
        that a string starting with the document prefix's text gets nothing added."""
        del kwargs
        if add_special_tokens is not None:
            special = add_special_tokens
        else:
            special = self._special(string, self.prefix_token_id)
        ids = self.tokenizer_obj.encode(string, add_special_tokens=special)
        return ids[-left_truncate_len:] if left_truncate_len else ids

    def prompt_encode(self, string: str) -> List[int]:
        """A generation prompt's ids as HFLM's ``tok_batch_encode`` makes them: as
        :meth:`tok_encode`, but the prefix that suppresses the special tokens is the BOS
        token's text only."""
        return self.tokenizer_obj.encode(string, add_special_tokens=self._special(
            string, self.tokenizer_obj.bos_id))

    def _special(self, string: str, prefix_id: Optional[int]) -> bool:
        """HFLM's choice of ``add_special_tokens`` for ``string``: False when it already starts
        with the text of ``prefix_id``, else ``add_bos_token``, else the tokenizer's default
        (True: its post-processing)."""
        if prefix_id is not None:
            if prefix_id not in self._texts:
                self._texts[prefix_id] = self.tok_decode([prefix_id],
                                                         skip_special_tokens=False)
            if string.startswith(self._texts[prefix_id]):
                return False
        return self.add_bos_token is not False

    def tok_decode(self, tokens, skip_special_tokens: bool = True) -> str:
        """Text of ``tokens`` (HFLM's default leaves special tokens out)."""
        tokens = [tokens] if isinstance(tokens, int) else list(tokens)
        return self.tokenizer_obj.decode(tokens, skip_special_tokens=skip_special_tokens)

    def stop_token_ids(self) -> Tuple[int, ...]:
        """The ids that end a generated row: EOS, every ``eos_token_id`` of the
        ``generation_config.json`` beside a Hugging Face tokenizer, and the chat template's
        end-of-turn token when the prompts were rendered with it."""
        # pylint: disable-next=import-outside-toplevel
        from dagmoe_jax.data.tokenizers import folder_config
        stops = [self.eot_token_id]
        data_cfg = self.run.data_cfg
        if data_cfg.tokenizer == "hf":
            folder = os.path.dirname(os.path.abspath(os.path.expanduser(
                data_cfg.tokenizer_path)))
            extra = folder_config(folder, "generation_config.json").get("eos_token_id")
            stops += [extra] if isinstance(extra, int) else list(extra or ())
        if self.chat_applied:
            stops.append(self.chat_encoder.end_id)
        return tuple(dict.fromkeys(int(i) for i in stops))

    def _prefixed(self, context: List[int]) -> List[int]:
        return [self.eot_token_id] + context if self.prefix_eos else context

    # -------------------------------------------------------------------------- the requests

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs
                              ) -> List[Tuple[float, bool]]:
        """(sum of log p, is_greedy) for requests ((context, continuation), context ids,
        continuation ids); the scorer orders them longest first."""
        del kwargs
        bar = tqdm(total=len(requests), disable=disable_tqdm or self.rank != 0,
                   desc="Running loglikelihood requests")
        self.scorer.progress = bar.update
        try:
            pairs = [(self._prefixed(list(ctx)), list(cont)) for _, ctx, cont in requests]
            results = self.scorer.loglikelihood(pairs)
        finally:
            bar.close()
            self.scorer.progress = lambda _rows: None
        for (key, _, _), result in zip(requests, results):
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, result)
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> List[float]:
        """Sum of log p over each text, scored in the harness's disjoint rolling windows."""
        windows, owner = [], []
        for index, (text,) in enumerate(req.args for req in requests):
            for context, continuation in map(make_disjoint_window, get_rolling_token_windows(
                    token_list=self.tok_encode(text), prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length, context_len=1)):
                windows.append((None, context, continuation))
                owner.append(index)
        scores = self._loglikelihood_tokens(windows, disable_tqdm=disable_tqdm)
        totals = [0.0] * len(requests)
        for index, (logp, _) in zip(owner, scores):
            totals[index] += logp
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> List[str]:
        """Continuations of each request's context, cut at its ``until`` strings."""
        bar = tqdm(total=len(requests), disable=disable_tqdm or self.rank != 0,
                   desc="Running generate_until requests")
        encoded = {}        # each context encoded once: for the order and for the prompt

        def ids_of(context: str) -> List[int]:
            if context not in encoded:
                encoded[context] = self.prompt_encode(context)
            return encoded[context]
        collator = Collator([req.args for req in requests],
                            sort_fn=lambda args: (-len(ids_of(args[0])), args[0]),
                            group_by="gen_kwargs", group_fn=lambda args: args[1])
        results = []
        eos_text = self.tok_decode([self.eot_token_id], skip_special_tokens=False)
        stops = self.stop_token_ids()
        for chunk in collator.get_batched(n=0):
            contexts, all_kwargs = zip(*chunk)
            kwargs = dict(all_kwargs[0])
            until = kwargs.pop("until", None) or []
            until = [until] if isinstance(until, str) else list(until)
            if eos_text not in until:          # as HFLM: the EOS token's text stops too
                until.append(eos_text)
            max_gen = int(kwargs.pop("max_gen_toks", self.max_gen_toks))
            temperature = float(kwargs.pop("temperature", 0.0))
            if not _flag(kwargs.pop("do_sample", temperature > 0)):
                temperature = 0.0
            top_k = int(kwargs.pop("top_k", 0) or 0)
            top_p = float(kwargs.pop("top_p", 1.0) or 1.0)
            prompts = [self._prefixed(ids_of(c)) or [self.prefix_token_id] for c in contexts]
            outputs = self.scorer.generate(
                prompts, max_new_tokens=max_gen, stop_tokens=stops,
                temperature=temperature, top_k=top_k, top_p=top_p, seed=self.seed,
                pad_id=self.tokenizer_obj.pad_id,
                stop_when=StopStrings(until, self.tokenizer_obj))
            for context, kw, ids in zip(contexts, all_kwargs, outputs):
                # As HFLM: the stop token stays in the ids; decoding without special tokens
                # drops it, and the EOS text among the stop strings cuts what spells it.
                text = cut_at_stop(self.tok_decode(ids), until)
                results.append(text)
                self.cache_hook.add_partial("generate_until", (context, kw), text)
                bar.update(1)
        bar.close()
        return collator.get_original(results)

    # -------------------------------------------------------------------------- chat

    @property
    def tokenizer_name(self) -> str:
        return f"dagmoe-{self.run.data_cfg.tokenizer}-{self.run.data_cfg.tokenizer_path}"

    @property
    def chat_encoder(self):
        """The run's chat formatting (:func:`dagmoe_jax.data.instruct.chat_encoder`: the
        tokenizer's own template, or the plain '### Instruction:' one), as fine-tuning
        formatted its data."""
        if self._chat is None:
            # pylint: disable-next=import-outside-toplevel
            from dagmoe_jax.data.instruct import chat_encoder
            self._chat = chat_encoder(self.run.data_cfg, self.tokenizer_obj)
        return self._chat

    def chat_template(self, chat_template=False) -> str:
        """The template text the harness records with the results ('plain' for the plain
        template); ``chat_template`` (a name among several) is not supported."""
        del chat_template
        return self.chat_encoder.template or "plain"

    def apply_chat_template(self, chat_history, add_generation_prompt: bool = True) -> str:
        """``chat_history`` rendered as fine-tuning renders a conversation (the plain
        template ends an assistant turn with the EOS token's text)."""
        encoder = self.chat_encoder
        self.chat_applied = True
        if encoder.template is None:
            eos = self.tok_decode([self.eot_token_id], skip_special_tokens=False)
            return "".join(encoder.render([m], False) + (eos if m["role"] == "assistant"
                                                          else "")
                           for m in chat_history) + (
                encoder.render([], True) if add_generation_prompt else "")
        return encoder.render(chat_history, add_generation_prompt)


def cut_at_stop(text: str, until: List[str]) -> str:
    """``text`` up to the first occurrence of any stop string in ``until``."""
    for stop in until:
        if stop:
            text = text.split(stop)[0]
    return text


def load_results(path: Path) -> dict:
    """The results JSON the harness wrote under ``path`` (its newest ``results_*.json``)."""
    files = sorted(Path(path).rglob("results_*.json"))
    if not files:
        raise ValueError(f"no results_*.json under {path}")
    return json.loads(files[-1].read_text())
