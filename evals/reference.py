"""A saved reference (``.cref``, bytes in ``formats/cref.py``): what a comparison needs
from the reference model, written once and read instead of running it.

``ReferenceRecorder`` turns the reference's logit blocks into the compact rows
(``evals.kl.ref_topk``) or full log-probabilities and streams them into the file;
``SavedReference`` opens one, checks that it was made for this text, tokenizer and
window plan (one-line errors otherwise), and hands back ``RefRows`` block by block.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from evals.kl import RefRows, ref_full, ref_topk
from evals.windows import Window
from formats.cref import CrefFile, CrefWriter
from formats.errors import CortiqError

DEFAULT_TOP_K = 64
DEFAULT_SAMPLES = 64


def text_sha256(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def tokenizer_fingerprint(tokenizer: Any, vocab_size: int) -> str:
    """sha256 of what decides token ids: every id's token string, BOS and whether it is added."""
    h = hashlib.sha256()
    h.update(
        f"{int(vocab_size)}|{getattr(tokenizer, 'bos_id', None)}|{bool(getattr(tokenizer, 'add_bos', False))}|".encode()
    )
    n = int(getattr(tokenizer, "vocab_size", vocab_size))
    for i in range(n):
        t = tokenizer.id_to_token(i) if hasattr(tokenizer, "id_to_token") else None
        h.update(b"\x00" if t is None else t.encode("utf-8", "surrogatepass") + b"\x01")
    return h.hexdigest()


def windows_array(windows: Sequence[Window]) -> np.ndarray:
    return np.array(
        [[w.begin, w.end, w.row_from, w.row_to, -1 if w.bos is None else w.bos] for w in windows], np.int64
    ).reshape(-1, 5)


def form_name(top_k: int, samples: int = 0) -> str:
    if not top_k:
        return "full"
    return f"top-{top_k}+{samples}" if samples else f"top-{top_k}"


class ReferenceRecorder:
    """Writes a reference's rows as they are scored. ``top_k`` 0 keeps full log-probabilities."""

    def __init__(
        self,
        path: Path,
        *,
        tokens: np.ndarray,
        windows: Sequence[Window],
        vocab_size: int,
        top_k: int,
        meta: dict[str, Any],
        samples: int = 0,
    ):
        rows = sum(w.n_scored for w in windows)
        self.top_k = min(int(top_k), int(vocab_size))
        self.samples = int(samples) if 0 < self.top_k < int(vocab_size) else 0
        self.writer = CrefWriter(
            path,
            rows=rows,
            vocab=vocab_size,
            top_k=self.top_k,
            tokens=tokens,
            windows=windows_array(windows),
            meta=meta,
            samples=self.samples,
        )
        self._row = 0

    def add(self, logits: np.ndarray, targets: np.ndarray) -> RefRows:
        """Store one block of the reference's logits; returns the rows as they will be read back."""
        if self.top_k:
            r = ref_topk(logits, targets, self.top_k, self.samples, first_row=self._row)
            arrays = {
                "nll": r.nll,
                "top1": r.top1.astype(np.int32),
                "top_ids": r.top_ids,
                "top_logp": r.top_logp,
                "tail_logp": r.tail_logp,
            }
            if self.samples:
                arrays.update(sample_ids=r.sample_ids, sample_logp=r.sample_logp)
        else:
            r = ref_full(logits, targets)
            r = RefRows(r.nll, r.top1, logp=r.logp.astype(np.float32))
            arrays = {"nll": r.nll, "top1": r.top1.astype(np.int32), "logp": r.logp}
        self.writer.write_rows(self._row, arrays)
        self._row += len(targets)
        return r

    def commit(self) -> None:
        self.writer.commit()

    def abort(self) -> None:
        self.writer.abort()


@dataclass(frozen=True)
class ReferenceIdentity:
    """What a saved reference must share with the run that reads it."""

    tokenizer: str  # tokenizer_fingerprint
    text_sha256: str
    vocab_size: int


class SavedReference:
    def __init__(self, path: Path):
        self.file = CrefFile(path)
        self.path = Path(path)
        meta = self.file.meta
        for key in ("tokenizer", "text", "settings", "model"):
            if not isinstance(meta.get(key), dict):
                raise CortiqError(f"{path}: reference meta.{key} is missing (corrupt reference file)")
        self._row = 0

    @property
    def meta(self) -> dict[str, Any]:
        return self.file.meta

    @property
    def settings(self) -> dict[str, Any]:
        return self.file.meta["settings"]

    @property
    def name(self) -> str:
        m = self.file.meta["model"]
        return str(m.get("label") or m.get("path") or self.path.name)[:200]

    @property
    def form(self) -> str:
        return form_name(self.file.top_k, self.file.samples)

    def check(self, ident: ReferenceIdentity, tokens: np.ndarray, windows: Sequence[Window]) -> None:
        """One-line errors for a reference made on another text, tokenizer or plan."""
        f, p = self.file, self.path
        if self.meta["text"].get("sha256") != ident.text_sha256:
            src = str(self.meta["text"].get("source"))[:120]
            raise CortiqError(f"{p} was saved on another text ({src}); pass the same text as when it was saved")
        if self.meta["tokenizer"].get("fingerprint") != ident.tokenizer or f.vocab_size != ident.vocab_size:
            raise CortiqError(
                f"{p} was saved with another tokenizer or vocabulary ({f.vocab_size} ids; this model has {ident.vocab_size})"
            )
        if len(tokens) != len(f.tokens) or not np.array_equal(np.asarray(tokens, np.int64), f.tokens):
            raise CortiqError(f"{p}: this model tokenizes the text differently from the saved reference")
        mine = windows_array(windows)
        theirs = np.array(
            [[w.begin, w.end, w.row_from, w.row_to, -1 if w.bos is None else w.bos] for w in f.windows], np.int64
        )
        if mine.shape != theirs.shape or not np.array_equal(mine, theirs):
            s = self.settings
            raise CortiqError(
                f"{p} was saved with other windows (mode {s.get('mode')}, ctx {s.get('ctx')}, stride {s.get('stride')}, "
                f"max_tokens {s.get('max_tokens')}, chunks {s.get('chunks')}); pass the same window options"
            )

    def windows(self) -> list[Window]:
        return [Window(w.begin, w.end, w.row_from, w.row_to, w.bos) for w in self.file.windows]

    def next_rows(self, n: int) -> RefRows:
        """The next ``n`` rows in plan order."""
        a, b = self._row, self._row + n
        if b > self.file.rows:
            raise CortiqError(f"{self.path}: asked for row {b}, the file has {self.file.rows}")
        d = self.file.block(a, b)
        self._row = b
        if self.file.top_k:
            return RefRows(
                d["nll"],
                d["top1"].astype(np.int64),
                top_ids=d["top_ids"],
                top_logp=d["top_logp"],
                tail_logp=d["tail_logp"],
                sample_ids=d.get("sample_ids"),
                sample_logp=d.get("sample_logp"),
            )
        return RefRows(d["nll"], d["top1"].astype(np.int64), logp=d["logp"])

    def close(self) -> None:
        self.file.close()


__all__ = [
    "ReferenceRecorder",
    "SavedReference",
    "ReferenceIdentity",
    "tokenizer_fingerprint",
    "text_sha256",
    "windows_array",
    "form_name",
    "DEFAULT_TOP_K",
    "DEFAULT_SAMPLES",
]
