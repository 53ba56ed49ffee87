"""benchmarks/gguf_parity.py: llama-perplexity's logits file read as llama.cpp writes it,
and the agreement and perplexities computed from it (llama.cpp itself is not built here)."""

from __future__ import annotations

import numpy as np
import pytest

from benchmarks.gguf_parity import LlamaLogprobs, compare, self_agreement


def write_logits_file(path, logprobs: np.ndarray, tokens: np.ndarray) -> None:
    """logprobs (chunks, n_ctx - 1 - first, vocab) as perplexity.cpp's `log_softmax` stores
    them: per position the scale and the least kept log-prob as two floats, then each
    entry above it as round((logprob - least) / scale), 0 below (16 nats under the top)."""
    chunks, positions, vocab = logprobs.shape
    n_ctx = tokens.shape[1]
    width = 2 * ((vocab + 1) // 2) + 4
    rows = np.zeros((chunks, positions, width), dtype=np.uint16)
    for c in range(chunks):
        for i in range(positions):
            row = logprobs[c, i].astype(np.float32)
            least = max(row.min(), row.max() - 16)
            scale = np.float32((row.max() - least) / 65535)
            rows[c, i, :4] = np.array([scale, least], dtype=np.float32).view(np.uint16)
            rows[c, i, 4:4 + vocab] = np.where(row > least, np.rint((row - least) / scale), 0)
    header = np.array([n_ctx, vocab, chunks], dtype=np.int32).tobytes()
    path.write_bytes(b"_logits_" + header + tokens.astype(np.int32).tobytes() + rows.tobytes())


@pytest.fixture
def llama(tmp_path) -> tuple[LlamaLogprobs, np.ndarray]:
    rng = np.random.default_rng(0)
    n_ctx, vocab, chunks = 16, 11, 2
    logits = rng.standard_normal((chunks, n_ctx // 2 - 1, vocab)) * 3
    logprobs = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    tokens = rng.integers(0, vocab, (chunks, n_ctx))
    write_logits_file(tmp_path / "l.kld", logprobs, tokens)
    return LlamaLogprobs(tmp_path / "l.kld"), logprobs


def test_the_logits_file_is_read_as_llama_perplexity_writes_it(llama) -> None:
    parsed, logprobs = llama
    assert (parsed.n_ctx, parsed.n_vocab, parsed.n_chunk, parsed.first) == (16, 11, 2, 8)
    nexts = parsed.tokens[1, parsed.first + 1:]
    expected = logprobs[1, np.arange(len(nexts)), nexts]
    assert parsed.logprob(1, nexts) == pytest.approx(expected, abs=16 / 65535)
    assert (parsed.scored(0)[0].argmax(1) == logprobs[0].argmax(1)).all()
    assert self_agreement(parsed, parsed) == 1.0


def test_agreement_and_perplexities_are_counted_over_the_scored_positions(llama) -> None:
    parsed, logprobs = llama
    ours = []
    for c in range(2):
        top1 = logprobs[c].argmax(1)
        nexts = parsed.tokens[c, parsed.first + 1:]
        ours.append((top1, logprobs[c, np.arange(len(nexts)), nexts]))
    ours[0][0][0] = (ours[0][0][0] + 1) % 11  # one position picks another token
    result = compare(parsed, ours)
    assert result["positions"] == 14 and result["disagreements"] == 1
    assert result["top1_agreement"] == pytest.approx(13 / 14)
    assert result["perplexity_ours"] == pytest.approx(result["perplexity_llama_from_file"], rel=1e-3)
    assert result["mean_abs_logprob_diff"] < 1e-3
