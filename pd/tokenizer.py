"""The checkpoint's tokenizer (tokenizer.json, or a GGUF's vocabulary, via the `tokenizers` library)."""

from __future__ import annotations

import json
from functools import cached_property
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer

from pd.models.gguf import is_gguf, open_gguf


class Tokenizer:
    def __init__(self, model_dir: str | Path) -> None:
        model_dir = Path(model_dir)
        self._strings: dict[int, str] = {}  # token_strings' cache
        if is_gguf(model_dir):  # built from the GGUF's vocabulary
            self._tokenizer, self.config = open_gguf(model_dir).tokenizer()
            return
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"{model_dir} has no tokenizer.json")
        self._tokenizer = HFTokenizer.from_file(str(path))
        config_path = model_dir / "tokenizer_config.json"
        self.config = json.loads(config_path.read_text()) if config_path.is_file() else {}

    @property
    def vocab_size(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    @cached_property
    def max_token_chars(self) -> int:
        """The most characters one token's text has (special tokens included): a text of
        n tokens has at most n times this many characters."""
        return max(map(len, self._tokenizer.get_vocab(with_added_tokens=True)), default=1)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; the tokenizer's post-processor adds BOS where the family does."""
        return self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def json(self) -> str:
        """The tokenizer as tokenizer.json text (what llguidance builds its own from)."""
        return self._tokenizer.to_str()

    def token_strings(self, token_ids: list[int]) -> list[str]:
        """Each token's own text (special tokens spelled out), as logprobs show tokens; a
        token ending inside a UTF-8 character decodes to U+FFFD there."""
        missing = sorted({t for t in token_ids if t not in self._strings})
        if missing:
            texts = self._tokenizer.decode_batch([[t] for t in missing], skip_special_tokens=False)
            self._strings.update(zip(missing, texts))
        return [self._strings[t] for t in token_ids]

    def token_id(self, token: str) -> int | None:
        return self._tokenizer.token_to_id(token)
