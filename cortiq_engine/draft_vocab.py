"""The draft vocabulary (EAGLE-3's idea): the draft head scores only N token ids.

Scoring the full vocabulary costs every draft step a pass over the backbone's whole
lm_head (49,152 rows for SmolLM2, about a fifth of its bytes). A draft that is right
is almost always a frequent token, so the draft head keeps the N rows the text uses
most; the verify still scores the full vocabulary, so the output is unchanged.

Choice (``choose_draft_vocab``): first the ids the model must be able to draft
whatever the text, its EOS ids and the tokenizer's special tokens (a chat turn ends
on one); then the *target* tokens of the text (every token but the first, which no
draft predicts) by falling count, ties to the lower id; when the text shows fewer
than N distinct tokens, the rest are the lowest unseen ids (byte-level BPE numbers
its merges in order, so low ids are the common pieces). Stored most useful first,
so the first n of a stored vocabulary are the best n (``--mtp-vocab n``).

``DraftHead`` is the head a ``Drafter`` scores with: the full lm_head, or its rows
of the vocabulary copied once at load into a matrix of the same dtype (quantized
rows are contiguous blocks, so the copy is a row gather), whose argmax maps back
to full ids. On the numba kernels each of its logits is bit for bit the full head's
at that id (they compute every output row from its own weight row); the numpy set's
BLAS may round a row differently in a smaller matrix (float64-close, tested). Either
way the verify scores the full head, so the output is unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from formats.errors import CortiqError
from cortiq_engine.weights import Weight


def choose_draft_vocab(ids: Sequence[int], n: int, vocab_size: int, always: Sequence[int] = ()) -> np.ndarray:
    """The ``n`` most useful draft ids (int64, most useful first) from the token ids of a
    text: ``always`` first, then the text's target tokens by count, then unseen low ids."""
    if not 1 <= n <= vocab_size:
        raise CortiqError(f"draft vocabulary size {n} is not between 1 and the vocab size {vocab_size}")
    a = np.asarray(ids, dtype=np.int64).reshape(-1)
    if a.size and (a.min() < 0 or a.max() >= vocab_size):
        raise CortiqError(f"token id outside the vocabulary 0..{vocab_size - 1}")
    counts = np.bincount(a[1:], minlength=vocab_size)
    first = [int(i) for i in dict.fromkeys(int(x) for x in always) if 0 <= int(i) < vocab_size]
    # Stable sort by falling count: equal counts keep ascending id order.
    by_count = np.argsort(-counts, kind="stable")
    out = np.array(list(dict.fromkeys([*first, *by_count.tolist()]))[:n], dtype=np.int64)
    return out


@dataclass(frozen=True, eq=False)
class DraftHead:
    """The rows of the backbone's lm_head a draft scores: all (``ids`` None) or a vocabulary."""

    weight: Weight
    ids: np.ndarray | None  # ascending full ids of the weight's rows; None: the full head

    @property
    def size(self) -> int:
        return self.weight.rows

    @property
    def label(self) -> str | int:
        return "full" if self.ids is None else self.size

    def logits(self, kernels, x: np.ndarray) -> np.ndarray:
        """Normed rows [n, hidden] -> logits over this head's ids [n, size]."""
        return kernels.matmul((self.weight,), np.ascontiguousarray(x, dtype=np.float32))

    def full_id(self, i: int) -> int:
        return int(i) if self.ids is None else int(self.ids[i])


def full_head(head: Weight) -> DraftHead:
    return DraftHead(head, None)


def sub_head(head: Weight, vocab: np.ndarray) -> DraftHead:
    """The draft head of ``vocab`` (any order; stored ascending, so the gather reads the
    lm_head forward): the rows copied, same dtype, same kernels."""
    ids = np.unique(np.asarray(vocab, dtype=np.int64))
    if ids.size != len(vocab) or ids.size == 0 or ids[0] < 0 or ids[-1] >= head.rows:
        raise CortiqError(f"draft vocabulary of {len(vocab)} ids is not a set of distinct ids in 0..{head.rows - 1}")
    parts = {k: np.ascontiguousarray(v[ids]) for k, v in head.parts.items()}
    return DraftHead(Weight(f"{head.name}[draft vocab {ids.size}]", head.dtype, int(ids.size), head.cols, parts), ids)


def parse_vocab(text: str | None) -> int | str | None:
    """``--mtp-vocab`` as typed: None, "full", or a positive count of ids."""
    if text is None or text == "full":
        return text
    try:
        n = int(text)
    except ValueError:
        raise CortiqError(f"--mtp-vocab {text!r}: give a number of ids or full") from None
    if n < 1:
        raise CortiqError(f"--mtp-vocab {n}: give a positive number of ids or full")
    return n


def pick_vocab(stored: np.ndarray | None, want: int | str | None) -> np.ndarray | None:
    """The vocabulary a run drafts with: ``want`` None, the stored one (None: full); "full"
    or 0, full; n, the first n of the stored one (most useful first); a string is
    read as ``--mtp-vocab`` is (``parse_vocab``)."""
    if isinstance(want, str):
        want = parse_vocab(want)
    if want is None:
        return stored
    if want == "full" or want == 0:
        return None
    if want < 0:
        raise CortiqError(f"--mtp-vocab {want}: give a positive number of ids or full")
    if stored is None:
        raise CortiqError(
            f"--mtp-vocab {want}: the sidecar has no draft vocabulary; add one with `cortiq mtp-vocab MODEL SIDECAR -n {want}`"
        )
    if want > stored.size:
        raise CortiqError(f"--mtp-vocab {want}: the sidecar's draft vocabulary has {stored.size} ids")
    return stored[:want]


def vocab_from_text(
    tokenizer, vocab_size: int, eos_ids: Sequence[int], text: str, n: int, max_tokens: int | None = None
) -> tuple[np.ndarray, int]:
    """(the ``n`` draft ids chosen from ``text``, tokens counted): EOS and special ids first."""
    ids = tokenizer.encode(text, add_bos=True)
    if max_tokens is not None:
        ids = ids[:max_tokens]
    if len(ids) < 2:
        raise CortiqError(f"too little text to choose a draft vocabulary ({len(ids)} token)")
    always = [*eos_ids, *tokenizer.special_ids()]
    return choose_draft_vocab(ids, n, vocab_size, always), len(ids)
