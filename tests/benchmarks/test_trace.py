"""Trace replay in `bench serve`: a JSONL trace in the public Mooncake format (our own
synthetic one, benchmarks/traces/) becomes token-id prompts in which equal hash ids are
equal blocks, scaled as asked, sent at the trace's (compressed) times."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.datasets import LOW_TOKEN_ID, load_samples, read_trace, trace_dataset
from benchmarks.serve import arrivals, build_parser, main

TRACE = Path(__file__).parents[2] / "benchmarks" / "traces" / "mooncake_synthetic.jsonl"


def test_the_synthetic_trace_reads_as_mooncake_records() -> None:
    records = read_trace(TRACE)
    assert len(records) == 48
    assert all(r.hash_ids and (len(r.hash_ids) - 1) * 512 < r.input_length <= len(r.hash_ids) * 512
               for r in records)
    assert sum(r.hash_ids[:2] == [0, 1] for r in records) == 40  # every conversation's turn shares the system blocks


def test_equal_hash_ids_are_equal_blocks_and_lengths_scale(tmp_path: Path) -> None:
    lines = [{"timestamp": 1000, "input_length": 100, "output_length": 50, "hash_ids": [7, 8, 9, 10]},
             {"timestamp": 1500, "input_length": 70, "output_length": 10, "hash_ids": [7, 8, 11],
              "note": "fields a trace adds are ignored"},
             {"timestamp": 3000, "input_length": 40, "output_length": 1, "hash_ids": [12, 13]},
             {"timestamp": 1200, "input_length": 90, "output_length": 0}]  # no hash ids: all its own
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines) + "\n")
    samples = trace_dataset(path, 10, block_tokens=32, scale_tokens=0.5, scale_output=0.1, time_scale=0.5,
                            vocab_size=4096, seed=3)
    first, own, second, third = samples  # in arrival order
    assert [s.arrival for s in samples] == pytest.approx([0.0, 0.1, 0.25, 1.0])
    assert [(s.prompt_len, len(s.prompt), s.output_len) for s in samples] == [
        (50, 50, 5), (45, 45, 1), (35, 35, 1), (20, 20, 1)]
    assert second.prompt[:32] == first.prompt[:32]  # hash ids 7 and 8: two blocks of 32 x 0.5 tokens
    assert second.prompt[32:35] != first.prompt[32:35]  # 11 against 9
    assert third.prompt[:16] != first.prompt[:16] and own.prompt[:16] != first.prompt[:16]
    assert all(LOW_TOKEN_ID <= t < 4096 for s in samples for t in s.prompt)
    again = trace_dataset(path, 10, 32, 0.5, 0.1, 0.5, 4096, seed=3)
    assert [s.prompt for s in again] == [s.prompt for s in samples]
    head = trace_dataset(path, 2, 32, 0.5, 0.1, 0.5, 4096, seed=3)  # the first two lines of the file
    assert [s.arrival for s in head] == pytest.approx([0.0, 0.25]) and head[1].prompt[:32] == first.prompt[:32]


def test_an_excerpt_of_whole_conversations(tmp_path: Path) -> None:
    """--trace-conversations takes every turn of the first conversations (first two hash ids
    equal) that fit, passing over one that would overflow; with --request-rate the samples
    carry no times of their own (sent at that rate, in the trace's order)."""
    lines = [{"timestamp": 0, "input_length": 30, "output_length": 5, "hash_ids": [0, 1]},
             {"timestamp": 1000, "input_length": 30, "output_length": 5, "hash_ids": [0, 2]},
             {"timestamp": 2000, "input_length": 30, "output_length": 5, "hash_ids": [0, 3]},
             {"timestamp": 5000, "input_length": 50, "output_length": 5, "hash_ids": [0, 1, 4]},
             {"timestamp": 6000, "input_length": 50, "output_length": 5, "hash_ids": [0, 2, 5]},
             {"timestamp": 7000, "input_length": 70, "output_length": 5, "hash_ids": [0, 2, 5, 6]},
             {"timestamp": 9000, "input_length": 70, "output_length": 5, "hash_ids": [0, 1, 4, 7]}]
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    samples = trace_dataset(path, 4, 16, 1.0, 1.0, 0.5, 4096, seed=1, conversations=True)
    # conversation [0, 1] (3 turns) fits; [0, 2] (3 more) would not; [0, 3] (1) does
    assert [s.prompt_len for s in samples] == [30, 30, 50, 70]
    assert samples[2].prompt[:30] == samples[0].prompt and samples[3].prompt[:48] == samples[2].prompt[:48]
    assert [s.arrival for s in samples] == pytest.approx([0.0, 1.0, 2.5, 4.5])
    first_lines = trace_dataset(path, 4, 16, 1.0, 1.0, 0.5, 4096, seed=1)
    assert [s.prompt_len for s in first_lines] == [30, 30, 30, 50]  # without: the first four lines
    at_a_rate = trace_dataset(path, 4, 16, 1.0, 1.0, 0.5, 4096, seed=1, conversations=True, own_times=False)
    assert [s.prompt for s in at_a_rate] == [s.prompt for s in samples] and {s.arrival for s in at_a_rate} == {None}
    args = build_parser().parse_args(["--base-url", "http://x", "--dataset", "trace", "--dataset-path", str(path),
                                      "--num-prompts", "4", "--trace-conversations", "--request-rate", "2"])
    assert [s.arrival for s in load_samples(args)] == [None] * 4
    offsets = arrivals(load_samples(args), args)
    assert offsets[0] >= 0 and offsets == sorted(offsets) and offsets[-1] > 0  # drawn at 2 a second


@pytest.mark.parametrize("line, why", [('{"timestamp": 0, "input_length": 0, "output_length": 1}', "input_length"),
                                       ('{"timestamp": 0, "output_length": 1}', "input_length"),
                                       ("not json", "line 2")])
def test_a_line_that_is_not_a_record_is_named(tmp_path: Path, line: str, why: str) -> None:
    path = tmp_path / "trace.jsonl"
    path.write_text('{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [1]}\n' + line + "\n")
    with pytest.raises(ValueError, match=why):
        read_trace(path)


def test_a_replay_is_sent_at_the_trace_times_and_shares_its_blocks(colocated, tmp_path: Path) -> None:
    """16 requests of the synthetic trace against a real server, 5x faster than recorded,
    lengths / 16: every request completes, none is sent before its time, the last ones
    well after the first (open loop, not all at once), and the server's prefix cache
    hits the blocks the trace's hash ids share."""
    server = colocated["qwen3"]
    out = tmp_path / "result.json"
    main(["--base-url", server.url, "--dataset", "trace", "--dataset-path", str(TRACE), "--num-prompts", "16",
          "--trace-scale-tokens", "0.0625", "--trace-scale-output", "0.02", "--trace-time-scale", "0.2",
          "--ignore-eos", "--max-concurrency", "16", "--result-file", str(out)])
    result = json.loads(out.read_text())
    expected = trace_dataset(TRACE, 16, 512, 0.0625, 0.02, 0.2, 4096, seed=0)
    assert (result["metrics"]["completed"], result["metrics"]["failed"]) == (16, 0)
    for request, sample in zip(result["requests"], expected):
        assert request["start"] >= sample.arrival - 0.01
        assert (request["prompt_len"], request["output_len"]) == (sample.prompt_len, sample.output_len)
    assert expected[-1].arrival > 1.0 and result["requests"][-1]["start"] >= expected[-1].arrival - 0.01
    assert result["server_metrics"]["prefix_cache"]["hits"] > 0
