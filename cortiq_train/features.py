"""What the frozen backbone says about a text: per window of ``seq`` tokens, its
hidden rows and its next-token distribution (the teacher), computed once.

Each window is a fresh sequence for the backbone and one draft sequence for the
layers, so the draft attention never crosses a window. The teacher keeps the
top-k log-probabilities of every position; index 0 is the backbone's greedy
token, the one a draft must match to be accepted.
"""

from __future__ import annotations

from dataclasses import dataclass
import hashlib
import json
import os
from pathlib import Path
from typing import Any, Callable

import numpy as np

from formats.errors import CortiqError

HEAD_ROWS = 64  # lm_head rows per block: bounds the [rows, vocab] logits buffer


@dataclass
class Features:
    tokens: np.ndarray  # int [W, T]
    hidden: np.ndarray  # f16/f32 [W, T, H]: the draft layers' hidden input (pre or post norm); maybe memory-mapped
    top_idx: np.ndarray  # int32 [W, T, k]: teacher top-k at each position, best first
    top_logp: np.ndarray  # f32 [W, T, k]: their log-probabilities (not renormalized)
    train: np.ndarray  # int64: window indices used for training
    held: np.ndarray  # int64: held-out window indices

    @property
    def seq(self) -> int:
        return int(self.tokens.shape[1])

    @property
    def greedy(self) -> np.ndarray:
        """[W, T]: the backbone's greedy token after each position."""
        return self.top_idx[:, :, 0]


def split_windows(n_tokens: int, seq: int, holdout: float, min_len: int) -> tuple[int, np.ndarray, np.ndarray]:
    """(windows, train indices, held-out indices): the last windows are held out."""
    n = n_tokens // seq
    held_n = int(np.ceil(n * holdout)) if holdout > 0 else 0
    need = 1 + (1 if holdout > 0 else 0)
    if seq < min_len or n < need or n - held_n < 1:
        raise CortiqError(
            f"too little text: {n_tokens} tokens make {n} window(s) of --seq {seq}; need at least {need} "
            f"(give more text, or lower --seq / --holdout)"
        )
    idx = np.arange(n, dtype=np.int64)
    return n, idx[: n - held_n], idx[n - held_n :]


class EngineRunner:
    """The backbone as the engine computes it (exactly the decode path's numbers)."""

    def __init__(self, backbone):
        self.model = backbone.model
        self.hidden_size = backbone.arch.hidden_size
        self.vocab_size = int(backbone.model.head.shape[0])

    def hidden(self, ids: np.ndarray) -> np.ndarray:
        from cortiq_engine.model import forward

        return forward(self.model.new_state(len(ids)), ids)

    def final_norm(self, x: np.ndarray) -> np.ndarray:
        return self.model.final_norm(x)

    def logits(self, normed: np.ndarray) -> np.ndarray:
        return self.model.lm_head(normed)


CACHE_VERSION = 1
CACHE_META = "meta.json"
FEATURE_DTYPES = {"f16": np.float16, "f32": np.float32}


def cache_key(
    ids: np.ndarray, *, seq: int, topk: int, hidden: str, dtype: str, backbone: str | None, runner: str
) -> str:
    """What the cached rows are a function of: the backbone, the token ids and the settings."""
    h = hashlib.sha256(json.dumps([CACHE_VERSION, backbone, runner, seq, topk, hidden, dtype]).encode())
    h.update(np.ascontiguousarray(ids, np.int64).tobytes())
    return h.hexdigest()[:32]


class FeatureCache:
    """Collected windows in a folder of memory-mapped ``.npy`` files (hidden rows in f16 or
    f32, teacher top-k, tokens) and ``meta.json`` (the key and how many windows are done),
    so collection holds one window in RAM and a killed run resumes at its last window.
    A folder of another key (other text, backbone or settings) is started afresh."""

    def __init__(self, folder: Path, key: str, shapes: dict[str, tuple[tuple[int, ...], Any]]):
        self.folder, self.key = Path(folder), key
        meta = self._meta()
        fresh = meta.get("key") != key or not all((self.folder / f"{n}.npy").is_file() for n in shapes)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.arrays: dict[str, np.ndarray] = {}
        for name, (shape, dtype) in shapes.items():
            f = self.folder / f"{name}.npy"
            arr = None
            if not fresh:
                try:
                    arr = np.load(f, mmap_mode="r+")
                except (OSError, ValueError):
                    arr = None
                if arr is None or arr.shape != shape or arr.dtype != np.dtype(dtype):
                    fresh, arr = True, None
            if arr is None:
                arr = np.lib.format.open_memmap(f, mode="w+", dtype=dtype, shape=shape)
            self.arrays[name] = arr
        if fresh:
            # Files opened before a mismatch are rewritten too.
            self.arrays = {
                n: np.lib.format.open_memmap(self.folder / f"{n}.npy", mode="w+", dtype=dt, shape=sh)
                for n, (sh, dt) in shapes.items()
            }
            self.done = 0
            self._write_meta()
        else:
            d = meta.get("done")
            self.done = d if isinstance(d, int) and 0 <= d else 0

    def _meta(self) -> dict[str, Any]:
        try:
            m = json.loads((self.folder / CACHE_META).read_text())
            return m if isinstance(m, dict) else {}
        except (OSError, ValueError):
            return {}

    def _write_meta(self) -> None:
        tmp = self.folder / f".{CACHE_META}.tmp"
        tmp.write_text(json.dumps({"version": CACHE_VERSION, "key": self.key, "done": self.done}))
        os.replace(tmp, self.folder / CACHE_META)

    def commit(self, done: int) -> None:
        """Windows < done are on disk: flush them before the count says so."""
        for a in self.arrays.values():
            a.flush()
        self.done = done
        self._write_meta()


def collect(
    runner,
    ids: list[int] | np.ndarray,
    *,
    seq: int,
    topk: int,
    hidden: str,
    holdout: float,
    min_len: int,
    progress: Callable[[int, int], None] | None = None,
    cache: str | Path | None = None,
    dtype: str = "f32",
    backbone: str | None = None,
) -> Features:
    """Run the backbone over every window; ``progress(tokens done, tokens total)`` after each.

    With ``cache`` (a folder) the rows go to memory-mapped files there and a run that
    finds the folder with the same key (``backbone`` fingerprint, ids, settings) skips
    the windows already done; without it they stay in RAM."""
    ids = np.asarray(ids, dtype=np.int64)
    n, train, held = split_windows(len(ids), seq, holdout, min_len)
    h = runner.hidden_size
    vocab = runner.vocab_size
    k = min(topk, vocab)
    hdt = FEATURE_DTYPES[dtype]
    shapes = {
        "tokens": ((n, seq), np.int32),
        "hidden": ((n, seq, h), hdt),
        "top_idx": ((n, seq, k), np.int32),
        "top_logp": ((n, seq, k), np.float32),
    }
    if cache is not None:
        key = cache_key(
            ids[: n * seq], seq=seq, topk=k, hidden=hidden, dtype=dtype, backbone=backbone, runner=type(runner).__name__
        )
        store = FeatureCache(Path(cache), key, shapes)
        arrays, start = store.arrays, store.done
    else:
        store = None
        arrays = {name: np.empty(shape, dt) for name, (shape, dt) in shapes.items()}
        start = 0
    tokens = ids[: n * seq].reshape(n, seq)
    if progress and start:
        progress(start * seq, n * seq)
    for w in range(start, n):
        x = runner.hidden(tokens[w])
        normed = runner.final_norm(x)
        rows = normed if hidden == "post" else x
        peak = float(np.abs(rows).max()) if hdt == np.float16 else 0.0
        if peak > np.finfo(np.float16).max:
            # Gemma's residual stream passes f16's 65,504 (measured: training on such
            # rows diverges at the first step), so say so instead of storing Inf.
            raise CortiqError(
                f"the backbone's hidden rows reach {peak:.4g}, beyond f16's range (65,504): "
                f"use --feature-dtype f32 (or --mtp-hidden post)"
            )
        arrays["hidden"][w] = rows
        arrays["tokens"][w] = tokens[w]
        for r0 in range(0, seq, HEAD_ROWS):
            logits = runner.logits(normed[r0 : r0 + HEAD_ROWS]).astype(np.float64)
            i, lp = _top_logp(logits, k)
            arrays["top_idx"][w, r0 : r0 + len(i)] = i
            arrays["top_logp"][w, r0 : r0 + len(i)] = lp
        if store is not None:
            store.commit(w + 1)
        if progress:
            progress((w + 1) * seq, n * seq)
    return Features(arrays["tokens"], arrays["hidden"], arrays["top_idx"], arrays["top_logp"], train, held)


def _top_logp(logits: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Top-k ids (best first, ties to the lower id like argmax) and their log-softmax values."""
    m = logits.max(axis=1, keepdims=True)
    lse = m + np.log(np.exp(logits - m).sum(axis=1, keepdims=True))
    if k < logits.shape[1]:
        part = np.argpartition(-logits, k - 1, axis=1)[:, :k]
    else:
        part = np.broadcast_to(np.arange(logits.shape[1]), logits.shape).copy()
    vals = np.take_along_axis(logits, part, axis=1)
    # Sort by value descending, then id ascending, so index 0 equals np.argmax.
    order = np.lexsort((part, -vals), axis=1)
    idx = np.take_along_axis(part, order, axis=1)
    # argpartition may pick any of several tied k-th values; the greedy token must be argmax's.
    idx[:, 0] = np.argmax(logits, axis=1)
    lp = np.take_along_axis(logits, idx, axis=1) - lse
    return idx.astype(np.int32), lp.astype(np.float32)


def continuations(
    model,
    ids: np.ndarray,
    *,
    seq: int,
    prompt: int,
    temperature: float = 0.0,
    seed: int = 0,
    progress: Callable[[int, int], None] | None = None,
    cache: str | Path | None = None,
    backbone: str | None = None,
) -> np.ndarray:
    """The text speculative decoding must predict: every window of ``seq`` tokens keeps its
    first ``prompt`` real tokens and the rest is the backbone's own continuation (greedy,
    or sampled at ``temperature``), decoded by the engine with its KV cache. Returns the
    new ids, ``len(ids) // seq`` whole windows; ``progress(windows done, windows)``."""
    if not 1 <= prompt < seq:
        raise CortiqError(f"--self-distill {prompt}: the real prompt must be 1..{seq - 1} tokens of each window")
    ids = np.asarray(ids, np.int64)
    n = len(ids) // seq
    prompts = [ids[w * seq : w * seq + prompt] for w in range(n)]
    return continue_windows(
        model, prompts, seq=seq, temperature=temperature, seed=seed, progress=progress, cache=cache, backbone=backbone
    )


def continue_windows(
    model,
    prompts: list[np.ndarray],
    *,
    seq: int,
    temperature: float = 0.0,
    seed: int = 0,
    progress: Callable[[int, int], None] | None = None,
    cache: str | Path | None = None,
    backbone: str | None = None,
) -> np.ndarray:
    """Each prompt (1..seq-1 ids) continued by the backbone to ``seq`` tokens: [n * seq] ids.

    Window w samples with its own generator (``seed``, w), so a window's text does not
    depend on the others and a run resumed from ``cache`` (a folder: the windows done so
    far, memory-mapped, keyed by the backbone, prompts and settings) equals an
    uninterrupted one. Decoding is the slow part of self-distillation: about one
    decode step per generated token."""
    from cortiq_engine.model import forward

    n = len(prompts)
    for p in prompts:
        if not 1 <= len(p) < seq:
            raise CortiqError(f"a window's prompt of {len(p)} tokens does not leave room in --seq {seq}")
    if cache is not None:
        h = hashlib.sha256(
            json.dumps([CACHE_VERSION, "continue", backbone, seq, float(temperature), int(seed)]).encode()
        )
        for p in prompts:
            h.update(np.asarray(p, np.int64).tobytes() + b"|")
        store = FeatureCache(Path(cache), h.hexdigest()[:32], {"windows": ((n, seq), np.int32)})
        out, start = store.arrays["windows"], store.done
    else:
        store, out, start = None, np.empty((n, seq), np.int32), 0
    if progress and start:
        progress(start, n)
    for w in range(start, n):
        rng = np.random.default_rng([seed, w])
        p = np.asarray(prompts[w], np.int64)
        out[w, : len(p)] = p
        state = model.new_state(seq)
        h_last = forward(state, p)[-1:]
        for j in range(len(p), seq):
            logits = model.lm_head(model.final_norm(h_last))[0].astype(np.float64)
            if temperature > 0:
                q = np.exp((logits - logits.max()) / temperature)
                tok = int(rng.choice(len(q), p=q / q.sum()))
            else:
                tok = int(np.argmax(logits))
            out[w, j] = tok
            if j + 1 < seq:
                h_last = forward(state, [tok])
        if store is not None:
            store.commit(w + 1)
        if progress:
            progress(w + 1, n)
    return np.asarray(out, np.int64).reshape(-1)


# What a chat user asks about a passage, for --chat training windows (cycled). The
# speed benchmark's chat prompts (benchmarks/mtp_speedup.py) are worded differently and
# quote held-out text, so a sidecar is measured on requests it was not trained on.
CHAT_TRAIN_ASKS = (
    "Summarize the following text.\n\n{p}",
    "Describe what is going on here:\n\n{p}",
    "Who are the characters in this passage, and what do they do?\n\n{p}",
    "Retell this in your own words:\n\n{p}",
    "What is the main idea of this text?\n\n{p}",
    "Write a short continuation of this passage:\n\n{p}",
    "Explain the meaning of this passage:\n\n{p}",
    "List the key events in this passage:\n\n{p}",
)
CHAT_PASSAGE_CHARS = 400  # a passage quoted in a chat window: about 100 tokens


def passages(text: str, chars: int = CHAT_PASSAGE_CHARS) -> list[str]:
    """The text cut into passages of about ``chars`` characters at line ends (lines are
    joined; a passage never starts mid-line)."""
    out, cur = [], ""
    for line in text.splitlines():
        line = line.strip()
        if not line:
            continue
        cur = f"{cur} {line}" if cur else line
        if len(cur) >= chars:
            cut = cur.rfind(" ", 0, chars)
            out.append(cur[: cut if cut > chars // 2 else chars])
            cur = ""
    return out


def chat_prompts(
    tokenizer,
    text: str,
    *,
    seq: int,
    limit: int | None = None,
    asks: tuple[str, ...] = CHAT_TRAIN_ASKS,
    chars: int = CHAT_PASSAGE_CHARS,
) -> list[np.ndarray]:
    """Chat windows' prompts: passage i of the text inside ask i % len(asks), as one user
    turn through the model's chat template with the assistant's turn opened. A prompt
    leaves at least a quarter of the window for the answer: a passage too long for that
    is shortened (at a space), and skipped if even a short one does not fit."""
    if not tokenizer.chat_template:
        raise CortiqError("--chat: the backbone has no chat template")
    room = seq - max(2, seq // 4)

    def render(ask: str, passage: str) -> list[int]:
        return tokenizer.encode(
            tokenizer.apply_chat_template([{"role": "user", "content": ask.format(p=passage)}]), add_bos=False
        )

    out: list[np.ndarray] = []
    for i, p in enumerate(passages(text, chars)):
        if limit is not None and len(out) >= limit:
            break
        ask = asks[i % len(asks)]
        ids = render(ask, p)
        bare = len(render(ask, "")) if len(ids) > room else 0  # the ask and template alone
        for _ in range(4):
            if len(ids) <= room or bare >= room:
                break
            # Tokens per character of this passage, measured: shrink to what fits.
            keep = int(len(p) * (room - bare) / (len(ids) - bare) * 0.95)
            cut = p.rfind(" ", 0, keep)
            p = p[: cut if cut > keep // 2 else keep]
            ids = render(ask, p)
        if 1 <= len(ids) <= room:
            out.append(np.asarray(ids, np.int64))
    if not out:
        raise CortiqError(f"--chat: no passage of the text fits a window of {seq} tokens with room for an answer")
    return out
