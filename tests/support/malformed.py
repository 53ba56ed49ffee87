"""Malformed requests, one per kind, shared by the server's and the proxy's fault tests:
each must get a 4xx with an OpenAI error object, and leave the server serving.

`BAD_REQUESTS[name] = (path, body, headers)`; a body is JSON (a dict or list) or raw
bytes. Sizes assume a server started with `--max-model-len MAX_MODEL_LEN` and the tiny
models' vocabulary of VOCAB ids.
"""

from __future__ import annotations

MAX_MODEL_LEN = 4096
VOCAB = 4096
MODEL = "qwen3"
USER = [{"role": "user", "content": "hi"}]


def completion(**fields):
    return ("/v1/completions", {"model": MODEL, **fields}, {})


def chat(**fields):
    return ("/v1/chat/completions", {"model": MODEL, **fields}, {})


def raw(body: bytes, path: str = "/v1/completions"):
    return (path, body, {})


def with_header(request, **headers):
    return (request[0], request[1], headers)


DEEP = b'{"prompt": "x", "user": ' + b"[" * 5000 + b"]" * 5000 + b"}"

BAD_REQUESTS = {
    # the body as a whole
    "malformed json": raw(b'{"prompt": "x",'),
    "body not an object": raw(b"[1, 2, 3]"),
    "empty body": raw(b""),
    "NaN literal": raw(b'{"prompt": "x", "temperature": NaN}'),
    "Infinity literal": raw(b'{"prompt": "x", "top_p": Infinity}'),
    "-Infinity literal": raw(b'{"prompt": "x", "temperature": -Infinity}'),
    "number overflowing to inf": raw(b'{"prompt": "x", "temperature": 1e309}'),
    "lone surrogate in a string": raw(b'{"prompt": "x\\ud800y"}'),
    "lone surrogate in a key": raw(b'{"prompt": "x", "\\udfff": 1}'),
    "invalid utf-8": raw(b'{"prompt": "\xff\xfe"}'),
    "nesting 5000 deep": raw(DEEP),
    "body over the size limit": raw(b'{"prompt": "' + b"x" * (5 << 20) + b'"}'),
    # the prompt
    "prompt missing": completion(max_tokens=4),
    "prompt empty string": completion(prompt=""),
    "prompt empty list": completion(prompt=[]),
    "prompt wrong type": completion(prompt=5),
    "prompt mixed list": completion(prompt=["a", 1]),
    "prompt float token ids": completion(prompt=[1.5, 2.0]),
    "two prompts": completion(prompt=["a", "b"]),
    "two token prompts": completion(prompt=[[1, 2], [3, 4]]),
    "prompt too long": completion(prompt=[11] * MAX_MODEL_LEN),
    "prompt too many characters": completion(prompt="x" * ((4 << 20) // 2)),
    "prompt plus max_tokens too long": completion(prompt=[11] * 100, max_tokens=MAX_MODEL_LEN - 99),
    "token id above vocab": completion(prompt=[5, VOCAB + 10]),
    "token id past 2**64": completion(prompt=[5, 2**70]),
    "negative token id": completion(prompt=[5, -1]),
    # sampling and stopping
    "max_tokens zero": completion(prompt="x", max_tokens=0),
    "max_tokens negative": completion(prompt="x", max_tokens=-3),
    "max_tokens string": completion(prompt="x", max_tokens="4"),
    "max_tokens past 2**64": completion(prompt="x", max_tokens=2**70),
    "temperature negative": completion(prompt="x", temperature=-0.1),
    "temperature above 2": completion(prompt="x", temperature=2.5),
    "temperature string": completion(prompt="x", temperature="hot"),
    "top_p zero": completion(prompt="x", top_p=0.0),
    "top_p above 1": completion(prompt="x", top_p=1.5),
    "top_k below -1": completion(prompt="x", top_k=-2),
    "seed past int64": completion(prompt="x", seed=2**64),
    "stop token id above vocab": completion(prompt="x", stop_token_ids=[VOCAB]),
    "stop token ids not a list": completion(prompt="x", stop_token_ids=5),
    "empty stop string": completion(prompt="x", stop=["ok", ""]),
    "stop wrong type": completion(prompt="x", stop=7),
    "stop list of numbers": completion(prompt="x", stop=[1, 2]),
    "ignore_eos string": completion(prompt="x", ignore_eos="yes"),
    "stream string": completion(prompt="x", stream="yes"),
    "stream_options wrong type": completion(prompt="x", stream=True, stream_options={"include_usage": "yes"}),
    "stream_options not an object": completion(prompt="x", stream=True, stream_options=5),
    "return_token_ids string": completion(prompt="x", return_token_ids="yes"),
    "cache_salt empty": completion(prompt="x", cache_salt=""),
    "cache_salt number": completion(prompt="x", cache_salt=5),
    # OpenAI fields this server refuses by name
    "unknown model": completion(prompt="x", model="gpt-5"),
    "model not a string": completion(prompt="x", model=5),
    "n zero": completion(prompt="x", n=0),
    "n past 128": completion(prompt="x", n=129),
    "logprobs past 20": completion(prompt="x", logprobs=21),
    "logprobs negative": completion(prompt="x", logprobs=-1),
    "logprobs a bool": completion(prompt="x", logprobs=True),
    "echo a string": completion(prompt="x", echo="yes"),
    "best_of below n": completion(prompt="x", n=3, best_of=2),
    "best_of streamed": completion(prompt="x", n=1, best_of=2, stream=True),
    "suffix": completion(prompt="x", suffix="end"),
    "min_tokens negative": completion(prompt="x", min_tokens=-1),
    "min_tokens above max_tokens": completion(prompt="x", min_tokens=5, max_tokens=4),
    "presence_penalty too large": completion(prompt="x", presence_penalty=2.5),
    "frequency_penalty too small": completion(prompt="x", frequency_penalty=-3),
    "repetition_penalty zero": completion(prompt="x", repetition_penalty=0),
    "repetition_penalty too large": completion(prompt="x", repetition_penalty=2.5),
    "logit_bias key not a token id": completion(prompt="x", logit_bias={"five": 10}),
    "logit_bias key negative": completion(prompt="x", logit_bias={"-5": 10}),
    "logit_bias key outside the vocabulary": completion(prompt="x", logit_bias={"99999999": 10}),
    "logit_bias value too large": completion(prompt="x", logit_bias={"5": 101}),
    "logit_bias value not a number": completion(prompt="x", logit_bias={"5": "up"}),
    "min_p above 1": completion(prompt="x", min_p=1.5),
    "min_p negative": completion(prompt="x", min_p=-0.1),
    # fields other servers read and this one does not know: refused, never ignored
    "typical_p": completion(prompt="x", typical_p=0.9),
    "guided_decoding_backend": completion(prompt="x", guided_decoding_backend="xgrammar"),
    # structured outputs: an unknown kind or a grammar that cannot be enforced is a 400
    "guided_json a number": completion(prompt="x", guided_json=5),
    "guided_json not JSON": completion(prompt="x", guided_json="{not json"),
    "guided_json an unknown type": completion(prompt="x", guided_json={"type": "foo"}),
    "guided_json a keyword it cannot enforce": completion(prompt="x", guided_json={
        "type": "array", "uniqueItems": True}),
    "guided_regex unclosed": completion(prompt="x", guided_regex="(ab"),
    "guided_choice empty": completion(prompt="x", guided_choice=[]),
    "guided_choice of numbers": completion(prompt="x", guided_choice=[1, 2]),
    "guided_grammar unknown rule": completion(prompt="x", guided_grammar="start: missing"),
    "two constraints": completion(prompt="x", guided_regex="a+", response_format={"type": "json_object"}),
    "response_format an unknown type": completion(prompt="x", response_format={"type": "structural_tag"}),
    "response_format json_schema without a schema": completion(prompt="x", response_format={
        "type": "json_schema", "json_schema": {"name": "x"}}),
    "structured_outputs an unknown kind": completion(prompt="x", structured_outputs={"whitespace_pattern": " "}),
    "structured_outputs two kinds": completion(prompt="x", structured_outputs={"regex": "a", "choice": ["a"]}),
    "tool_choice": chat(messages=[{"role": "user", "content": "hi"}], tool_choice="auto"),
    # PD parameters
    "kv_transfer_params to a server without a KV connector": completion(prompt="x", kv_transfer_params={
        "do_remote_decode": True}),
    "kv_transfer_params not a dict": completion(prompt="x", kv_transfer_params=[1]),
    "kv_transfer_params unknown field": completion(prompt="x", kv_transfer_params={"note": 1}),
    "kv_transfer_params remote prefill incomplete": completion(prompt="x", kv_transfer_params={
        "do_remote_prefill": True}),
    "kv_transfer_params port not a number": completion(prompt="x", kv_transfer_params={
        "do_remote_prefill": True, "remote_engine_id": "e", "remote_host": "127.0.0.1", "remote_port": "abc",
        "remote_request_id": "r", "remote_block_ids": [[1]], "num_prompt_tokens": 1, "first_token_ids": [5],
        "block_size": 16}),
    # chat
    "messages missing": chat(max_tokens=4),
    "messages empty": chat(messages=[]),
    "messages not a list": chat(messages="hi"),
    "message not an object": chat(messages=["hi"]),
    "role missing": chat(messages=[{"content": "hi"}]),
    "unknown role": chat(messages=[{"role": "wizard", "content": "hi"}]),
    "content wrong type": chat(messages=[{"role": "user", "content": 5}]),
    "content null": chat(messages=[{"role": "user", "content": None}]),
    "content image part": chat(messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "x"}}]}]),
    "content missing": chat(messages=[{"role": "user"}]),
    "content too many characters": chat(messages=[{"role": "user", "content": "x" * ((4 << 20) // 2)}]),
    "max_completion_tokens zero": chat(messages=USER, max_completion_tokens=0),
    "chat logprobs a number": chat(messages=USER, logprobs=2),
    "chat top_logprobs without logprobs": chat(messages=USER, top_logprobs=2),
    "chat top_logprobs past 20": chat(messages=USER, logprobs=True, top_logprobs=21),
    "chat tools not a list": chat(messages=USER, tools={"type": "function"}),
    "chat tool without a name": chat(messages=USER, tools=[{"type": "function", "function": {}}]),
    "chat tool of another type": chat(messages=USER, tools=[{"type": "retrieval", "function": {"name": "f"}}]),
    "chat tool_choice naming no tool": chat(messages=USER, tools=[{"type": "function", "function": {"name": "f"}}],
                                            tool_choice={"type": "function", "function": {"name": "g"}}),
    "chat tool_choice without tools": chat(messages=USER, tool_choice="required"),
    "chat tool_choice unknown": chat(messages=USER, tools=[{"type": "function", "function": {"name": "f"}}],
                                     tool_choice="always"),
    "chat assistant content null without tool calls": chat(messages=[{"role": "assistant", "content": None}]),
    "chat response_format an unknown type": chat(messages=USER, response_format={"type": "grammar"}),
    "chat unknown model": chat(messages=USER, model="other"),
    "chat_template_kwargs messages": chat(messages=USER, chat_template_kwargs={"messages": 1}),
    "chat_template_kwargs not an object": chat(messages=USER, chat_template_kwargs=[1]),
    # headers and routes
    "X-Request-Id too long": with_header(completion(prompt="x"), **{"X-Request-Id": "r" * 300}),
    "unknown route": ("/v1/embeddings", {"input": "x"}, {}),
}
