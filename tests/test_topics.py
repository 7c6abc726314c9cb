"""DoE Stage 1 (dagmoe_jax.families.doe.topics): LDA labels, token-word alignment, causal input
ids."""

from __future__ import annotations

import numpy as np
import pytest

from dagmoe_jax.data.tokenizers import ByteTokenizer
from dagmoe_jax.families.doe.topics import (TopicConfig, TopicModel, TopicTracker, fit_topics, piece_table,
                                    token_topics)

PLANTED = 4
WORDS = [[f"{theme}{i}x" for i in "abcdefghij"] for theme in ("ocean", "flame", "stone", "cloud")]


def planted_corpus(n_docs: int = 160, seed: int = 0):
    """Documents drawn from one planted topic each: (texts, planted topic of each)."""
    rng = np.random.default_rng(seed)
    docs, truth = [], []
    for d in range(n_docs):
        k = d % PLANTED
        docs.append(" ".join(WORDS[k][i] for i in rng.integers(0, 10, 40)) + ".")
        truth.append(k)
    return docs, truth


@pytest.fixture(scope="module")
def planted():
    docs, truth = planted_corpus()
    # Over-complete (8 topics for 4 planted themes): with exactly 4, LDA's variational fit
    # lands in a merged-topics local optimum for some seeds; purity is what labels must have.
    model = fit_topics(docs, 8, TopicConfig(max_iter=5, batch_size=32, seed=0))
    return docs, truth, model


def test_planted_topic_labels_are_pure(planted):
    docs, truth, model = planted
    pieces = piece_table(ByteTokenizer())
    labels, themes = [], []
    for doc, k in zip(docs, truth):
        _, lab = token_topics(model, list(doc.encode()) + [0], pieces)
        lab = lab[lab != model.null_id]
        labels.extend(lab)
        themes.extend([k] * len(lab))
    labels, themes = np.array(labels), np.array(themes)
    assert len(labels) > 1000
    purity = sum(np.bincount(themes[labels == c]).max() for c in np.unique(labels)) / len(labels)
    assert purity > 0.9


def test_alignment_null_ids_and_multibyte_pieces(planted):
    _, _, model = planted
    text = "The oceanax, 42 flamebx and stoneex! oceanbx"
    data = text.encode()
    byte_in, byte_lab = token_topics(model, list(data), piece_table(ByteTokenizer()))
    null = model.null_id
    # Non-words (punctuation, spaces, digits) and stop words ('the', 'and') get the null label.
    for i, ch in enumerate(text):
        word_char = ch.isalpha() or (ch.isalnum() and i and text[i - 1].isalpha())
        if not word_char or text[max(0, text.rfind(" ", 0, i) + 1):].lower().startswith(("the", "and")):
            assert byte_lab[i] == null, (i, ch)
    # Every byte of one word carries that word's label; vocabulary words get a real topic.
    for word in ("oceanax", "flamebx", "stoneex"):
        at = text.index(word)
        span = byte_lab[at:at + len(word)]
        assert len(set(span.tolist())) == 1 and span[0] != null
    # Multi-byte pieces: a token's label is the label of the word its bytes overlap.
    pieces = [bytes([i]) for i in range(256)] + [b"ocean", b"ax, 4", b"2 fl", b"amebx"]
    rest = data[len("The oceanax, 42 flamebx"):]
    ids = list(b"The ") + [256, 257, 258, 259] + list(rest)
    assert b"".join(pieces[i] for i in ids) == data
    _, lab = token_topics(model, ids, pieces)
    flame = byte_lab[text.index("flamebx")]
    assert lab[4] == byte_lab[text.index("oceanax")] and lab[5] == lab[4]   # 'ax, 4'
    assert lab[6] == flame and lab[7] == flame                              # '2 fl', 'amebx'
    np.testing.assert_array_equal(lab[8:], byte_lab[-len(rest):])


def test_input_ids_are_causal_and_tracked_incrementally(planted):
    docs, _, model = planted
    pieces = piece_table(ByteTokenizer())
    rng = np.random.default_rng(1)
    ids = list(docs[0].encode()) + [0]
    inputs, labels = token_topics(model, ids, pieces)
    assert (inputs != model.null_id).mean() > 0.8 and inputs[0] == model.null_id
    for t in rng.integers(1, len(ids) - 1, 6):
        other = ids[:t] + list(docs[1].encode())[:len(ids) - t]   # change token t and after
        changed, _ = token_topics(model, other, pieces)
        np.testing.assert_array_equal(changed[:t + 1], inputs[:t + 1])
    tracker, tracked = TopicTracker(model, pieces), []
    for tok in ids:
        tracked.append(tracker.next_id())
        tracker.push(tok)
    np.testing.assert_array_equal(tracked, inputs)


def test_artifact_round_trip(planted, tmp_path):
    docs, _, model = planted
    model.save(str(tmp_path / "topics"))
    loaded = TopicModel.load(str(tmp_path / "topics"))
    pieces = piece_table(ByteTokenizer())
    ids = list(docs[3].encode())
    for a, b in zip(token_topics(model, ids, pieces), token_topics(loaded, ids, pieces)):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError, match="incomplete"):
        TopicModel.load(str(tmp_path / "nothing"))
    with pytest.raises(ValueError, match="no words"):
        fit_topics(["12 34", "56"], 4)


def test_topic_config_validation():
    with pytest.raises(ValueError, match="TopicConfig.learning_decay"):
        TopicConfig(learning_decay=0.3)
    with pytest.raises(ValueError, match="TopicConfig.vocab_size"):
        TopicConfig(vocab_size=0)
