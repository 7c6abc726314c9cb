"""Fit DoE's Stage 1 (online LDA) ahead of training and save it for ``DataConfig.topics_dir``
(``dagmoe-topics``, or ``python -m dagmoe_jax.families.doe.command``).

    dagmoe-topics --gin_file=train/doe_smoke.gin \\
        --gin.DataConfig.source="'text:notes/*.txt'" --out=topics/notes --max_documents=50000

The training documents and K (``DoEConfig.num_topics``) come from the gin files and bindings, as
for ``train.py``; the flags set the LDA fit
(:class:`~dagmoe_jax.families.doe.topics.TopicConfig`): --vocab_size, --min_df,
--max_documents, --max_iter, --batch_size, --seed. Prints each topic's top words. Exit status:
0 done, 2 invalid arguments or data (a one-line message).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

from dagmoe_jax.command_line import (USER_ERRORS, OneLineParser, gin_flag_bindings,
                                     report_error)
from dagmoe_jax.stopping import (output_complete, remove_on_stop, run_command,
                                 set_stop_message)


def main(argv=None) -> int:
    # pylint: disable=import-outside-toplevel
    from dagmoe_jax.families.doe.topics.lda import TopicConfig

    parser = OneLineParser(description=__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gin_file", action="append", default=[])
    parser.add_argument("--out", required=True, help="directory to save the topic model in")
    for field in dataclasses.fields(TopicConfig):
        if field.name in ("vocab_size", "min_df", "max_documents", "max_iter", "batch_size",
                          "seed"):
            parser.add_argument(f"--{field.name}", type=int, default=field.default)
    try:
        args, rest = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    except ValueError as err:
        return report_error(err)
    bindings, unknown = gin_flag_bindings(rest)
    if unknown:
        return report_error(ValueError(f"unknown argument {unknown[0]!r}"))
    try:
        # pylint: disable=import-outside-toplevel
        from dagmoe_jax.run.gin import load_configs
        from dagmoe_jax.families.doe.topics.lda import fit_topics
        from dagmoe_jax.families.doe.topics.stage import training_documents

        model_cfg, data_cfg, _, _ = load_configs(args.gin_file, bindings)
        cfg = TopicConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(TopicConfig)
                             if hasattr(args, f.name)})
        docs = training_documents(data_cfg, cfg.max_documents)
        print(f"fitting online LDA: {model_cfg.block.num_topics} topics on {len(docs)} documents",
              flush=True)
        model = fit_topics(docs, model_cfg.block.num_topics, cfg)
        from dagmoe_jax.run.paths import partial_path, staged_directory
        set_stop_message(f"nothing was written at {args.out}")
        remove_on_stop(args.out)
        remove_on_stop(partial_path(args.out, merge=True))
        with staged_directory(args.out, merge=True) as stage:   # moved there when complete
            model.save(str(stage))
        output_complete()
    except USER_ERRORS as err:
        return report_error(err)
    for k, words in enumerate(model.top_words(8)):
        print(f"topic {k:>3}: {' '.join(words)}")
    print(f"saved to {args.out} (train with --gin.DataConfig.topics_dir=\"'{args.out}'\")")
    return 0


if __name__ == "__main__":
    sys.exit(run_command(main))
