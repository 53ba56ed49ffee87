"""What one engine step costs, and what moving a prompt's KV costs: the simulator's
figures of the machine, fitted from the real engine (`fit.py`) and kept as JSON.

A step computes `tokens` new tokens of its requests (prompt chunks and decode tokens
alike), attends over `attention` token-pairs of prompt chunks (each new token over the
context before it and the chunk's earlier tokens: a chunk of n tokens after c cached ones
adds n x (c + (n + 1) / 2)) and `decode_attention` of decode tokens (one over its
context: c + 1), and samples `samples` tokens (a decode token, or a prompt's last chunk).
Its time is linear in those:

    step_s = fixed_s + loop_s + per_token_s x tokens + per_attention_s x attention
             + per_decode_attention_s x decode_attention + per_sample_s x samples

(a decode token's pairs cost more than a chunk's: one query row reads the whole context's
KV, where a chunk's rows share each read; measured 3 us against 0.2 us a pair here),

so a mixed step (decode tokens and a prefill chunk together, as the engine schedules
them under `max_num_batched_tokens` and `max_step_ms`) costs the sum of its parts, once
the fixed part.
`loop_s` is what a server's engine loop adds to each step beyond `EngineCore.step` (its
outputs sent out of the engine process), measured on a live server (`probe.py`). A KV
read of `t` prompt tokens takes `transfer_fixed_s + t x kv_bytes_per_token /
transfer_bytes_per_s` (its bytes, and its fixed part as an idle server measures it: an idle
engine polls its reads back to back), and a busy engine hears of it `transfer_polls` step
ends after that (on CPU the NIXL agent progresses only when the engine step polls it: the
step that posted the read polls its data done and posts the lease word's read, the next
polls that one; see `connectors/nixl/worker.py`); every HTTP leg (client to proxy to
server and back) `hop_s`.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from pd.config.settings import SchedulerSettings


@dataclass(frozen=True)
class StepCosts:
    fixed_s: float  # a step's time with nothing in it but the model's fixed work
    per_token_s: float  # each token computed
    per_attention_s: float  # each (new token, context token) pair attended
    per_sample_s: float  # each token sampled (the lm_head and the sampler on its row)
    kv_bytes_per_token: float  # the KV one prompt token keeps, every layer
    transfer_bytes_per_s: float  # D's read of P's blocks
    transfer_fixed_s: float = 0.0  # a read's fixed part (the handshake, the notification)
    per_decode_attention_s: float | None = None  # each (decode token, context token) pair; None: per_attention_s
    transfer_polls: int = 1  # step ends a busy engine takes to hear of a read whose bytes are in
    hop_s: float = 0.0  # one HTTP leg, client or proxy to the next
    loop_s: float = 0.0  # a live server's engine loop, each step, beyond EngineCore.step
    corun_factor: float = 1.0  # a step's time, as a share of its time alone, when another engine of its host steps
    max_num_batched_tokens: int = SchedulerSettings.max_num_batched_tokens  # the engine's token budget per step
    max_num_seqs: int = SchedulerSettings.max_num_seqs  # sequences running at once at most
    max_step_ms: float | str = SchedulerSettings.max_step_ms  # a mixed step's limit: ms, auto or off (step_budget.py)
    model: str = ""  # what the figures were measured on
    threads: int = 1

    def __post_init__(self) -> None:
        rates = ("fixed_s", "per_token_s", "per_attention_s", "per_sample_s", "kv_bytes_per_token",
                 "transfer_fixed_s", "hop_s", "loop_s", "decode_pair_s")
        negative = [name for name in rates if getattr(self, name) < 0]
        positive = (self.transfer_bytes_per_s, self.transfer_polls, self.corun_factor)
        if negative or min(positive) <= 0:
            raise ValueError(f"costs must not be negative ({', '.join(negative) or 'ok'}), the transfer rate, polls "
                             f"and corun factor must be positive: {self}")
        SchedulerSettings(max_num_seqs=self.max_num_seqs, max_num_batched_tokens=self.max_num_batched_tokens,
                          max_step_ms=self.max_step_ms)  # the engine's budgets, checked as pd serve checks them

    @property
    def decode_pair_s(self) -> float:
        return self.per_attention_s if self.per_decode_attention_s is None else self.per_decode_attention_s

    def step_s(self, tokens: int, attention: float, samples: int, decode_attention: float = 0.0) -> float:
        return self.fixed_s + self.loop_s + self.per_token_s * tokens + self.per_attention_s * attention + \
            self.decode_pair_s * decode_attention + self.per_sample_s * samples

    def prefill_s(self, prompt: int, context: int = 0) -> float:
        """One prompt of `prompt` tokens after `context` cached ones, alone, in budget-sized chunks."""
        total, done = 0.0, 0
        while done < prompt:
            n = min(self.max_num_batched_tokens, prompt - done)
            total += self.step_s(n, attention_of(n, context + done), 1 if done + n == prompt else 0)
            done += n
        return total

    def decode_step_s(self, batch: int, context: float) -> float:
        """A step of `batch` decode tokens, each over `context` tokens."""
        return self.step_s(batch, 0.0, batch, batch * context)

    def transfer_s(self, tokens: int) -> float:
        return self.transfer_fixed_s + tokens * self.kv_bytes_per_token / self.transfer_bytes_per_s

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(asdict(self), indent=1) + "\n")

    @classmethod
    def load(cls, path: Path) -> StepCosts:
        """ValueError naming the file when it is not a costs file."""
        try:
            return cls(**json.loads(Path(path).read_text()))
        except (TypeError, json.JSONDecodeError) as exc:
            raise ValueError(f"{path}: not a costs file of pd bench simulate fit ({exc})") from None


def attention_of(new: int, context: int) -> float:
    """Token pairs a chunk of `new` tokens after `context` ones attends (causal)."""
    return new * (context + (new + 1) / 2)
