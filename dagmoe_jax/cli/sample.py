"""Sample continuations of prompts from a trained run's newest checkpoint.

    python -m dagmoe_jax.cli.sample --run_dir=runs/default --prompt="lis 3 1 4 1 5 ="
    python -m dagmoe_jax.cli.sample --run_dir=runs/default --prompt="edit abca acb =" \\
        --max_new_tokens 32 --temperature 0.8 --top_k 20 --top_p 0.9 --num_samples 4 --seed 0

Flags:
  --run_dir=DIR          a run directory written by train.py (its config.json and
                         checkpoints), or hf:FOLDER, a Hugging Face Llama folder
  --prompt=TEXT          the prompt (repeatable: several prompts are decoded as one batch)
  --max_new_tokens=N     tokens to generate per sample (default 32)
  --temperature=T        0 is greedy (the default); > 0 samples
  --top_k=K              sample among the K most likely tokens (default 0: all)
  --top_p=P              nucleus sampling: the smallest set of tokens with probability P (default 1)
  --num_samples=N        samples per prompt (default 1)
  --seed=S               PRNG seed (default 0): the same seed gives the same samples
  --ignore_eos           do not stop at the tokenizer's EOS
  --stop=TEXT            end a sample once its new text contains TEXT (lm-eval's stop-string
                         rule, decoding.generate.StopStrings), shown without it
                         (repeatable; decoding stops there, it does not run on to
                         --max_new_tokens)
  --no_eos_prefix        do not put EOS before the prompt (training records follow an EOS, so
                         by default the prompt starts as a record does; an hf: folder's
                         prompt starts as its tokenizer starts text, with its BOS or nothing,
                         as transformers' generate is given it)
  --chat                 the prompt is a user turn, rendered with the run's chat template as
                         fine-tuning rendered its data (the tokenizer's own template, or the
                         plain '### Instruction:' one), ending with the assistant's turn
                         header; decoding stops at the template's end of turn
  --system=TEXT          with --chat: a system message before the user turn
  --show_prompt          print each rendered prompt (its exact text) before its samples
  --tokenizer_path=FILE  read text with FILE, a copy of the tokenizer file the run recorded,
                         where that one cannot be found (another file is refused)

Prints one block per sample: the prompt followed by its continuation (EOS not shown); with
--chat, the assistant's answer alone, or "(the model ended its turn at once: no tokens)"
when its first token was the end of turn.
Exit status: 0 done, 2 invalid arguments, run directory or prompt (a one-line message).
"""

from __future__ import annotations

import sys

from dagmoe_jax.command_line import OneLineParser, quiet_background_errors, report_error
from dagmoe_jax.stopping import run_command


def sample_text(tokenizer, prompt_ids, new_ids) -> str:
    """The prompt and its continuation as one text, decoded together: a SentencePiece
    continuation that starts a word begins with the word-boundary piece, which decodes to a
    space only inside a text (decoded on its own, the space would be dropped)."""
    return tokenizer.decode(list(prompt_ids) + list(new_ids))


def cut_continuation(text: str, start: int, stops) -> str:
    """``text`` up to the first ``--stop`` string found at or after character ``start``."""
    ends = [i for i in (text.find(s, start) for s in stops) if i >= 0]
    return text[:min(ends)] if ends else text


EMPTY_TURN = "(the model ended its turn at once: no tokens)"


def tokenizer_prefix(tok) -> list:
    """The ids a Hugging Face tokenizer puts before any text (its post-processor's BOS, or
    none): what transformers' ``tokenizer(prompt)`` gives ``generate``, so that an ``hf:``
    folder sampled with defaults continues the prompt transformers would."""
    plain, special = tok.encode("a"), tok.encode("a", add_special_tokens=True)
    at = next((i for i in range(len(special)) if special[i:i + len(plain)] == plain), 0)
    return list(special[:at])


def shown_sample(tok, prompt, new, *, stops, stop_strings=(), prefix=(), chat=False,
                 ignore_eos=False) -> str:
    """The text a sample prints: the prompt (after ``prefix``) and its ``new`` ids, or with
    ``chat`` the answer alone (:data:`EMPTY_TURN` when the first new id ended the turn); a
    final stop id is not shown, and the text ends before the first of ``stop_strings``."""
    ended = not ignore_eos and bool(new) and new[-1] in stops
    if ended:
        new = new[:-1]
    if chat:
        if ended and not new:
            return EMPTY_TURN
        return cut_continuation(tok.decode(new), 0, stop_strings)
    start = len(tok.decode(prompt[len(prefix):]))
    return cut_continuation(sample_text(tok, prompt[len(prefix):], new), start, stop_strings)


def parse_args(argv):
    parser = OneLineParser(add_help=False)
    parser.add_argument("-h", "--help", action="store_true")
    parser.add_argument("--run_dir", default="")
    parser.add_argument("--prompt", action="append", default=[])
    parser.add_argument("--max_new_tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top_k", type=int, default=0)
    parser.add_argument("--top_p", type=float, default=1.0)
    parser.add_argument("--num_samples", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--ignore_eos", action="store_true")
    parser.add_argument("--stop", action="append", default=[])
    parser.add_argument("--no_eos_prefix", action="store_true")
    parser.add_argument("--chat", action="store_true")
    parser.add_argument("--system", default=None)
    parser.add_argument("--show_prompt", action="store_true")
    parser.add_argument("--tokenizer_path", default="")
    args = parser.parse_args(argv)
    if not args.help:
        if not args.run_dir:
            raise ValueError("--run_dir=DIR is required (a run directory written by train.py, "
                             "or hf:FOLDER)")
        if not args.prompt:
            raise ValueError("--prompt=TEXT is required")
        if args.num_samples < 1:
            raise ValueError(f"--num_samples={args.num_samples} is invalid: expected an "
                             f"integer >= 1")
        if "" in args.stop:
            raise ValueError("--stop= is empty: give the text that ends a sample")
        if args.system is not None and not args.chat:
            raise ValueError("--system needs --chat (a system message is a turn of the chat "
                             "template)")
    return args


def chat_prompt(encoder, prompt: str, system=None):
    """(ids, text) of ``prompt`` as a user turn (after ``system``'s, when given) followed by the
    assistant's turn header, tokenized piece by piece as fine-tuning tokenizes a conversation
    (:meth:`dagmoe_jax.data.chat.ChatEncoder.encode`), so the ids are those it trained on."""
    messages = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": prompt}]
    ids, _ = encoder.encode(messages)
    turns, text = encoder.render(messages), encoder.render(messages, add_generation_prompt=True)
    return ids + encoder.tokenizer.encode(text[len(turns):]), text


def main(argv=None) -> int:
    try:
        args = parse_args(sys.argv[1:] if argv is None else argv)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if args.help:
        print(__doc__)
        return 0

    # Imported after argument parsing so that --help and argument errors are instant.
    from dagmoe_jax.config.blocks import block_summary
    from dagmoe_jax.decoding.generate import StopStrings, check_settings, generate
    from dagmoe_jax.run.extensions import extension_for
    from dagmoe_jax.hf.run import is_hf, open_run

    quiet_background_errors()
    try:
        check_settings(args.max_new_tokens, args.temperature, args.top_k, args.top_p)
        run = open_run(args.run_dir, tokenizer_path=args.tokenizer_path,
                       log=lambda message: print(message, file=sys.stderr, flush=True))
        for message in run.warnings:
            print(f"warning: {message}", file=sys.stderr)
        tok = run.tokenizer
        stops = (tok.eos_id,)
        if args.chat:
            # pylint: disable-next=import-outside-toplevel
            from dagmoe_jax.data.instruct import chat_encoder
            encoder = chat_encoder(run.data_cfg, tok)
            rendered = [chat_prompt(encoder, p, args.system) for p in args.prompt]
            prefix, stops = [], tuple(dict.fromkeys((tok.eos_id, encoder.end_id)))
            texts = [text for _, text in rendered]
            prompts = [ids for ids, _ in rendered for _ in range(args.num_samples)]
        else:
            prefix = ([] if args.no_eos_prefix else
                      tokenizer_prefix(tok) if is_hf(args.run_dir) else [tok.eos_id])
            texts = list(args.prompt)
            prompts = [prefix + tok.encode(p) for p in args.prompt
                       for _ in range(args.num_samples)]
        longest = max(len(p) for p in prompts)
        if longest > run.model_cfg.max_seq_len:
            with_eos = (" (with its EOS prefix)" if prefix == [tok.eos_id] else
                        " (with its BOS)" if prefix else "")
            raise ValueError(f"the prompt is {longest} tokens long{with_eos} but the model's "
                             f"max_seq_len is {run.model_cfg.max_seq_len}: shorten it")
        print(f"run {args.run_dir} at step {run.step}: {block_summary(run.model_cfg.block)}, "
              f"{run.data_cfg.tokenizer} tokenizer",
              file=sys.stderr, flush=True)
        features = extension_for(run.model_cfg).decoding_features(args.run_dir, run.data_cfg,
                                                                  tok)
        outputs = generate(run.model, prompts, max_new_tokens=args.max_new_tokens,
                           temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                           stop_tokens=() if args.ignore_eos else stops, seed=args.seed,
                           pad_id=tok.pad_id, features=features,
                           stop_when=StopStrings(args.stop, tok) if args.stop else None)
    except (ValueError, FileNotFoundError) as err:
        return report_error(err)
    for i, (prompt, new) in enumerate(zip(prompts, outputs)):
        if args.show_prompt and i % args.num_samples == 0:
            print(f"--- prompt {i // args.num_samples} ---\n{texts[i // args.num_samples]}",
                  flush=True)
        text = shown_sample(tok, prompt, new, stops=stops, stop_strings=args.stop,
                            prefix=prefix, chat=args.chat, ignore_eos=args.ignore_eos)
        print(f"--- sample {i} ---\n{text.rstrip(chr(10))}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(run_command(main))
