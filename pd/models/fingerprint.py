"""A fingerprint of a model's weights, part of the KV compatibility hash
(pd/kv_transfer/compat.py): two engines whose weights differ compute other KV for the same
tokens, so they must neither read each other's blocks nor a disk tier the other wrote.

It is cheap at start, whatever the model's size: of every weight file (the safetensors
shards, or the `.gguf`) it hashes the size and a 64 KiB window in every MiB, the first
(the header: tensor names, shapes, offsets) and the last included. That reads a
sixteenth of the bytes (15 MB of a 240 MB GGUF, 1 GB of a 16 GB checkpoint). Another
checkpoint, a fine-tune, a merged adapter or another quantization changes every tensor
of a MiB or more, so every window over them: it is seen. A change confined to less than
a MiB between two windows (a few rows edited in place) is not.
"""

from __future__ import annotations

import functools
import hashlib
import os
from pathlib import Path

from pd.models.files import safetensors_files
from pd.models.gguf import is_gguf

WINDOW = 64 << 10
STRIDE = 1 << 20


def weight_files(model: Path) -> list[Path]:
    """The files a model's weights are read from."""
    return [model] if is_gguf(model) else safetensors_files(model)


def weights_fingerprint(model: str | Path) -> str:
    """Hex fingerprint of the weights `model` (a checkpoint folder or a `.gguf`) holds."""
    files = weight_files(Path(model))
    return _fingerprint(tuple((str(f), *_identity(f)) for f in files))


def _identity(path: Path) -> tuple[int, int, int]:
    stat = path.stat()
    return stat.st_size, stat.st_mtime_ns, stat.st_ino


@functools.lru_cache(maxsize=8)  # the engine, its connector context and its tiers each ask
def _fingerprint(files: tuple[tuple[str, int, int, int], ...]) -> str:
    digest = hashlib.blake2b(digest_size=16)
    for path, size, _mtime, _inode in files:
        digest.update(size.to_bytes(8, "little"))
        fd = os.open(path, os.O_RDONLY)
        try:
            for offset in _windows(size):
                digest.update(os.pread(fd, WINDOW, offset))
        finally:
            os.close(fd)
    return digest.hexdigest()


def _windows(size: int) -> list[int]:
    """The offsets of the windows hashed in a file of `size` bytes."""
    offsets = list(range(0, size, STRIDE))
    last = max(size - WINDOW, 0)
    if offsets[-1:] != [last]:
        offsets.append(last)
    return offsets
