"""One token sequence for every model of a comparison, and the BOS rule for chunks.

A text is tokenized shard by shard (about ``SHARD_CHARS`` characters, cut after a
newline) into a compact int32 array, so neither the text nor the tokenizer's output
for all of it is ever held at once. The ids are the ones tokenizing the whole text
gives: each shard's encoding keeps back its tail (from the start of one of its last
lines, or of one of its last words), which is encoded again at the head of the next
shard, and a shard's ids are committed only when that tail, encoded on its own, is
exactly the end of the shard's ids (the cut is then a token boundary the tokenizer
restarts at). Where no cut holds for several shards' worth of text (a tokenizer that
marks the start of its input, as a SentencePiece prefix space does), the rest of the
text is encoded whole.
"""

from __future__ import annotations

from typing import Any, Iterable, Iterator, Protocol, Sequence

import numpy as np

from formats.errors import CortiqError

# Shards of 256 Ki characters: the tokenizers library keeps the heap it grew for one
# encoding, so one large call costs as much memory as the text (measured in docs/evals.md).
SHARD_CHARS = 1 << 18
_CUT_TRIES = 64  # line starts tried before a shard is kept whole for the next one
_WHOLE_AFTER = 4  # a kept text this many shards long: the rest is encoded whole


class Tokenizer(Protocol):
    def encode(self, text: str, add_bos: bool = True) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class TokenBuffer:
    """A growing int32 array, for ids arriving shard by shard (grown and trimmed with
    realloc, so the ids are not copied into a second array)."""

    def __init__(self, capacity: int = 1 << 16):
        self._a = np.empty(capacity, dtype=np.int32)
        self._n = 0

    def extend(self, ids: Sequence[int]) -> None:
        need = self._n + len(ids)
        if need > len(self._a):
            self._a.resize(max(need, len(self._a) + len(self._a) // 2), refcheck=False)
        self._a[self._n : need] = ids
        self._n = need

    def __len__(self) -> int:
        return self._n

    def array(self) -> np.ndarray:
        """The ids; the buffer is spent."""
        a, n = self._a, self._n
        self._a, self._n = np.empty(0, dtype=np.int32), 0
        a.resize(n, refcheck=False)
        return a


def shards(pieces: Iterable[str], size: int = SHARD_CHARS) -> Iterator[str]:
    """The pieces regrouped into shards of at least ``size`` characters, each ending at
    the first newline from there on (the last shard ends where the text does); their
    concatenation is the text."""
    buf: list[str] = []
    n = 0
    for piece in pieces:
        buf.append(piece)
        n += len(piece)
        if n < size:
            continue
        text, start = "".join(buf), 0
        while (cut := text.find("\n", start + size - 1) + 1) > 0:
            yield text[start:cut]
            start = cut
        buf, n = [text[start:]], len(text) - start
    rest = "".join(buf)
    if rest:
        yield rest


def _cuts(text: str) -> list[int]:
    """Where a shard may be cut, most likely to hold first: the starts of its last lines
    that begin with a visible character, then before its last words (`` word`` after a
    visible character), then its other line starts (a tokenizer may join a newline to
    the spaces after it); each group last first."""
    lines: list[int] = []
    end = len(text)
    while len(lines) < _CUT_TRIES and (nl := text.rfind("\n", 0, end)) >= 0:
        if nl + 1 < len(text):
            lines.append(nl + 1)
        end = nl
    words: list[int] = []
    end = len(text) - 1
    while len(words) < _CUT_TRIES // 4 and (sp := text.rfind(" ", 1, end)) > 0:
        if not text[sp - 1].isspace() and not text[sp + 1].isspace():
            words.append(sp)
        end = sp
    return [q for q in lines if not text[q].isspace()] + words + [q for q in lines if text[q].isspace()]


def encode_sharded(
    tokenizer: Any, pieces: Iterable[str], size: int = SHARD_CHARS, limit: int | None = None
) -> np.ndarray:
    """``tokenizer.encode(text, add_bos=True)`` of the pieces' concatenation, as int32,
    encoding one shard at a time (see the module docstring); with ``limit``, its first
    ``limit`` ids, reading no further than they need (committed ids are final)."""
    out = TokenBuffer()
    carry = ""
    first = True  # nothing committed yet: the next encoding starts the text (BOS)
    stream = shards(pieces, size)
    for shard in stream:
        text = carry + shard
        if len(carry) > _WHOLE_AFTER * size:  # no cut has held for a long stretch: the rest whole
            text += "".join(stream)
            break
        ids = tokenizer.encode(text, add_bos=first)
        for q in _cuts(text):
            tail = tokenizer.encode(text[q:], add_bos=False)
            if 0 < len(tail) < len(ids) and ids[len(ids) - len(tail) :] == tail:
                out.extend(ids[: len(ids) - len(tail)])
                carry, first = text[q:], False
                break
        else:
            carry = text
        if limit is not None and len(out) >= limit:
            return out.array()[:limit]
    else:
        text = carry
    if text:
        out.extend(tokenizer.encode(text, add_bos=first))
    return out.array()[:limit]


def tokenize_for(models: Sequence[Any], names: Sequence[str], text: Any) -> np.ndarray:
    """Tokenize with the first model's tokenizer; every other model must agree token for
    token. ``text`` is a string or a ``LoadedText`` (read again for each tokenizer)."""
    read = (lambda: iter((text,))) if isinstance(text, str) else text.pieces
    ids = encode_sharded(models[0].tokenizer, read())
    if len(ids) < 2:
        raise CortiqError(f"the text has {len(ids)} token{'s' if len(ids) != 1 else ''}; scoring needs at least 2")
    v0 = int(models[0].vocab_size)
    for m, name in zip(models[1:], names[1:]):
        if int(m.vocab_size) != v0:
            raise CortiqError(f"{name} has a vocabulary of {m.vocab_size}, {names[0]} of {v0}: they cannot be compared")
        other = encode_sharded(m.tokenizer, read())
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
