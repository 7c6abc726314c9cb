"""Per-token topic ids (the model's second input) and expert labels (L_expert's targets).

Tokens and words are aligned through bytes: a token's text is its *piece* (its id decoded alone,
:meth:`~dagmoe_jax.data.tokenizers.Tokenizer.piece_bytes`), a record's text is the concatenation
of its tokens' pieces, and the words (:func:`~dagmoe_jax.families.doe.topics.lda.word_spans`) are
found in that text. Everything is therefore a function of the token ids alone, the same in training
and in generation. A token belongs to the word its bytes overlap (the last such word if several).

* **Expert label** (DoE sec. 3.2, Appendix A.2): ``y_t = argmax_k theta_(d,k) beta_(k,w_t)``
  for the word w_t of token t, with theta_d the LDA posterior of the whole record (a target may
  see the whole document). Tokens of no vocabulary word get ``null_id`` = K, masked out of
  L_expert.
* **Input topic id** (DoE Algorithm 1's ``topic_ids``), **causal**: it may use only the text of
  tokens strictly before t (theta of the whole document would leak the future into the input).
  A word counts once it is *complete*, i.e. the non-word byte that ends it lies before token t.
  With ``u`` the last complete vocabulary word before t,
  ``id_t = argmax_k theta^(<t)_k beta_(k,u)``, where
  ``theta^(<t) = alpha + sum over complete vocabulary words v before t of r(v)`` and
  ``r(v)_k = beta_(k,v) / sum_j beta_(j,v)`` (one mean-field step of LDA's E-step from a flat
  document: it accumulates word by word, so generation tracks it incrementally in O(K) per
  word, where re-running the full E-step on every prefix would cost O(t) per token). Before
  the first complete vocabulary word the id is ``null_id`` (which has its own embedding).
  This is our reading (docs/design.md section 6): the paper feeds "per-token topic
  assignments" without saying how they avoid the future.
"""

from __future__ import annotations

from typing import List, Sequence, Tuple

import numpy as np

from dagmoe_jax.families.doe.topics.lda import WORD_PATTERN, TopicModel, word_spans


def piece_table(tokenizer) -> List[bytes]:
    """Each token id's bytes (``tokenizer.piece_bytes()``), the alignment's vocabulary."""
    return list(tokenizer.piece_bytes())


def _pieces(ids: Sequence[int], pieces: Sequence[bytes]) -> List[bytes]:
    n = len(pieces)
    return [pieces[i] if 0 <= i < n else b"" for i in (int(t) for t in ids)]


def token_topics(model: TopicModel, ids: Sequence[int],
                 pieces: Sequence[bytes]) -> Tuple[np.ndarray, np.ndarray]:
    """(input topic ids, expert labels), int32 [len(ids)] each, for one record's tokens.

    See the module docstring: inputs are causal (text before t only), labels use the record's
    whole-document theta. Both are ``model.null_id`` outside vocabulary words.
    """
    chunks = _pieces(ids, pieces)
    n, null = len(chunks), model.null_id
    inputs = np.full(n, null, np.int32)
    labels = np.full(n, null, np.int32)
    lengths = np.fromiter((len(c) for c in chunks), np.int64, n)
    ends = np.cumsum(lengths)
    starts = ends - lengths
    data = b"".join(chunks)
    spans = word_spans(data)
    if not spans:
        return inputs, labels
    w_start = np.array([s for s, _, _ in spans])
    w_end = np.array([e for _, e, _ in spans])
    w_idx = np.array([model.index.get(w, -1) for _, _, w in spans])
    known = w_idx >= 0
    if not known.any():
        return inputs, labels
    beta = model.beta

    # Labels: y = argmax_k theta_(d,k) beta_(k,w), theta from the whole record.
    theta = model.theta_of_words(w_idx[known])                     # the words found above
    word_label = np.full(len(spans), null, np.int32)
    word_label[known] = np.argmax(theta[None, :] * beta[:, w_idx[known]].T, axis=1)
    j = np.searchsorted(w_start, ends, side="left") - 1          # last word starting before end_t
    inside = (j >= 0) & (lengths > 0)
    inside[inside] &= w_end[j[inside]] > starts[inside]
    labels[inside] = word_label[j[inside]]

    # Inputs: complete words before t are those whose delimiter byte (at w_end) precedes start_t.
    m = np.searchsorted(w_end, starts, side="left")               # words with w_end < start_t
    r = np.where(known[:, None], model.responsibility[np.maximum(w_idx, 0)], 0.0)
    running = np.concatenate([np.zeros((1, model.num_topics)), np.cumsum(r, axis=0)])
    last_known = np.concatenate([[-1], np.maximum.accumulate(np.where(known, np.arange(len(spans)), -1))])
    u = last_known[m]
    ok = u >= 0
    if ok.any():
        theta_prefix = model.doc_topic_prior + running[m[ok]]
        inputs[ok] = np.argmax(theta_prefix * beta[:, w_idx[u[ok]]].T, axis=1)
    return inputs, labels


class TopicTracker:
    """The causal input topic ids of :func:`token_topics`, one token at a time (generation).

    ``next_id()`` is the input topic id of the position after the tokens pushed so far; ``push``
    appends a token. For any token sequence the ids equal ``token_topics(...)[0]``.
    """

    def __init__(self, model: TopicModel, pieces: Sequence[bytes]):
        self.model, self.pieces = model, list(pieces)
        self.data = b""
        self.scan_from = 0          # end of the last complete word (or 0): words start after it
        self.running = np.zeros(model.num_topics)
        self.last_word = -1

    def push(self, token: int) -> None:
        """Append ``token``'s bytes and account for the words they complete."""
        self.data += _pieces([token], self.pieces)[0]
        for match in WORD_PATTERN.finditer(self.data, self.scan_from):
            if match.end() >= len(self.data):       # no delimiter yet: may continue
                break
            self.scan_from = match.end()
            w = self.model.index.get(match.group().decode("ascii").lower())
            if w is not None:
                self.running += self.model.responsibility[w]
                self.last_word = w

    def next_id(self) -> int:
        if self.last_word < 0:
            return self.model.null_id
        theta = self.model.doc_topic_prior + self.running
        return int(np.argmax(theta * self.model.beta[:, self.last_word]))
