"""What one engine step costs, and what moving a prompt's KV costs: the simulator's
figures of the machine, fitted from the real engine (`fit.py`) and kept as JSON.

A step computes `tokens` new tokens of its requests (prompt chunks and decode tokens
alike), attends over `attention` token-pairs (each new token over the context before it
and the chunk's earlier tokens: a chunk of n tokens after c cached ones adds
n x (c + (n + 1) / 2)), and samples `samples` tokens (a decode token, or a prompt's
last chunk). Its time is linear in those:

    step_s = fixed_s + loop_s + per_token_s x tokens + per_attention_s x attention + per_sample_s x samples

so a mixed step (decode tokens and a prefill chunk together, as the engine schedules
them under `max_num_batched_tokens`) costs the sum of its parts, once the fixed part.
`loop_s` is what a server's engine loop adds to each step beyond `EngineCore.step` (its
outputs sent out of the engine process), measured on a live server (`probe.py`). A KV
read of `t` prompt tokens takes `transfer_fixed_s + t x kv_bytes_per_token /
transfer_bytes_per_s`; every HTTP leg (client to proxy to server and back) `hop_s`.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass(frozen=True)
class StepCosts:
    fixed_s: float  # a step's time with nothing in it but the model's fixed work
    per_token_s: float  # each token computed
    per_attention_s: float  # each (new token, context token) pair attended
    per_sample_s: float  # each token sampled (the lm_head and the sampler on its row)
    kv_bytes_per_token: float  # the KV one prompt token keeps, every layer
    transfer_bytes_per_s: float  # D's read of P's blocks
    transfer_fixed_s: float = 0.0  # a read's fixed part (the handshake, the notification)
    hop_s: float = 0.0  # one HTTP leg, client or proxy to the next
    loop_s: float = 0.0  # a live server's engine loop, each step, beyond EngineCore.step
    max_num_batched_tokens: int = 1024  # the engine's token budget per step (pd serve's default)
    max_num_seqs: int = 64  # sequences running at once at most (pd serve's default)
    model: str = ""  # what the figures were measured on
    threads: int = 1

    def __post_init__(self) -> None:
        rates = ("fixed_s", "per_token_s", "per_attention_s", "per_sample_s", "kv_bytes_per_token",
                 "transfer_fixed_s", "hop_s", "loop_s")
        negative = [name for name in rates if getattr(self, name) < 0]
        if negative or self.transfer_bytes_per_s <= 0 or self.max_num_batched_tokens < 1 or self.max_num_seqs < 1:
            raise ValueError(f"costs must not be negative ({', '.join(negative) or 'ok'}), the transfer rate, token "
                             f"budget and batch must be positive: {self}")

    def step_s(self, tokens: int, attention: float, samples: int) -> float:
        return self.fixed_s + self.loop_s + self.per_token_s * tokens + self.per_attention_s * attention + \
            self.per_sample_s * samples

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
        return self.step_s(batch, batch * context, batch)

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
