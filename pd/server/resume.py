"""A stream taken up where another server left it (`resume` in the body: the proxy's
migration, proxy/migration.py): checked against the request, and each choice's
detokenizer brought to where the client's text stands (serving.py builds the engine
request from it; generation.py and responses.py go on from it).

A choice handed on by a draining server carries that server's `kv_transfer_params` for
it (`migrated_kv`): the KV of the prompt and of every token of the choice but its last,
kept there under a lease. They are checked as a prefill server's are (signed, unexpired,
used once, issued for exactly those tokens, a peer this server trusts: 403 otherwise),
and the choice's sequence reads them instead of computing anything: it goes on by
computing its last token, as it would have there."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pd.contracts.sampling_params import SamplingParams
from pd.kv_transfer.params import RemotePrefillParams, TransferParamsError, parse_transfer_params
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
    kv: list[RemotePrefillParams | None]  # each choice's KV handed on with it (None: computed here)



def resume_stream(resume: Resume, params: SamplingParams, transfer: Any, stream: bool, stop: list[str],
                  echo: Any, tokenizer: Any, vocab_size: int, kv: Callable[[int, ResumedChoice], Any]) -> Resumed:
    """The stream `resume` takes up; RequestError (400) if it cannot be taken up here:
    streamed, its prompt computed here (no kv_transfer_params), one entry for each of
    its n choices and one at least left to run, tokens of the vocabulary that leave
    max_tokens room, and no more text sent than they make (`text_chars` counts the
    choice's text as sent: an echoed prompt's too; `echo`: serving.py's `Echo`, or None).
    `kv(index, choice)`: the choice's handed-on KV, checked (`migrated_kv`)."""
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
                    for j, c in enumerate(resume.choices)], [kv(j, c) for j, c in enumerate(resume.choices)])


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


def migrated_kv(index: int, choice: ResumedChoice, prompt_ids: list[int], engine_id: str,
                guard: Callable[[RemotePrefillParams, list[int], str], None]) -> RemotePrefillParams | None:
    """The KV another server handed choice `index` on with (None: none; its tokens are
    computed here); RequestError (400) for parameters that do not fit the choice, and
    `guard(params, token_ids, field)` raises the 403 for those this server may not read."""
    raw = choice.kv_transfer_params
    if raw is None:
        return None
    field = f"resume.choices.{index}.kv_transfer_params"
    if choice.finish_reason is not None or not choice.token_ids:
        raise RequestError("only a choice that has tokens and goes on has KV to read", param=field)
    try:
        params = parse_transfer_params(raw)
    except TransferParamsError as e:
        raise RequestError(str(e), param=f"resume.choices.{index}.{e.field}") from None
    if not isinstance(params, RemotePrefillParams):
        raise RequestError("must name KV to read (do_remote_prefill)", param=field)
    covered = prompt_ids + choice.token_ids[:-1]
    if params.num_prompt_tokens != len(covered) or params.first_token_ids != choice.token_ids[-1:]:
        raise RequestError(f"must hold the KV of the prompt and every token of the choice but its last "
                           f"({len(covered)} tokens), and name its last token as first_token_ids", param=field)
    if params.first_logprobs is not None or params.prompt_logprobs is not None:
        raise RequestError("carry no logprobs (the client has them)", param=field)
    if params.remote_engine_id == engine_id:
        raise RequestError("name another server's KV: this server handed the choice on", param=field)
    guard(params, covered, field)
    return params
