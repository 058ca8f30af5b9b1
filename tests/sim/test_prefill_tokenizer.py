"""The project's byte-level BPE tokenizer."""

from __future__ import annotations

import pytest

pytest.importorskip("tokenizers")

from bench.workloads.tokenizer import count_tokens, count_tokens_batch, encode, load_tokenizer  # noqa: E402

PROSE = (
    "The company reported quarterly revenue of $4.2 billion, an increase of 12 percent "
    "compared with the same period last year, driven by strong demand in its cloud "
    "services segment. Operating expenses rose as the firm continued to invest in research "
    "and development, while net income was affected by a one-time restructuring charge."
)


def test_prose_is_about_four_characters_per_token() -> None:
    n = count_tokens(PROSE)
    assert 3.3 <= len(PROSE) / n <= 5.5


def test_byte_level_round_trip_of_any_text() -> None:
    text = "naïve café – 数据 🚀 \t tabs"
    assert load_tokenizer().decode(encode(text)) == text


def test_batch_counts_match_single_counts() -> None:
    texts = [PROSE, "", "x"]
    assert count_tokens_batch(texts) == [count_tokens(t) for t in texts]
    assert count_tokens("") == 0
