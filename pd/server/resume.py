"""A stream taken up where another server left it (`resume` in the body: the proxy's
migration, proxy/migration.py): checked against the request, and each choice's
detokenizer brought to where the client's text stands (serving.py builds the engine
request from it; generation.py and responses.py go on from it)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pd.contracts.sampling_params import SamplingParams
from pd.server.detokenize import IncrementalDetokenizer
from pd.server.protocol import RequestError, Resume, ResumedChoice
from pd.server.sampling import check_vocab


@dataclass
class ResumedSequence:
    """One choice of a resumed stream: the tokens generated for it on the other server,
    its detokenizer as it stands after them (the text the client has been sent marked
    released), the tokens the client has been shown logprobs of (the completions'
    `text_offset` runs on from them), and its finish reason if it had ended."""

    token_ids: list[int]
    detokenizer: IncrementalDetokenizer
    shown_token_ids: list[int]
    finish_reason: str | None = None


@dataclass
class Resumed:
    """A stream taken up where another server left it (`resume`): each of its choices."""

    choices: list[ResumedSequence]



def resume_stream(resume: Resume, params: SamplingParams, transfer: Any, stream: bool, stop: list[str],
              echo: Any, tokenizer: Any, vocab_size: int) -> Resumed:
    """The stream `resume` takes up; RequestError (400) if it cannot be taken up here:
    streamed, its prompt computed here (no kv_transfer_params), one entry for each of
    its n choices and one at least left to run, tokens of the vocabulary that leave
    max_tokens room, and no more text sent than they make (`text_chars` counts the
    choice's text as sent: an echoed prompt's too; `echo`: serving.py's `Echo`, or None)."""
    if not stream:
        raise RequestError("resume takes up a stream: it needs stream: true", param="resume")
    if transfer is not None:
        raise RequestError("resume computes the prompt here: it cannot come with kv_transfer_params",
                           param="resume")
    if len(resume.choices) != params.n:
        raise RequestError(f"resume.choices has {len(resume.choices)} entries for a request of {params.n} "
                           "choices", param="resume.choices")
    if all(c.finish_reason is not None for c in resume.choices):
        raise RequestError("every choice of the resumed stream had ended", param="resume.choices")
    return Resumed([_resumed_choice(j, c, params, stop, echo, tokenizer, vocab_size)
                    for j, c in enumerate(resume.choices)])


def _resumed_choice(index: int, choice: ResumedChoice, params: SamplingParams, stop: list[str], echo: Any,
                tokenizer: Any, vocab_size: int) -> ResumedSequence:
    param = f"resume.choices.{index}"
    ids = choice.token_ids
    check_vocab(vocab_size, ids, f"{param}.token_ids")
    detokenizer = IncrementalDetokenizer(tokenizer, stop, min_tokens=params.min_tokens)
    shown = (echo.token_ids if echo is not None and params.logprobs is not None else []) + list(ids)
    if choice.finish_reason is not None:  # nothing more of it is sent: its tokens count in usage alone
        if len(ids) > params.max_tokens:
            raise RequestError(f"{param}.token_ids has more than max_tokens={params.max_tokens} tokens",
                               param=f"{param}.token_ids")
        return ResumedSequence(list(ids), detokenizer, shown, choice.finish_reason)
    if len(ids) >= params.max_tokens:
        raise RequestError(f"{param}.token_ids has {len(ids)} tokens: max_tokens={params.max_tokens} leaves "
                           "none to generate", param=f"{param}.token_ids")
    echoed = echo.text if echo is not None else ""
    try:
        detokenizer.resume(ids, choice.text_chars - len(echoed))
    except ValueError as e:
        raise RequestError(f"{e} (after {len(echoed)} echoed)" if echoed else str(e),
                           param=f"{param}.text_chars") from None
    return ResumedSequence(list(ids), detokenizer, shown)
