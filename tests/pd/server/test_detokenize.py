"""IncrementalDetokenizer: streamed text equals a whole decode, never ends inside a UTF-8
character, and stops at the first stop string even when it straddles tokens."""

from __future__ import annotations

import pytest

from pd.server.detokenize import REPLACEMENT_CHAR, IncrementalDetokenizer
from pd.tokenizer import Tokenizer
from tests.support.server_harness import ARCHS


class ByteTokenizer:
    """Token i is the byte string `pieces[i]`; decoding is lossy UTF-8, as byte-level BPE's."""

    def __init__(self, pieces: list[bytes], special: set[int] = frozenset()) -> None:
        self.pieces = pieces
        self.special = special

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        ids = [t for t in token_ids if not (skip_special_tokens and t in self.special)]
        return b"".join(self.pieces[t] for t in ids).decode("utf-8", errors="replace")


def stream(detok: IncrementalDetokenizer, token_ids: list[int]) -> list[str]:
    """Feed one token at a time; every delta, then what `finish` releases."""
    deltas = [detok.add([t]) for t in token_ids]
    return deltas + [detok.finish()]


def test_multibyte_character_split_over_tokens_waits_for_its_last_byte() -> None:
    e_acute, emoji = "é".encode(), "🎉".encode()  # 2 and 4 bytes
    pieces = [b"caf", e_acute[:1], e_acute[1:], b" ", emoji[:1], emoji[1:3], emoji[3:], b"!"]
    detok = IncrementalDetokenizer(ByteTokenizer(pieces))
    deltas = stream(detok, list(range(len(pieces))))
    assert deltas == ["caf", "", "é", " ", "", "", "🎉", "!", ""]
    assert detok.text == "café 🎉!"


def test_incomplete_character_at_the_end_is_released_by_finish() -> None:
    detok = IncrementalDetokenizer(ByteTokenizer([b"ok", "中".encode()[:2]]))
    assert stream(detok, [0, 1]) == ["ok", "", REPLACEMENT_CHAR]


def test_special_tokens_are_skipped() -> None:
    detok = IncrementalDetokenizer(ByteTokenizer([b"a", b"<eos>"], special={1}))
    assert "".join(stream(detok, [0, 1])) == "a"
    keep = IncrementalDetokenizer(ByteTokenizer([b"a", b"<eos>"], special={1}), skip_special_tokens=False)
    assert "".join(stream(keep, [0, 1])) == "a<eos>"


def test_stop_string_straddling_tokens_is_cut_and_never_released() -> None:
    pieces = [b"Hello", b" wo", b"rl", b"d and", b" more"]
    detok = IncrementalDetokenizer(ByteTokenizer(pieces), stop=["world"])
    deltas = [detok.add([t]) for t in range(3)]
    # "Hello wo" + "rl": the tail that may begin "world" is held back.
    assert "".join(deltas) == "Hello "
    assert not detok.stopped
    assert detok.add([3]) == ""  # "world" completed: cut before it
    assert detok.stopped
    assert detok.add([4]) == "" and detok.finish() == ""
    assert detok.text == "Hello "


def test_earliest_stop_string_wins_whatever_its_order() -> None:
    detok = IncrementalDetokenizer(ByteTokenizer([b"abc", b"def"]), stop=["ef", "cd"])
    assert "".join(stream(detok, [0, 1])) == "ab"
    assert detok.stopped


def test_stop_string_inside_one_token() -> None:
    detok = IncrementalDetokenizer(ByteTokenizer([b"x", b"ySTOPz", b"w"]), stop=["STOP"])
    assert "".join(stream(detok, [0, 1, 2])) == "xy"


def test_held_back_text_is_released_at_finish_when_no_stop_comes() -> None:
    detok = IncrementalDetokenizer(ByteTokenizer([b"the wor", b"m"]), stop=["world"])
    deltas = stream(detok, [0, 1])
    assert deltas[0] == "the"  # " wor" could begin "world": held back
    assert "".join(deltas) == "the worm"
    assert not detok.stopped


def test_empty_stop_string_is_refused() -> None:
    with pytest.raises(ValueError):
        IncrementalDetokenizer(ByteTokenizer([b"a"]), stop=[""])


TEXT = "Les modèles écrivent 中文 and 日本語; emoji 🎉🚀 too. The quick brown fox jumps over the lazy dog."


@pytest.mark.parametrize("arch", ARCHS)
def test_real_tokenizer_streams_exactly_its_decode(tiny_models, arch: str) -> None:
    tokenizer = Tokenizer(tiny_models[arch])
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    # The emoji are not in the tiny vocabularies: byte tokens, so characters do split.
    assert any(REPLACEMENT_CHAR in tokenizer.decode([t]) for t in ids)
    detok = IncrementalDetokenizer(tokenizer)
    deltas = stream(detok, ids)
    assert "".join(deltas) == tokenizer.decode(ids) == TEXT
    assert not any(d.endswith(REPLACEMENT_CHAR) for d in deltas)


@pytest.mark.parametrize("arch", ARCHS)
def test_real_tokenizer_stop_strings_across_token_boundaries(tiny_models, arch: str) -> None:
    tokenizer = Tokenizer(tiny_models[arch])
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    for stop in ("n fox j", "日本", "🚀 to", "dog."):
        detok = IncrementalDetokenizer(tokenizer, stop=[stop, "never appears"])
        assert "".join(stream(detok, ids)) == TEXT[:TEXT.index(stop)], stop
        assert detok.stopped


def test_several_tokens_at_once_equal_one_at_a_time(tiny_models) -> None:
    tokenizer = Tokenizer(tiny_models["qwen3"])
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, stop=["lazy"])
    deltas = [detok.add(ids[i:i + 3]) for i in range(0, len(ids), 3)] + [detok.finish()]
    assert "".join(deltas) == TEXT[:TEXT.index("lazy")]
