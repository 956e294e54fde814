"""Multi-token-prediction draft layers: loading them, and drafting with them.

One draft layer (DeepSeek-V3 / Qwen3-Next / MiMo-V2 all agree, embedding first):

    u      = eh_proj · [enorm(embed(token)) ; hnorm(hidden)]
    u      = block(u)                          one decoder block over its own KV cache
    logits = lm_head(final_layernorm(u))       the backbone's lm_head, shared

``hidden`` is the backbone's last-layer output before its final norm (``pre``,
the default: measured better in the reference design) or after it (``post``,
what vLLM/SGLang feed).

Chaining to depth K, for a round that starts after the backbone processed
position t (hidden h_t) with the next token x_{t+1} already chosen:

- ``independent`` (MiMo-V2's three layers, as SGLang runs them): layer k drafts
  depth k+1; its row j reads (embed(x_{j+k+1}), h_j) at RoPE position j, always
  the backbone's hidden, never another draft layer's output; the draft is the
  argmax of its row t. Tokens past x_{t+1} are this round's earlier drafts.
- ``recursive`` (vLLM): layer 0 drafts depth 1 from (x_{t+1}, h_t); depth d+1
  feeds layer 0 its own output u with the token just drafted, one position on.

Every layer keeps its own KV cache. A row is *final* once its token and hidden
are committed (row j of layer k: j <= t - k); later rows are provisional and are
truncated and recomputed at the next round. So drafting costs one catch-up row
per accepted token per layer, and every committed row enters a cache once.

The layers themselves are the backbone family's (``Family.draft_layer`` in
``cortiq_engine/models/<family>.py``), built by ``load_draft_stack``: the one loader.
A draft scores the lm_head rows of its ``DraftHead`` (``cortiq_engine.draft_vocab``):
the full vocabulary, or the sidecar's draft vocabulary. With a ``threshold`` > 0 a
round stops drafting at the first draft whose own probability (softmax of the draft
logits over the ids it scored) is below it, and does not propose that draft: a weak
draft then costs its draft step only, not a verify row (adaptive depth).

``Drafter.draft`` is the one draft path: speculative decoding calls it with the
committed tokens, the teacher-forced probe (evals/mtp_probe.py) with the true
text, whose later tokens then stand in for the drafts.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, ClassVar, Sequence

import numpy as np

from formats.arch import ArchConfig
from formats.cmf import CmfFile
from formats.errors import CortiqError
from formats.sidecar import (
    LookupDefaults,
    count_mtp_layers,
    open_sidecar,
    read_defaults,
    read_draft_vocab,
    read_held_out,
    read_lookup_defaults,
)
from cortiq_engine.cache import KVCache
from cortiq_engine.draft_vocab import DraftHead, full_head
from cortiq_engine.layers import Step
from cortiq_engine.model import Model
from cortiq_engine.models import draft_layer, read_arch
from cortiq_engine.models.base import DraftLayer
from cortiq_engine.spec_decision import PLAIN, SpecDecision
from cortiq_engine.weights import Weight

CHAINS = ("independent", "recursive")
HIDDENS = ("pre", "post")
NO_MTP_HINT = "--no-mtp runs without it"
# The adaptive-depth threshold a generation uses unless told (SpeculativeConfig.threshold,
# --mtp-threshold): chosen on held-out text by the expected time per token
# (docs/performance.md, "Draft vocabulary and adaptive depth"): on SmolLM2's trained
# sidecar a depth-1 draft with p >= 0.4 is accepted about half the time, the break-even
# of a 2-row verify; 0.4 was the best modelled threshold at depth 1 and within 1% of it at depth 3.
DEFAULT_THRESHOLD = 0.4


# ------------------------------------------------------------------ the layers
@dataclass(frozen=True, eq=False)
class DraftStack:
    """The loaded draft layers of one backbone (immutable; per-sequence state is ``Drafter``)."""

    layers: tuple[DraftLayer, ...]
    style: str
    source: str  # where they came from: the sidecar path, or "inline"
    vocab: np.ndarray | None = None  # the stored draft vocabulary (ids, most useful first)
    # measured defaults (sidecar record mtp.defaults): drafts per round and threshold
    default_depth: int | None = None
    default_threshold: float | None = None
    # ... and those measured with n-gram lookup drafting first (mtp.defaults.with_lookup)
    lookup_defaults: LookupDefaults | None = None
    # the held-out acceptance per depth mtp-train measured (trained.held_out)
    held_out: tuple[float, ...] | None = None
    # names these layers in the speculation memory: a digest of the sidecar's header
    # and size ("inline": the model's own, named by the model)
    fingerprint: str = "inline"

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def weights(self) -> list[Weight]:
        return [w for layer in self.layers for w in layer.weights()]

    def default_chain(self, depth: int) -> str:
        return "independent" if depth <= self.num_layers else "recursive"


def load_draft_stack(main: CmfFile, arch: ArchConfig, kernels, path: str | Path | None = None) -> DraftStack | None:
    """The draft layers for the backbone in ``main``: from ``path`` when given, else inline
    in ``main``, else the sidecar ``<stem>.mtp.cmf`` beside it; None when there are none.

    A sidecar that exists but does not match the backbone is an error, never a
    silent fallback to plain decoding.
    """
    if path is None and count_mtp_layers(main):
        src, source = main, "inline"
    else:
        try:
            src = open_sidecar(main.path, main.header, path)
        except CortiqError as e:
            raise CortiqError(f"{e} ({NO_MTP_HINT})") from None
        if src is None:
            return None
        source = str(src.path)
        # The sidecar's own arch carries the MTP style the converter recorded.
        side_arch = read_arch(src, trunk=False)
        if side_arch.mtp is not None and arch.mtp is None:
            arch = ArchConfig.from_json({**arch.to_json(), "mtp": side_arch.mtp.__dict__})
    n = count_mtp_layers(src)
    try:
        layers = tuple(draft_layer(src, k, arch, kernels) for k in range(n))
        vocab = read_draft_vocab(src, arch.vocab_size)
        depth, threshold = read_defaults(src.header, n) if src is not main else (None, None)
        with_lookup = read_lookup_defaults(src.header, n) if src is not main else None
        held_out = read_held_out(src.header) if src is not main else None
    except CortiqError as e:
        raise CortiqError(f"{e} ({NO_MTP_HINT})") from None
    fingerprint = "inline" if src is main else header_digest(src.header, Path(src.path).stat().st_size)
    style = arch.mtp.style if arch.mtp else "deepseek"
    return DraftStack(layers, style, source, vocab, depth, threshold, with_lookup, held_out, fingerprint)


def header_digest(header: dict, size: int) -> str:
    """A short digest naming a file by its header and size (the speculation memory's keys)."""
    text = json.dumps(header, sort_keys=True, default=str) + f"/{size}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


# ------------------------------------------------------------------ per-sequence state
@dataclass
class Drafter:
    """The draft state of one sequence: each used layer's KV cache and how many of its
    rows are final, and the backbone hidden rows (by position) the layers read."""

    # generate's per-source counters: a lone MTP drafter's rounds are the totals themselves
    # (``lookup.LookupDrafter`` files the rounds it hands to this drafter under "mtp").
    last_source: ClassVar[str] = ""

    model: Model
    stack: DraftStack
    depth: int
    chain: str
    hidden: str
    capacity: int
    # Test hook: draft from this function of (t, ids, depth) instead of the layers.
    override: Callable[[int, Sequence[int], int], list[int]] | None = None
    head: DraftHead | None = None  # the rows drafts score (None: the full lm_head)
    threshold: float = 0.0  # adaptive depth: stop at a draft less probable than this (0: off)
    record_probs: bool = False  # keep each draft's probability in ``probs`` (the probe)
    # The measured choice of a drafter decoding on its own: a round drafts while MTP rounds
    # emit tokens faster than plain steps (``spec_decision``); None: every round drafts
    # (the probe, and the MTP layers wrapped by ``lookup.LookupDrafter``, whose choice it is).
    decision: SpecDecision | None = None
    probs: list[float] = field(init=False, default_factory=list)  # the last round's, incl. a stopping one
    caches: list[KVCache] = field(init=False)
    committed: list[int] = field(init=False)
    hist: np.ndarray = field(init=False)
    hist_len: int = field(init=False, default=0)
    _round: str = field(init=False, default="mtp")  # what the last round was, for ``decision``

    def __post_init__(self) -> None:
        if self.chain not in CHAINS:
            raise CortiqError(f"unknown MTP chain {self.chain!r}; choose one of {', '.join(CHAINS)}")
        if self.hidden not in HIDDENS:
            raise CortiqError(f"unknown MTP hidden {self.hidden!r}; choose one of {', '.join(HIDDENS)}")
        if self.depth < 1:
            raise CortiqError(f"MTP depth must be >= 1, got {self.depth}")
        if not 0.0 <= self.threshold < 1.0:
            raise CortiqError(f"MTP threshold must be in [0, 1), got {self.threshold}")
        if self.head is None:
            self.head = full_head(self.model.head)
        if self.chain == "independent" and self.depth > self.stack.num_layers:
            raise CortiqError(
                f"MTP depth {self.depth} with independent layers needs {self.depth} draft layers, "
                f"the sidecar has {self.stack.num_layers} (use --mtp-chain recursive)"
            )
        used = self.depth if self.chain == "independent" else 1
        # Recursive drafts add depth-1 provisional rows past the committed ones.
        self.caches = [self.stack.layers[k].make_cache(self.capacity + self.depth) for k in range(used)]
        self.committed = [0] * used
        self.hist = np.zeros((self.capacity, self.model.hidden_size), np.float32)

    def reset(self) -> None:
        """Forget the sequence: empty caches and history (a new generation)."""
        for c in self.caches:
            c.truncate(0)
        self.committed = [0] * len(self.caches)
        self.hist_len = 0
        if self.decision is not None:
            self.decision.reset()  # a new sequence is judged on its own rounds

    def keep(self, n: int) -> None:
        """Keep the backbone rows of positions < n (a conversation's cached prefix); the
        draft layers' caches are rebuilt from them at the next draft."""
        if n > self.hist_len:
            raise ValueError(f"keep({n}): the drafter holds {self.hist_len} backbone rows")
        self.hist_len = n
        for c in self.caches:
            c.truncate(0)
        self.committed = [0] * len(self.caches)

    def observe(self, emitted: int, seconds: float) -> None:
        """A round's outcome (``generate.DraftSource``): timed into ``decision``."""
        if self.decision is not None:
            self.decision.record(self._round, emitted, seconds)

    def describe(self) -> dict:
        """The settings a result reports (``extra["mtp"]``)."""
        return {
            "source": self.stack.source,
            "mtp_depth": self.depth,
            "chain": self.chain,
            "hidden": self.hidden,
            "draft_vocab": self.head.label,
            "threshold": self.threshold,
        }

    # -------------------------------------------------------------- backbone rows
    def note(self, first_pos: int, rows: np.ndarray) -> None:
        """Record the backbone's pre-norm hidden rows of positions first_pos.. (in order)."""
        n = rows.shape[0]
        if first_pos != self.hist_len:
            raise ValueError(f"hidden rows from position {first_pos}, expected {self.hist_len}")
        if first_pos + n > self.capacity:
            raise CortiqError(f"draft history full at {self.capacity} positions")
        if self.hidden == "post":
            rows = self.model.final_norm(rows)
        self.hist[first_pos : first_pos + n] = rows
        self.hist_len += n

    # -------------------------------------------------------------- drafting
    def _choose(self, layer: DraftLayer, out_row: np.ndarray) -> int | None:
        """The draft (a full id) from a layer's output row; None when its probability is
        below the threshold (the round stops drafting)."""
        z = self.head.logits(self.model.kernels, layer.final_norm(out_row))[0]
        i = int(np.argmax(z))
        if self.threshold > 0 or self.record_probs:
            # Softmax probability of the argmax over the scored ids: 1 / sum exp(z - max).
            p = 1.0 / float(np.exp((z - z[i]).astype(np.float64)).sum())
            self.probs.append(p)
            if p < self.threshold:
                return None
        return self.head.full_id(i)

    def draft(self, t: int, ids: Sequence[int], depth: int | None = None) -> list[int]:
        """Up to ``depth`` drafts for positions t+2, t+3, ... after the backbone processed
        position t; ``ids[:t+2]`` are known (committed tokens and the next one). When
        ``ids`` goes further (the teacher-forced probe) its tokens replace the drafts."""
        k_max = min(depth or self.depth, self.depth)
        self.probs = []
        if len(ids) < t + 2 or t >= self.hist_len:
            raise ValueError(f"draft at t={t} needs {t + 2} ids and hidden rows through t")
        if self.decision is not None:
            self._round = "mtp" if self.decision.allow("mtp") else PLAIN
            if self._round == PLAIN:
                return []
        if self.override is not None:
            return [int(d) for d in self.override(t, ids, k_max)][:k_max]
        if self.chain == "independent":
            return self._draft_independent(t, ids, k_max)
        return self._draft_recursive(t, ids, k_max)

    def _catch_up(self, k: int, t: int, ids: Sequence[int], drafts: list[int], shift: int) -> np.ndarray:
        """Run layer ``k``'s cache from its last final row through row t; returns row t's output.
        Row j reads token ids[j + shift] (a draft when past the known ids) and hidden h_j."""
        layer = self.stack.layers[k] if self.chain == "independent" else self.stack.layers[0]
        cache = self.caches[k]
        c = self.committed[k]
        cache.truncate(c)  # drop last round's provisional rows
        toks = [ids[j + shift] if j + shift < len(ids) else drafts[j + shift - len(ids)] for j in range(c, t + 1)]
        out = layer(
            self.model.kernels, self.model.embed_ids(toks), self.hist[c : t + 1], cache, Step(np.arange(c, t + 1))
        )
        self.committed[k] = max(c, min(t + 1, len(ids) - shift))
        return out[-1:]

    def _draft_independent(self, t: int, ids: Sequence[int], k_max: int) -> list[int]:
        drafts: list[int] = []
        for k in range(k_max):
            u = self._catch_up(k, t, ids, drafts, shift=k + 1)
            d = self._choose(self.stack.layers[k], u)
            if d is None:
                break
            drafts.append(d)
        return drafts

    def _draft_recursive(self, t: int, ids: Sequence[int], k_max: int) -> list[int]:
        layer = self.stack.layers[0]
        u = self._catch_up(0, t, ids, [], shift=1)
        first = self._choose(layer, u)
        if first is None:
            return []
        drafts = [first]
        for d in range(1, k_max):
            pos = t + d  # depth d+1 sits one position past depth d, provisional
            tok = ids[pos + 1] if pos + 1 < len(ids) else drafts[-1]
            u = layer(self.model.kernels, self.model.embed_ids([tok]), u, self.caches[0], Step(np.array([pos])))
            nxt = self._choose(layer, u)
            if nxt is None:
                break
            drafts.append(nxt)
        return drafts


def make_drafter(
    model: Model,
    stack: DraftStack,
    capacity: int,
    *,
    depth: int | None = None,
    chain: str | None = None,
    hidden: str = "pre",
    override: Callable[[int, Sequence[int], int], list[int]] | None = None,
    head: DraftHead | None = None,
    threshold: float = 0.0,
    record_probs: bool = False,
    decision: SpecDecision | None = None,
) -> Drafter:
    """A fresh per-sequence drafter; depth defaults to every layer, the chain to
    independent when there are enough layers for the depth, else recursive; ``head``
    to the full lm_head (``cortiq_engine.draft_vocab.sub_head`` makes a vocabulary's);
    ``threshold`` to 0 (adaptive depth off); ``decision`` to None (every round drafts)."""
    depth = stack.num_layers if depth is None else int(depth)
    chain = chain or stack.default_chain(depth)
    return Drafter(
        model, stack, depth, chain, hidden, capacity, override, head, float(threshold), record_probs, decision
    )
