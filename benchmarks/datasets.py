"""Request datasets for the serving benchmark.

A dataset is a list of `SampleRequest`s: a prompt (token ids or text), its length in
tokens, and how many tokens to ask for. Five kinds:

- `random`: prompts of exactly `--random-input-len` random token ids in
  [`LOW_TOKEN_ID`, `--vocab-size`), the first `--random-prefix-len` of them shared by every
  prompt. (vLLM's `random` puts the prefix *in front of* `input_len` ids; here the prefix
  counts towards `--random-input-len`, so the prompt length is what the flag says.)
- `prefix-repetition`: `--prefix-repetition-num-prefixes` random prefixes, each shared by
  about `num_prompts / num_prefixes` prompts that differ in a random suffix; the prompts
  are shuffled so that the groups interleave.
- `multi-turn`: conversations behind one shared system prompt of
  `--multi-turn-system-len` ids; turn k+1's prompt is turn k's, then an answer of
  `--multi-turn-answer-len` ids standing for the model's reply, then a new user message of
  `--multi-turn-user-len` ids. `num_prompts // --multi-turn-turns` conversations; every
  conversation's turn k is sent before any turn k+1 (the conversations in a random order
  each turn), so with more conversations than requests in flight a turn finds the last
  one's blocks cached (on the server that prefilled it). `--multi-turn-loop closed`
  sends as a chat client does instead: each conversation's next turn once its last is
  answered, with the model's own answer in its history (`serve.run_conversations`).
- `trace`: a JSONL trace in the public Mooncake format, replayed at its own times (below).
- `sharegpt`: a ShareGPT JSON file (a list of `{"conversations": [{"from": "human",
  "value": ...}, {"from": "gpt", "value": ...}, ...]}`); the first turn is the prompt
  text and the second turn's length sets the output length. Without a tokenizer, lengths
  are *estimated* as `round(chars / 4)` tokens (roughly English BPE); the benchmark reports
  the server's own token counts (usage) for what was actually sent and generated.

Token-id prompts go to `/v1/completions` as `prompt: [ids]`, so their lengths are exact
with no tokenizer on the client. The chat endpoint needs text: `ids_to_text` spells each
id as one made-up word ("ka", "zomi", ...). The server's tokenizer splits those words its
own way, so a chat prompt's token count only approximates the id count (usage reports
the real one), and a shared id prefix becomes a shared text prefix.

All datasets are deterministic given `--seed`.

Trace replay (`--dataset trace --dataset-path FILE`). Each line of the trace is one
request: `timestamp` (milliseconds from the trace's start), `input_length` and
`output_length` (tokens), and `hash_ids`, one id per block of `--trace-block-tokens` prompt
tokens (512 in the published traces), equal ids meaning equal token blocks: a shared
system prompt, a document, the earlier turns of a conversation. Other fields are
ignored, so published traces are read unchanged. Every hash id gets one random block of
ids (seeded, made the first time the id appears); a prompt is its blocks in order, cut
to its length, and tokens past what its ids cover are fresh random ids.
`--trace-scale-tokens` scales every length and the block size with it (so shared blocks
stay shared), `--trace-scale-output` the output lengths, `--trace-time-scale` the gaps
between arrivals (0.1: ten times faster). Requests are sent at their arrival times
(open loop; `--max-concurrency` still bounds what is in flight), unless `--request-rate`
is given: then in the trace's order at that rate (`--burstiness` as for the other datasets).
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import msgspec
import numpy as np

DATASETS = ("random", "prefix-repetition", "multi-turn", "trace", "sharegpt")
MULTI_TURN_LOOPS = ("open", "closed")
# Ids below this are left out of random prompts: most vocabularies put special tokens
# (pad, bos, eos, unk) at the lowest ids.
LOW_TOKEN_ID = 10
CHARS_PER_TOKEN = 4
_CONSONANTS = "bdfgklmnprstvz"
_VOWELS = "aeiou"
_SYLLABLES = [c + v for c in _CONSONANTS for v in _VOWELS]


@dataclass(frozen=True)
class SampleRequest:
    """One request to send. `prompt_len` is exact for id prompts, estimated for text."""

    prompt: str | list[int]
    prompt_len: int
    output_len: int
    arrival: float | None = None  # seconds after the run's start (a trace's); None: sent at --request-rate
    turn: int = 0  # multi-turn: which turn of its conversation (0: the first)
    conversation: int = 0  # multi-turn: which conversation
    message: list[int] | None = None  # multi-turn: this turn's new user message (the end of `prompt`)

    def text(self) -> str:
        """The prompt as text (ids spelled as words, see `ids_to_text`)."""
        return self.prompt if isinstance(self.prompt, str) else ids_to_text(self.prompt)


def ids_to_text(ids: list[int]) -> str:
    """Spell each token id as a distinct pronounceable word (injective, deterministic)."""
    return " ".join(_id_to_word(i) for i in ids)


def _id_to_word(token_id: int) -> str:
    digits = []
    while True:
        token_id, digit = divmod(token_id, len(_SYLLABLES))
        digits.append(_SYLLABLES[digit])
        if token_id == 0:
            return "".join(reversed(digits))


def _random_ids(rng: np.random.Generator, n: int, vocab_size: int, low: int) -> list[int]:
    return rng.integers(low, vocab_size, size=n).tolist()


def random_dataset(num_prompts: int, input_len: int, output_len: int, prefix_len: int,
                   vocab_size: int, seed: int, low: int = LOW_TOKEN_ID) -> list[SampleRequest]:
    """Prompts of exactly `input_len` ids whose first `prefix_len` ids are shared."""
    if not 0 <= prefix_len <= input_len:
        raise ValueError(f"random prefix len {prefix_len} must be in [0, input len {input_len}]")
    if not 0 <= low < vocab_size:
        raise ValueError(f"vocab size {vocab_size} must exceed the lowest token id {low}")
    rng = np.random.default_rng(seed)
    prefix = _random_ids(rng, prefix_len, vocab_size, low)
    return [SampleRequest(prefix + _random_ids(rng, input_len - prefix_len, vocab_size, low),
                          input_len, output_len) for _ in range(num_prompts)]


def prefix_repetition_dataset(num_prompts: int, prefix_len: int, suffix_len: int,
                              num_prefixes: int, output_len: int, vocab_size: int, seed: int,
                              low: int = LOW_TOKEN_ID) -> list[SampleRequest]:
    """`num_prompts` prompts, prompt i built on prefix i % num_prefixes, then shuffled."""
    if num_prefixes < 1:
        raise ValueError("need at least one prefix")
    rng = np.random.default_rng(seed)
    prefixes = [_random_ids(rng, prefix_len, vocab_size, low) for _ in range(num_prefixes)]
    samples = [SampleRequest(prefixes[i % num_prefixes] + _random_ids(rng, suffix_len, vocab_size, low),
                             prefix_len + suffix_len, output_len) for i in range(num_prompts)]
    order = rng.permutation(num_prompts)
    return [samples[i] for i in order]


def multi_turn_dataset(num_prompts: int, turns: int, system_len: int, user_len: int, answer_len: int,
                       output_len: int, vocab_size: int, seed: int, low: int = LOW_TOKEN_ID) -> list[SampleRequest]:
    """`num_prompts // turns` conversations of `turns` turns each, turn by turn."""
    if turns < 1 or num_prompts < turns:
        raise ValueError(f"need at least one conversation of {turns} turns (num prompts {num_prompts})")
    rng = np.random.default_rng(seed)
    system = _random_ids(rng, system_len, vocab_size, low)
    histories = [list(system) for _ in range(num_prompts // turns)]
    samples = []
    for turn in range(turns):
        for c in rng.permutation(len(histories)):  # this turn of every conversation, in a random order
            history = histories[c]
            if turn:
                history += _random_ids(rng, answer_len, vocab_size, low)
            message = _random_ids(rng, user_len, vocab_size, low)
            history += message
            samples.append(SampleRequest(list(history), len(history), output_len, turn=turn, conversation=int(c),
                                         message=message))
    return samples


MOONCAKE_BLOCK_TOKENS = 512  # the block size the published Mooncake traces' hash ids count


class TraceRecord(msgspec.Struct, frozen=True):
    timestamp: Annotated[float, msgspec.Meta(ge=0)]
    input_length: Annotated[int, msgspec.Meta(ge=1)]
    output_length: Annotated[int, msgspec.Meta(ge=0)]
    hash_ids: list[int] = []


def read_trace(path: str | Path) -> list[TraceRecord]:
    """Every record of the trace, in file order; ValueError naming the line that is not one."""
    decoder = msgspec.json.Decoder(TraceRecord)
    records = []
    with open(path, "rb") as lines:
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                records.append(decoder.decode(line))
            except msgspec.DecodeError as exc:  # ValidationError is one
                raise ValueError(f"{path}, line {number}: not a Mooncake trace record: {exc}") from None
    if not records:
        raise ValueError(f"{path}: no trace records")
    return records


def whole_conversations(records: list[TraceRecord], count: int) -> list[TraceRecord]:
    """Up to `count` records made of whole conversations, taken in the order their first
    turns appear (one that would overflow is passed over for a smaller later one). A
    conversation is the records whose first two hash ids agree: in the published
    conversation trace every prompt begins with one block all share, and the next names
    the conversation (its later turns repeat it with the history)."""
    conversations: dict[tuple[int, ...], list[TraceRecord]] = {}
    for number, record in enumerate(records):
        key = tuple(record.hash_ids[:2]) if len(record.hash_ids) >= 2 else (-1, number)
        conversations.setdefault(key, []).append(record)
    chosen: list[TraceRecord] = []
    for turns in conversations.values():
        if len(chosen) + len(turns) <= count:
            chosen += turns
        if len(chosen) == count:
            break
    return chosen


def trace_dataset(path: str | Path, num_prompts: int, block_tokens: int, scale_tokens: float, scale_output: float,
                  time_scale: float, vocab_size: int, seed: int, low: int = LOW_TOKEN_ID, conversations: bool = False,
                  own_times: bool = True) -> list[SampleRequest]:
    """The trace's first `num_prompts` requests (`conversations`: its first whole
    conversations, `whole_conversations`) as token-id prompts, in arrival order, each with
    its arrival in seconds after the first (the trace's gaps times `time_scale`), or none
    unless `own_times` (sent at a request rate instead)."""
    if block_tokens < 1 or scale_tokens <= 0 or scale_output <= 0 or time_scale < 0:
        raise ValueError("the trace's block size and scales must be positive (the time scale may be 0)")
    records = read_trace(path)
    records = whole_conversations(records, num_prompts) if conversations else records[:num_prompts]
    records = sorted(records, key=lambda r: r.timestamp)
    rng = np.random.default_rng(seed)
    block = max(1, round(block_tokens * scale_tokens))
    blocks: dict[int, list[int]] = {}
    start = records[0].timestamp
    samples = []
    for record in records:
        length = max(1, round(record.input_length * scale_tokens))
        ids: list[int] = []
        for hash_id in record.hash_ids:
            if len(ids) >= length:
                break
            if hash_id not in blocks:
                blocks[hash_id] = rng.integers(low, vocab_size, size=block).tolist()
            ids += blocks[hash_id]
        if len(ids) < length:
            ids += rng.integers(low, vocab_size, size=length - len(ids)).tolist()
        samples.append(SampleRequest(ids[:length], length, max(1, round(record.output_length * scale_output)),
                                     arrival=(record.timestamp - start) / 1000.0 * time_scale if own_times
                                     else None))
    return samples


def estimate_tokens(text: str) -> int:
    """Token count of `text` without a tokenizer: one token per `CHARS_PER_TOKEN` chars."""
    return max(1, round(len(text) / CHARS_PER_TOKEN))


def sharegpt_dataset(path: str | Path, num_prompts: int, seed: int,
                     output_len: int | None = None) -> list[SampleRequest]:
    """First human turn as prompt, the reply's estimated length as output length.

    Like vLLM's sampler, conversations with fewer than two turns are skipped, as are
    (by estimated length) prompts or replies under 4 tokens, prompts over 1024 tokens
    and pairs over 2048. `output_len` overrides the estimated reply length.
    """
    entries = json.loads(Path(path).read_text())
    order = np.random.default_rng(seed).permutation(len(entries))
    samples = []
    for index in order:
        sample = _sharegpt_sample(entries[index], output_len)
        if sample is not None:
            samples.append(sample)
            if len(samples) == num_prompts:
                return samples
    raise ValueError(f"{path} has only {len(samples)} usable conversations, {num_prompts} requested")


def _sharegpt_sample(entry: dict, output_len: int | None) -> SampleRequest | None:
    turns = entry.get("conversations") or []
    if len(turns) < 2:
        return None
    prompt = turns[0]["value"]
    prompt_len = estimate_tokens(prompt)
    reply_len = estimate_tokens(turns[1]["value"]) if output_len is None else output_len
    if prompt_len < 4 or reply_len < 4 or prompt_len > 1024 or prompt_len + reply_len > 2048:
        return None
    return SampleRequest(prompt, prompt_len, reply_len)


def add_dataset_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("dataset")
    group.add_argument("--dataset", choices=DATASETS, default="random",
                       help="where prompts come from (default: random)")
    group.add_argument("--dataset-path", help="ShareGPT JSON file, or a Mooncake-format JSONL trace (required for "
                                              "--dataset sharegpt and trace)")
    group.add_argument("--vocab-size", type=int, default=4096,
                       help=f"random token ids are drawn from [{LOW_TOKEN_ID}, V) (default: 4096)")
    group.add_argument("--random-input-len", type=int, default=1024,
                       help="random: prompt length in tokens, shared prefix included (default: 1024)")
    group.add_argument("--random-output-len", type=int, default=128,
                       help="random: tokens to generate per request (default: 128)")
    group.add_argument("--random-prefix-len", type=int, default=0,
                       help="random: leading tokens shared by every prompt (default: 0)")
    group.add_argument("--prefix-repetition-prefix-len", type=int, default=256,
                       help="prefix-repetition: tokens in each shared prefix (default: 256)")
    group.add_argument("--prefix-repetition-suffix-len", type=int, default=256,
                       help="prefix-repetition: random tokens after the prefix (default: 256)")
    group.add_argument("--prefix-repetition-num-prefixes", type=int, default=10,
                       help="prefix-repetition: number of distinct prefixes (default: 10)")
    group.add_argument("--prefix-repetition-output-len", type=int, default=128,
                       help="prefix-repetition: tokens to generate per request (default: 128)")
    group.add_argument("--multi-turn-turns", type=int, default=4,
                       help="multi-turn: turns per conversation; num prompts / turns conversations (default: 4)")
    group.add_argument("--multi-turn-system-len", type=int, default=512,
                       help="multi-turn: tokens of the system prompt every conversation shares (default: 512)")
    group.add_argument("--multi-turn-user-len", type=int, default=128,
                       help="multi-turn: tokens of each user message (default: 128)")
    group.add_argument("--multi-turn-answer-len", type=int, default=128,
                       help="multi-turn: tokens standing for the model's answer in the next turn's prompt "
                            "(default: 128)")
    group.add_argument("--multi-turn-output-len", type=int, default=64,
                       help="multi-turn: tokens to generate per request (default: 64)")
    group.add_argument("--multi-turn-loop", choices=MULTI_TURN_LOOPS, default="open",
                       help="multi-turn: open: every conversation's turn k is sent before any turn k+1, with "
                            "stand-in answers; closed: as a chat client, each conversation's next turn once its last "
                            "is answered, with the model's own answer (its token ids: /v1/completions and a server "
                            "that returns them with return_token_ids; the stand-in where none came back) in its "
                            "history (default: open)")
    group.add_argument("--trace-block-tokens", type=int, default=MOONCAKE_BLOCK_TOKENS,
                       help="trace: prompt tokens per hash id (default %(default)s, the published Mooncake traces')")
    group.add_argument("--trace-scale-tokens", type=float, default=1.0,
                       help="trace: scale every prompt length and the block size by this (default %(default)s)")
    group.add_argument("--trace-scale-output", type=float, default=1.0,
                       help="trace: scale every output length by this (default %(default)s)")
    group.add_argument("--trace-time-scale", type=float, default=1.0,
                       help="trace: scale the gaps between arrivals by this; 0.1 replays ten times faster, "
                            "0 sends everything at once (default %(default)s); --request-rate replaces the "
                            "trace's times with that rate")
    group.add_argument("--trace-conversations", action="store_true",
                       help="trace: --num-prompts requests made of whole conversations (every turn of the first "
                            "conversations, requests whose first two hash ids agree) instead of the first lines, "
                            "so that an excerpt holds the reuse its conversations offer")
    group.add_argument("--sharegpt-output-len", type=int,
                       help="sharegpt: fixed output length instead of the reply's estimated length")


def load_samples(args: argparse.Namespace) -> list[SampleRequest]:
    """The dataset chosen by `args` (also reads `num_prompts`, `seed` and, for a trace,
    `request_rate`)."""
    if args.dataset == "random":
        return random_dataset(args.num_prompts, args.random_input_len, args.random_output_len,
                              args.random_prefix_len, args.vocab_size, args.seed)
    if args.dataset == "prefix-repetition":
        return prefix_repetition_dataset(
            args.num_prompts, args.prefix_repetition_prefix_len, args.prefix_repetition_suffix_len,
            args.prefix_repetition_num_prefixes, args.prefix_repetition_output_len,
            args.vocab_size, args.seed)
    if args.dataset == "multi-turn":
        return multi_turn_dataset(args.num_prompts, args.multi_turn_turns, args.multi_turn_system_len,
                                  args.multi_turn_user_len, args.multi_turn_answer_len, args.multi_turn_output_len,
                                  args.vocab_size, args.seed)
    if not args.dataset_path:
        raise ValueError(f"--dataset {args.dataset} needs --dataset-path")
    if args.dataset == "trace":
        return trace_dataset(args.dataset_path, args.num_prompts, args.trace_block_tokens, args.trace_scale_tokens,
                             args.trace_scale_output, args.trace_time_scale, args.vocab_size, args.seed,
                             conversations=args.trace_conversations, own_times=math.isinf(args.request_rate))
    return sharegpt_dataset(args.dataset_path, args.num_prompts, args.seed, args.sharegpt_output_len)
