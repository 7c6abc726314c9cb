"""The report of :mod:`experiments.dume_reasoning`: DUME's Table 3 in miniature.

Rows in the paper's order (:data:`ROWS`), a column per domain and task (MC: acc, gen: exact
match), and the paper's normalised average: each score divided by the score of that domain's
own expert on it, averaged over the domain's tasks, then over domains (a domain task whose
expert scored 0 has no ratio and is left out of that seed's average). The "oracle (diagonal)"
row is each domain scored by its own expert (100% by construction); "oracle (forced)" is the
paper's Oracle, the merged model with every layer forced to the domain's expert. Every cell is
the mean ± std over seeds; :data:`ORDERINGS` are the paper's claims, each checked as a
seed-paired difference of the normalised average.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence

from benchmarks.experiments.scoring import mean_std, paired_difference

TRAINED = ("DUME+", "BTX", "upcycled DAG")
MERGED = ("averaging", "oracle (diagonal)", "oracle (forced)", "random routing k1",
          "DUME k1 (prompts)", "DUME k1 (stream)", "DUME k2") + TRAINED

# (a, b): the paper has a >= b (DUME Tables 2 and 3; the stream reading is ours)
ORDERINGS = (("DUME k1 (prompts)", "averaging"), ("DUME k1 (prompts)", "random routing k1"),
             ("DUME+", "DUME k2"), ("DUME k1 (prompts)", "BTX"), ("DUME+", "BTX"),
             ("oracle (forced)", "DUME k1 (prompts)"),
             ("DUME k1 (prompts)", "DUME k1 (stream)"), ("upcycled DAG", "DUME k2"))


def rows(domains: Sequence[str]) -> List[str]:
    """Every row of the table, in order: the experts, then the merged and baseline models."""
    return [f"expert {d}" for d in domains] + list(MERGED)


def with_diagonal(records: List[dict], domains: Sequence[str],
                  columns: Sequence[str]) -> List[dict]:
    """``records`` plus, per seed, the "oracle (diagonal)" record: each column from its own
    domain's expert."""
    out = list(records)
    for seed in sorted({r["seed"] for r in records}):
        by = {r["model"]: r for r in records if r["seed"] == seed}
        if all(f"expert {d}" in by for d in domains):
            out.append({"model": "oracle (diagonal)", "seed": seed,
                        **{c: by[f"expert {c.split()[0]}"][c] for c in columns}})
    return out


def normalised(records: List[dict], domains: Sequence[str], columns: Sequence[str]
               ) -> Dict[str, Dict[int, Dict[str, float]]]:
    """``{model: {seed: {domain: ratio, ..., 'average': ratio}}}``: each score over the domain
    expert's score on the same task (seed by seed), averaged over the domain's tasks with a
    nonzero expert score, then over domains."""
    out: Dict[str, Dict[int, Dict[str, float]]] = {}
    for seed in sorted({r["seed"] for r in records}):
        by = {r["model"]: r for r in records if r["seed"] == seed}
        for model, record in by.items():
            per: Dict[str, float] = {}
            for d in domains:
                expert = by.get(f"expert {d}", {})
                ratios = [record[c] / expert[c] for c in columns
                          if c.split()[0] == d and c in record and expert.get(c)]
                if ratios:
                    per[d] = sum(ratios) / len(ratios)
            if per:
                per["average"] = sum(per.values()) / len(per)
                out.setdefault(model, {})[seed] = per
    return out


def _cell(values: Sequence[float], scale: float = 1.0, digits: int = 3) -> str:
    """``mean ± std`` of ``scale * values`` ('n/a' for none)."""
    if not values:
        return "n/a"
    mean, std = mean_std([scale * v for v in values])
    return f"{mean:.{digits}f} ± {std:.{digits}f}"


def ordering_lines(norm: Dict[str, Dict[int, Dict[str, float]]]) -> List[str]:
    """One line per paper ordering a >= b: the seed-paired difference of the normalised
    average in points, and whether it is beyond the seed spread (a paired t-test at 5%)."""
    lines = []
    for a, b in ORDERINGS:
        if a not in norm or b not in norm:
            continue
        p = paired_difference({s: 100 * v["average"] for s, v in norm[a].items()},
                              {s: 100 * v["average"] for s, v in norm[b].items()})
        if not p["seeds"]:
            continue
        verdict = ("inside the seed spread" if not p["beyond_spread"] else
                   "holds" if p["mean"] > 0 else "reversed")
        lines.append(f"* {a} - {b}: {p['mean']:+.1f} ± {p['std']:.1f} points over "
                     f"{p['seeds']} seeds: {verdict}")
    return lines


def format_report(results: dict, domains: Optional[Sequence[str]] = None) -> str:
    """The raw-score table with its normalised-average column, the normalised table per domain,
    and the paper's orderings."""
    columns = list(results["columns"])
    domains = list(domains or results["domains"])
    records = with_diagonal(results["records"], domains, columns)
    norm = normalised(records, domains, columns)
    seeds = sorted({r["seed"] for r in records})
    lines = [f"DUME's Table 3 in miniature ({len(seeds)} seeds): {len(domains)} dense experts "
             f"fine-tuned from one pre-trained model, saved in Hugging Face format and merged; "
             f"routers solved from each domain's prompts (the authors' reading) unless "
             f"'(stream)' ({results['stats_batches']} batches of packed chat-formatted "
             f"conversations); DUME+, BTX and the DAG trained {results['router_steps']} steps "
             f"at lr {results['router_lr']:g} on the mixed domains (routers, resp. DAG "
             f"aggregator, only). MC: acc, gen: exact match; norm. avg: % of each domain "
             f"expert's own score:", "",
             "| model | " + " | ".join(columns) + " | norm. avg |",
             "|---|" + "---|" * (len(columns) + 1)]
    for model in rows(domains):
        found = [r for r in records if r["model"] == model]
        if not found:
            continue
        cells = [_cell([r[c] for r in found if c in r]) for c in columns]
        average = [v["average"] for v in norm.get(model, {}).values()]
        lines.append(f"| {model} | " + " | ".join(cells) + f" | {_cell(average, 100, 1)} |")
    lines += ["", "Normalised per domain (% of the domain's own expert, its tasks averaged):",
              "", "| model | " + " | ".join(domains) + " | average |",
              "|---|" + "---|" * (len(domains) + 1)]
    for model in rows(domains):
        if model in norm:
            per = norm[model].values()
            lines.append(f"| {model} | " + " | ".join(
                _cell([v[d] for v in per if d in v], 100, 1) for d in domains + ["average"])
                + " |")
    orderings = ordering_lines(norm)
    if orderings:
        lines += ["", "The paper's orderings (a >= b), seed-paired differences of the "
                      "normalised average:", *orderings]
    return "\n".join(lines)
