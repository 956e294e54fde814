"""One token sequence for every model of a comparison, and the BOS rule for chunks."""

from __future__ import annotations

from typing import Any, Protocol, Sequence

import numpy as np

from formats.errors import CortiqError


class Tokenizer(Protocol):
    def encode(self, text: str, add_bos: bool = True) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


def tokenize_for(models: Sequence[Any], names: Sequence[str], text: str) -> np.ndarray:
    """Tokenize with the first model's tokenizer; every other model must agree token for token."""
    ids = np.asarray(models[0].tokenizer.encode(text, add_bos=True), dtype=np.int64)
    if len(ids) < 2:
        raise CortiqError(f"the text has {len(ids)} token{'s' if len(ids) != 1 else ''}; scoring needs at least 2")
    v0 = int(models[0].vocab_size)
    for m, name in zip(models[1:], names[1:]):
        if int(m.vocab_size) != v0:
            raise CortiqError(f"{name} has a vocabulary of {m.vocab_size}, {names[0]} of {v0}: they cannot be compared")
        other = np.asarray(m.tokenizer.encode(text, add_bos=True), dtype=np.int64)
        if other.shape != ids.shape or not np.array_equal(other, ids):
            raise CortiqError(f"{name} tokenizes the text differently from {names[0]}: they cannot be compared")
    if ids.max() >= v0:
        raise CortiqError(f"token id {int(ids.max())} is outside the model's vocabulary ({v0})")
    return ids


def chunk_bos(tokenizer: Any) -> int | None:
    """The id llama.cpp writes over each chunk's first token: BOS when the vocabulary adds BOS."""
    if getattr(tokenizer, "add_bos", False) and getattr(tokenizer, "bos_id", None) is not None:
        return int(tokenizer.bos_id)
    return None
