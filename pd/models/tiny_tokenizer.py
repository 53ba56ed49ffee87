"""Tiny byte-level BPE tokenizers with each model family's special tokens and chat template.

The tokenizer is trained offline on a fixed in-code corpus, so it is the same on every
run and machine. Its vocabulary is exactly `vocab_size` entries, special tokens included,
and it is byte-level: any Unicode text encodes, and decode(encode(s)) == s.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers


@dataclass(frozen=True)
class SpecialToken:
    """An added token; `special=False` marks tokens like Qwen's <think> that decode normally."""

    content: str
    special: bool = True


@dataclass(frozen=True)
class TokenizerFamily:
    """What a family's published tokenizer files look like.

    `specials_first` puts the added tokens at ids 0.. (Gemma) instead of after the BPE
    vocabulary (Qwen, Llama 3, Granite). `bos` is None for families without a BOS token;
    `add_bos` means the tokenizer prepends it when encoding. `stop_tokens` are the
    generation_config eos ids, in order.
    """

    specials: tuple[SpecialToken, ...]
    specials_first: bool
    bos: str | None
    eos: str
    pad: str
    add_bos: bool
    stop_tokens: tuple[str, ...]
    chat_template: str
    tokenizer_class: str = "PreTrainedTokenizerFast"
    qwen_pretokenizer: bool = False
    unk: str | None = None
    writes_special_tokens_map: bool = True
    extra_config: tuple[tuple[str, Any], ...] = ()


# Qwen3's layout: tools listed in the system turn between <tools></tools>, calls written as
# <tool_call>{"name": ..., "arguments": ...}</tool_call>, results sent back in a user turn
# between <tool_response></tool_response> (the wording of the instructions is this
# project's own).
QWEN3_TEMPLATE = r"""{%- if tools -%}
{{- '<|im_start|>system\n' -}}
{%- if messages[0].role == 'system' -%}
{{- messages[0].content + '\n\n' -}}
{%- endif -%}
{{- '# Tools\n\nThese functions may be called to help with the request. Their signatures are between <tools></tools>:\n<tools>' -}}
{%- for tool in tools -%}
{{- '\n' + (tool | tojson) -}}
{%- endfor -%}
{{- '\n</tools>\n\nTo call one, write its name and arguments as a JSON object between <tool_call></tool_call> tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n' -}}
{%- elif messages[0].role == 'system' -%}
{{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' -}}
{%- endif -%}
{%- for message in messages -%}
{%- if message.role == 'assistant' -%}
{%- set content = message.content or '' -%}
{%- if '</think>' in content -%}
{%- set content = content.split('</think>')[-1].lstrip('\n') -%}
{%- endif -%}
{{- '<|im_start|>assistant\n' + content -}}
{%- for tool_call in message.tool_calls or [] -%}
{%- set call = tool_call.function if tool_call.function is defined else tool_call -%}
{{- ('<tool_call>\n' if loop.first and not content else '\n<tool_call>\n') -}}
{{- '{"name": "' + call.name + '", "arguments": ' + (call.arguments if call.arguments is string else call.arguments | tojson) + '}\n</tool_call>' -}}
{%- endfor -%}
{{- '<|im_end|>\n' -}}
{%- elif message.role == 'tool' -%}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' -%}
{{- '<|im_start|>user' -}}
{%- endif -%}
{{- '\n<tool_response>\n' + message.content + '\n</tool_response>' -}}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' -%}
{{- '<|im_end|>\n' -}}
{%- endif -%}
{%- elif not (message.role == 'system' and loop.first) -%}
{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' -}}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
{{- '<|im_start|>assistant\n' -}}
{%- if enable_thinking is defined and enable_thinking is false -%}
{{- '<think>\n\n</think>\n\n' -}}
{%- endif -%}
{%- endif -%}"""

GEMMA3_TEMPLATE = r"""{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
{%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}
{%- set loop_messages = messages[1:] -%}
{%- else -%}
{%- set first_user_prefix = "" -%}
{%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
{{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
{%- endif -%}
{%- set role = "model" if message['role'] == 'assistant' else message['role'] -%}
{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else "") }}
{{- message['content'] | trim -}}
{{ '<end_of_turn>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
{{ '<start_of_turn>model\n' }}
{%- endif -%}"""

LLAMA3_TEMPLATE = r"""{{- bos_token -}}
{%- for message in messages -%}
{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}
{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}
{%- endif -%}"""

GRANITE_TEMPLATE = r"""{%- for message in messages -%}
{{- '<|start_of_role|>' + message['role'] + '<|end_of_role|>' + message['content'] + '<|end_of_text|>\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}
{{- '<|start_of_role|>assistant<|end_of_role|>' -}}
{%- endif -%}"""

_S = SpecialToken

FAMILIES: dict[str, TokenizerFamily] = {
    "qwen3": TokenizerFamily(
        specials=(_S("<|endoftext|>"), _S("<|im_start|>"), _S("<|im_end|>"),
                  _S("<tool_call>", False), _S("</tool_call>", False),
                  _S("<think>", False), _S("</think>", False)),
        specials_first=False, bos=None, eos="<|im_end|>", pad="<|endoftext|>", add_bos=False,
        stop_tokens=("<|im_end|>", "<|endoftext|>"), chat_template=QWEN3_TEMPLATE,
        tokenizer_class="Qwen2Tokenizer", qwen_pretokenizer=True,
        writes_special_tokens_map=False, extra_config=(("errors", "replace"),),
    ),
    "gemma3": TokenizerFamily(
        specials=(_S("<pad>"), _S("<eos>"), _S("<bos>"), _S("<unk>"), _S("<mask>"),
                  _S("<start_of_turn>"), _S("<end_of_turn>")),
        specials_first=True, bos="<bos>", eos="<eos>", pad="<pad>", add_bos=True,
        stop_tokens=("<eos>", "<end_of_turn>"), chat_template=GEMMA3_TEMPLATE, unk="<unk>",
    ),
    "bamba": TokenizerFamily(
        specials=(_S("<|begin_of_text|>"), _S("<|end_of_text|>"), _S("<|start_header_id|>"),
                  _S("<|end_header_id|>"), _S("<|eot_id|>"), _S("<|finetune_right_pad_id|>")),
        specials_first=False, bos="<|begin_of_text|>", eos="<|end_of_text|>",
        pad="<|finetune_right_pad_id|>", add_bos=True,
        stop_tokens=("<|end_of_text|>", "<|eot_id|>"), chat_template=LLAMA3_TEMPLATE,
    ),
    "granitehybrid": TokenizerFamily(
        specials=(_S("<|pad|>"), _S("<|end_of_text|>"), _S("<|start_of_role|>"),
                  _S("<|end_of_role|>"), _S("<|tool_call|>")),
        specials_first=False, bos="<|end_of_text|>", eos="<|end_of_text|>", pad="<|pad|>",
        add_bos=False, stop_tokens=("<|end_of_text|>",), chat_template=GRANITE_TEMPLATE,
        tokenizer_class="GPT2Tokenizer", unk="<|end_of_text|>",
    ),
}

_PARAGRAPHS = (
    "The quick brown fox jumps over the lazy dog. A serving system splits the prefill of a "
    "prompt from the decoding of its answer, so that long prompts do not stall short replies.",
    "In the beginning the model reads every token of the prompt at once, filling a cache of "
    "keys and values; afterwards it writes one token at a time, reading that cache again.",
    "Hello, world! How are you today? I am fine, thank you. What would you like to know about "
    "the weather, the news, or the history of the city where you live?",
    "Numbers such as 0, 1, 2, 3, 42, 100, 2024 and 3.14159 appear in text; so do symbols like "
    "(), [], {}, <>, +, -, *, /, =, %, $, #, @, &, |, ~, ^, and quotes 'single' and \"double\".",
    "def add(a, b):\n    return a + b\n\nfor i in range(10):\n    print(i, add(i, i))\n",
    "Les modèles de langue écrivent en français, español, deutsch, 中文, 日本語 and русский.",
)

_SYLLABLES = tuple(c + v for c in "bcdfghklmnprstvwz" for v in ("a", "e", "i", "o", "u", "ai", "ou"))


def _pseudo_words(count: int) -> list[str]:
    """Deterministic pseudo-words from a fixed linear congruential generator.

    Plain arithmetic rather than `random`, so the corpus never changes with Python versions.
    """
    state, words = 12345, []
    for _ in range(count):
        state = (state * 1103515245 + 12345) % 2**31
        length = 1 + (state >> 8) % 4
        word = ""
        for _ in range(length):
            state = (state * 1103515245 + 12345) % 2**31
            word += _SYLLABLES[(state >> 10) % len(_SYLLABLES)]
        words.append(word)
    return words


def training_corpus() -> list[str]:
    """The fixed corpus: the paragraphs repeated, then lines of pseudo-text."""
    words = _pseudo_words(15_000)
    lines = [" ".join(words[i:i + 12]) + "." for i in range(0, len(words), 12)]
    return list(_PARAGRAPHS) * 20 + lines


# Qwen2's pre-tokenizer splits digits one by one; transformers' Qwen2Tokenizer rebuilds
# exactly this pipeline, so tokenizer.json must match it.
QWEN2_SPLIT_REGEX = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"""
                     r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")


def _new_tokenizer(qwen: bool) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    if qwen:
        tokenizer.normalizer = normalizers.NFC()
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(QWEN2_SPLIT_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    else:
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def _train_bpe(vocab_size: int, specials_first: list[str], qwen: bool) -> Tokenizer:
    tokenizer = _new_tokenizer(qwen)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=specials_first, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(training_corpus(), trainer=trainer)
    return tokenizer


def _post_processor(family: TokenizerFamily, bos_id: int | None) -> processors.PostProcessor:
    byte_level = processors.ByteLevel(add_prefix_space=False, trim_offsets=False)
    if not family.add_bos:
        return byte_level
    template = processors.TemplateProcessing(
        single=f"{family.bos}:0 $A:0", pair=f"{family.bos}:0 $A:0 {family.bos}:1 $B:1",
        special_tokens=[(family.bos, bos_id)],
    )
    return processors.Sequence([byte_level, template])


def build_tokenizer(family: TokenizerFamily, vocab_size: int) -> Tokenizer:
    """Train the family's tokenizer; exactly `vocab_size` entries with specials at fixed ids."""
    if family.specials_first:
        # The trainer gives its special tokens ids 0.. and registers them all as special.
        if not all(token.special for token in family.specials):
            raise ValueError("tokens placed before the BPE vocabulary must all be special")
        tokenizer = _train_bpe(vocab_size, [token.content for token in family.specials],
                               family.qwen_pretokenizer)
    else:
        tokenizer = _train_bpe(vocab_size - len(family.specials), [], family.qwen_pretokenizer)
        tokenizer.add_tokens([AddedToken(t.content, special=t.special, normalized=False)
                              for t in family.specials])
    if tokenizer.get_vocab_size(with_added_tokens=True) != vocab_size:
        raise RuntimeError(f"tokenizer has {tokenizer.get_vocab_size()} entries, wanted {vocab_size}")
    bos_id = tokenizer.token_to_id(family.bos) if family.bos else None
    tokenizer.post_processor = _post_processor(family, bos_id)
    return tokenizer


@dataclass(frozen=True)
class TokenIds:
    """The ids config.json and generation_config.json name."""

    bos: int | None
    eos: int
    pad: int
    stops: tuple[int, ...]


def write_tokenizer_files(family: TokenizerFamily, out_dir: Path, vocab_size: int,
                          model_max_length: int) -> TokenIds:
    """Write tokenizer.json, tokenizer_config.json and (if published) special_tokens_map.json."""
    tokenizer = build_tokenizer(family, vocab_size)
    (out_dir / "tokenizer.json").write_text(tokenizer.to_str(pretty=True) + "\n", encoding="utf-8")
    ids = {token.content: tokenizer.token_to_id(token.content) for token in family.specials}
    write_json(out_dir / "tokenizer_config.json", _tokenizer_config(family, ids, model_max_length))
    if family.writes_special_tokens_map:
        write_json(out_dir / "special_tokens_map.json", _special_tokens_map(family))
    return TokenIds(bos=ids[family.bos] if family.bos else None, eos=ids[family.eos],
                    pad=ids[family.pad], stops=tuple(ids[name] for name in family.stop_tokens))


def write_json(path: Path, data: dict[str, Any]) -> None:
    """Sorted keys and a trailing newline, as transformers writes them: byte-stable output."""
    path.write_text(json.dumps(data, indent=2, sort_keys=True, ensure_ascii=False) + "\n",
                    encoding="utf-8")


def _token_entry(content: str, special: bool | None = None) -> dict[str, Any]:
    entry = {"content": content, "lstrip": False, "normalized": False, "rstrip": False,
             "single_word": False}
    return entry if special is None else entry | {"special": special}


def _tokenizer_config(family: TokenizerFamily, ids: dict[str, int],
                      model_max_length: int) -> dict[str, Any]:
    decoder = {str(ids[t.content]): _token_entry(t.content, t.special) for t in family.specials}
    return {
        "add_bos_token": family.add_bos,
        "added_tokens_decoder": decoder,
        "bos_token": family.bos,
        "chat_template": family.chat_template,
        "clean_up_tokenization_spaces": False,
        "eos_token": family.eos,
        "model_max_length": model_max_length,
        "pad_token": family.pad,
        "split_special_tokens": False,
        "tokenizer_class": family.tokenizer_class,
        "unk_token": family.unk,
    } | dict(family.extra_config)


def _special_tokens_map(family: TokenizerFamily) -> dict[str, Any]:
    named = {"bos_token": family.bos, "eos_token": family.eos, "pad_token": family.pad,
             "unk_token": family.unk}
    return {key: _token_entry(value) for key, value in named.items() if value is not None}
