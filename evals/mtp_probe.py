"""Teacher-forced MTP acceptance: what each draft depth would propose at every position
of a real text, given the true previous tokens, against the true next tokens.

For a round starting after position t (the backbone has seen ids[..t], the next
token ids[t+1] is known), depth d drafts the token for t+d+1. Reported per depth:

- *alone*: P(d_k == ids[t+k+1]);
- *chained*: P(d_1..d_k all right) — the rate at which a speculative round would
  accept at least k drafts if the backbone's greedy choice were the text;
- expected tokens per round = 1 + sum_k chained_k.

The drafts come from ``cortiq_engine.mtp.Drafter.draft``, the very path
speculative decoding calls; only the ids it reads go past the pending token. The
counts go into ``cortiq_engine.acceptance.Acceptance``, the counter speculative
decoding and the trainer report, so the figures compare one to one (draft time is
per round; a teacher-forced round has no verify).

Adaptive depth: with a ``threshold`` the drafter stops a round at its first draft less
probable than it (the probe then counts fewer depths for that round). ``ProbeTrace``
keeps every draft's own probability and whether it was right, and ``threshold_table``
replays the rounds under candidate thresholds with a cost model (a computed draft
costs ``draft_ms``, a verify of r rows ``verify_ms[r-1]``) to choose the one with the
least expected time per token.

``run_probe`` is ``cortiq mtp-probe``: a ``ProbeRequest`` in (model, text, drafts as
given), a ``ProbeRun`` out (per variant its counts, with ``choose_threshold`` the
threshold tables, with ``save`` the record written into the sidecar).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

import numpy as np

from evals.text_source import TextSpec, load_text
from formats.errors import CortiqError
from cortiq_engine.acceptance import Acceptance
from cortiq_engine.lookup import DEFAULT_LOOKUP, DEFAULT_NGRAM, NgramIndex

if TYPE_CHECKING:
    from evals.cluster import ClusterReport
    from evals.runs import ClusterRun


@dataclass
class ProbeTrace:
    """Per round and depth of a threshold-free probe: the draft's own probability and
    whether it equals the true token (alone)."""

    probs: np.ndarray  # f64 [rounds, depth]
    right: np.ndarray  # bool [rounds, depth]


@dataclass(frozen=True)
class ThresholdRow:
    threshold: float
    tokens_per_step: float  # tokens a drafting step emits (accepted drafts + 1)
    mean_depth: float  # drafts proposed per step
    ms_per_token: float  # modelled: (computed drafts x draft_ms + verify of the kept rows) / tokens
    speedup: float  # plain ms per token (verify_ms[0]) over ms_per_token

    def to_json(self) -> dict:
        return self.__dict__.copy()


def _round_outcomes(
    trace: ProbeTrace, th: float, draft_ms: float, verify_ms: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(ms, tokens, drafts proposed) of every traced round under threshold ``th``: a round
    computes drafts up to and including the first one below it (all when none is),
    proposes those before it and keeps their right prefix (chained)."""
    rounds, depth = trace.probs.shape
    below = trace.probs < th
    kept = np.where(below.any(axis=1), below.argmax(axis=1), depth)
    computed = np.minimum(kept + 1, depth)
    run = np.cumprod(trace.right, axis=1)  # chained: drafts 1..k all right
    accepted = np.array([run[r, : kept[r]].sum() for r in range(rounds)], np.int64)
    return computed * draft_ms + verify_ms[kept], 1 + accepted, kept


def threshold_table(
    trace: ProbeTrace,
    draft_ms: float,
    verify_ms: Sequence[float],
    candidates: Sequence[float] = (0.0, 0.02, 0.05, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9),
) -> list[ThresholdRow]:
    """Replay the traced rounds under each threshold: a round computes drafts up to and
    including the first one below it, proposes those before it, keeps the right prefix."""
    rounds, depth = trace.probs.shape
    if len(verify_ms) < depth + 1:
        raise ValueError(f"verify_ms needs {depth + 1} entries (1..{depth + 1} rows)")
    rows = []
    for th in candidates:
        cost, tokens, kept = _round_outcomes(trace, th, draft_ms, np.asarray(verify_ms, dtype=np.float64))
        ms_tok = float(cost.sum() / tokens.sum()) if rounds else 0.0
        rows.append(
            ThresholdRow(
                float(th),
                float(tokens.mean()) if rounds else 1.0,
                float(kept.mean()) if rounds else 0.0,
                ms_tok,
                float(verify_ms[0] / ms_tok) if ms_tok else 0.0,
            )
        )
    return rows


def best_setting(trace: ProbeTrace, draft_ms: float, verify_ms: Sequence[float]) -> tuple[int, ThresholdRow]:
    """The (depth, threshold row) of least modelled ms per token over every depth up to
    the traced one: a depth-d round of independent layers drafts what the first d
    columns of the trace hold, so each depth replays those columns."""
    rounds, depth = trace.probs.shape
    best: tuple[int, ThresholdRow] | None = None
    for d in range(1, depth + 1):
        sub = ProbeTrace(trace.probs[:, :d], trace.right[:, :d])
        for row in threshold_table(sub, draft_ms, list(verify_ms)[: d + 1]):
            if best is None or row.ms_per_token < best[1].ms_per_token:
                best = (d, row)
    assert best is not None
    return best


def verify_costs(model, rows_max: int, context: int = 128, reps: int = 21) -> list[float]:
    """Median ms of a backbone forward of 1..rows_max rows plus their lm_head, after a
    ``context``-token prefix (what a verify of r rows costs; r = 1 is a plain decode step).
    The row counts take turns within each repetition, so a drift of the machine's speed
    (another program, the clock) weighs on every count alike, not on the last one."""
    from cortiq_engine.model import forward

    state = model.new_state(context + rows_max)
    forward(state, [0] * context)
    times: list[list[float]] = [[] for _ in range(rows_max)]
    for rep in range(reps + 1):  # the first pass warms the kernels and caches up, untimed
        for r in range(1, rows_max + 1):
            t0 = time.perf_counter()
            h = forward(state, [1] * r)
            model.lm_head(model.final_norm(h))
            if rep:
                times[r - 1].append(time.perf_counter() - t0)
            state.truncate(context)
    return [1e3 * float(np.median(t)) for t in times]


@dataclass(frozen=True)
class Variant:
    chain: str  # "independent" | "recursive"
    hidden: str  # "pre" | "post"

    @property
    def label(self) -> str:
        return f"{self.chain}/{self.hidden}"


def default_variants(num_layers: int, depth: int) -> list[Variant]:
    """Every meaningful chaining at this depth, with both hidden readings."""
    chains = []
    if depth <= num_layers:
        chains.append("independent")
    if depth > 1 or not chains:
        chains.append("recursive")
    return [Variant(c, h) for c in chains for h in ("pre", "post")]


def backbone_hiddens(model, ids: np.ndarray, chunk: int = 256) -> np.ndarray:
    """Pre-final-norm hidden rows of every position of a fresh sequence [len(ids), hidden]."""
    from cortiq_engine.model import forward

    state = model.new_state(len(ids))
    out = np.empty((len(ids), model.hidden_size), np.float32)
    for s in range(0, len(ids), chunk):
        out[s : s + chunk] = forward(state, ids[s : s + chunk])
    return out


def _drafter(model: Any, stack: Any, T: int, depth: int, v: Variant, head: Any, threshold: float, record: bool) -> Any:
    """The drafter of one variant (chain and hidden) over a text of ``T`` tokens."""
    from cortiq_engine.mtp import make_drafter

    return make_drafter(
        model,
        stack,
        T,
        depth=depth,
        chain=v.chain,
        hidden=v.hidden,
        head=head,
        threshold=threshold,
        record_probs=record,
    )


def probe(
    model,
    stack,
    ids: Sequence[int],
    depth: int,
    variants: Sequence[Variant],
    progress: Callable[[int], None] | None = None,
    *,
    head=None,
    threshold: float = 0.0,
    traces: list[ProbeTrace] | None = None,
    starts: Sequence[int] | None = None,
) -> list[tuple[Variant, Acceptance]]:
    """Teacher-forced acceptance of each variant over ``ids`` (``progress(1)`` per position per variant).
    ``head``: the draft head (``Engine.draft_head``; default the full lm_head); ``threshold``:
    adaptive depth; ``traces``: a list that receives each variant's ``ProbeTrace``;
    ``starts``: the round starts t to probe (default every t with a true token at every
    depth; ``live_starts`` picks those a speculative decode would meet)."""
    ids = np.asarray(ids, dtype=np.int64)
    T = len(ids)
    if depth < 1:
        raise CortiqError(f"MTP depth must be >= 1, got {depth}")
    if T < depth + 2:
        raise CortiqError(f"the text has {T} tokens; probing depth {depth} needs at least {depth + 2}")
    rounds = range(T - depth - 1) if starts is None else [int(t) for t in starts]
    if any(not 0 <= t < T - depth - 1 for t in rounds):
        raise ValueError(f"round starts must lie in 0..{T - depth - 2}")
    hidden = backbone_hiddens(model, ids)
    id_list = [int(i) for i in ids]
    results = []
    for v in variants:
        drafter = _drafter(model, stack, T, depth, v, head, threshold, traces is not None)
        drafter.note(0, hidden)
        counts, trace = _rounds(drafter, id_list, rounds, depth, traces is not None, progress)
        if traces is not None:
            traces.append(trace)
        results.append((v, counts))
    return results


def _rounds(
    drafter, id_list: list[int], rounds: Sequence[int], depth: int, trace: bool, progress: Callable[[int], None] | None
) -> tuple[Acceptance, ProbeTrace | None]:
    """Draft each round start of ``rounds`` in order against the text's tokens."""
    counts = Acceptance(depth)
    probs, right = [], []
    # Round starts t whose every depth has a true token: t + depth + 1 <= T - 1.
    for t in rounds:
        t0 = time.perf_counter()
        drafts = drafter.draft(t, id_list, depth)
        truth = id_list[t + 2 : t + 2 + depth]
        counts.record_forced(drafts, truth, time.perf_counter() - t0)
        if trace:
            # Without a threshold every depth is drafted; with one, the trace is partial.
            probs.append(drafter.probs + [0.0] * (depth - len(drafter.probs)))
            right.append([int(d) == int(y) for d, y in zip(drafts, truth)] + [False] * (depth - len(drafts)))
        if progress is not None:
            progress(1)
    if not trace:
        return counts, None
    return counts, ProbeTrace(np.array(probs, np.float64).reshape(-1, depth), np.array(right, bool).reshape(-1, depth))


# ------------------------------------------------------------ the probe in windows of rounds
# A window of rounds is one task of ``evals.cluster``; its counts are integers, so adding
# the windows' counts gives the one-pass counts whatever the order.
ROUNDS_PER_WINDOW = 32


def round_windows(n_tokens: int, depth: int, per_window: int = ROUNDS_PER_WINDOW) -> list[tuple[int, int]]:
    """The probe's round starts 0..n_tokens-depth-2 cut into consecutive [first, last) spans."""
    n = max(n_tokens - depth - 1, 0)
    return [(a, min(a + per_window, n)) for a in range(0, n, per_window)]


@dataclass
class ProbeWindow:
    """One window of rounds, per variant (in the order given): its counts and, when traced, its trace rows."""

    counts: list[Acceptance]
    traces: list[ProbeTrace] | None


def _replay(drafter, id_list: list[int], upto: int, depth: int) -> None:
    """Bring the drafter's layer caches to where rounds 0..upto-1 of ``probe`` leave them,
    computing their rows as those rounds do (one row per layer per round), so round
    ``upto`` and every later one compute exactly what they compute in one pass."""
    if drafter.threshold > 0 and drafter.chain == "independent":
        # A round stops at its first unlikely draft and leaves the later layers' rows to a
        # later round, in one batch: only drafting those rounds reproduces that.
        for t in range(upto):
            drafter.draft(t, id_list, depth)
        return
    # Without a stop every round catches each used layer up by exactly its row t (layer k reads
    # the token k+1 positions on; a recursive chain uses layer 0 alone): the rows, not the drafts.
    for t in range(upto):
        for k in range(len(drafter.caches)):
            drafter._catch_up(k, t, id_list, [], shift=k + 1)


def probe_window(
    model,
    stack,
    ids: Sequence[int],
    hidden: np.ndarray,
    depth: int,
    variants: Sequence[Variant],
    first: int,
    last: int,
    *,
    head=None,
    threshold: float = 0.0,
    trace: bool = False,
) -> ProbeWindow:
    """Rounds ``first``..``last``-1 of ``probe`` over ``ids`` (``hidden``: ``backbone_hiddens``
    of all of ``ids``), with the same drafts, probabilities and counts as that one pass."""
    T = len(ids)
    if not 0 <= first <= last <= T - depth - 1:
        raise ValueError(f"rounds {first}..{last} outside 0..{T - depth - 1}")
    id_list = [int(i) for i in ids]
    counts, traces = [], []
    for v in variants:
        drafter = _drafter(model, stack, T, depth, v, head, threshold, trace)
        drafter.note(0, hidden)
        _replay(drafter, id_list, first, depth)
        c, tr = _rounds(drafter, id_list, range(first, last), depth, trace, None)
        counts.append(c)
        if tr is not None:
            traces.append(tr)
    return ProbeWindow(counts, traces if trace else None)


# ------------------------------------------------------------ defaults from the backbone's own text
# Fewer live rounds than this choose nothing: the modelled speedups of near thresholds
# would differ by chance.
MIN_LIVE_ROUNDS = 64


def live_starts(tokens: np.ndarray, greedy: np.ndarray, depth: int) -> np.ndarray:
    """Round starts t of one window that a speculative greedy decode meets: the pending
    token and the truth of every depth are the backbone's own greedy choices
    (``tokens[j + 1] == greedy[j]`` for j = t..t+depth), so a teacher-forced round there
    drafts and checks what a live round would."""
    tokens, greedy = np.asarray(tokens), np.asarray(greedy)
    ok = (tokens[1:] == greedy[:-1]).astype(np.int64)  # ok[j]: token j+1 is greedy after j
    n = len(tokens) - depth - 1  # starts with a true token at every depth
    if n <= 0:
        return np.zeros(0, np.int64)
    run = np.convolve(ok, np.ones(depth + 1, np.int64), mode="valid")[:n]  # sum of ok[t..t+depth]
    return np.flatnonzero(run == depth + 1).astype(np.int64)


def lookup_rounds(
    tokens: np.ndarray, starts: Sequence[int], lookup: int, ngram: tuple[int, int], greedy: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For each round start t: whether n-gram lookup (``cortiq_engine.lookup``, on
    tokens[:t+2]) drafts that round, so the MTP layers never see it; how many drafts;
    how many a verify accepts. The truth of draft i is ``greedy[t+1+i]`` while
    tokens[t+2..t+1+i] are themselves greedy (the live prefix), else the round stops
    counting; without ``greedy`` it is the text, tokens[t+2+i]."""
    index = NgramIndex(*ngram)
    toks = [int(x) for x in tokens]
    hit = np.zeros(len(starts), bool)
    n = np.zeros(len(starts), np.int64)
    acc = np.zeros(len(starts), np.int64)
    for r, t in enumerate(int(x) for x in starts):
        drafts = index.continuation(toks, lookup, end=t + 2)
        if not drafts:
            continue
        hit[r], n[r] = True, len(drafts)
        for i, d in enumerate(drafts):
            p = t + 1 + i  # the draft is the token after position p
            if greedy is not None:
                if p >= len(greedy) or (i > 0 and toks[p] != int(greedy[p - 1])):
                    break
                truth = int(greedy[p])
            else:
                if p + 1 >= len(toks):
                    break
                truth = toks[p + 1]
            if d != truth:
                break
            acc[r] += 1
    return hit, n, acc


def with_lookup_setting(
    trace: ProbeTrace,
    looked: np.ndarray,
    n_drafts: np.ndarray,
    accepted: np.ndarray,
    keys: Sequence[tuple[int, int]],
    draft_ms: float,
    verify_ms: Sequence[float],
    lookup: int,
    ngram: tuple[int, int],
    candidates: Sequence[float] = (0.0, 0.02, 0.05, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9),
) -> dict:
    """The fastest depth and threshold of the MTP layers when lookup drafts first.

    ``keys[r]`` = (window, t) of traced round r. Each setting is replayed as a live
    decode walks: a round at t emits its tokens and the next round starts that many
    positions on (at the next traced start when that one is not traced: the text left
    the backbone's greedy path). A lookup round costs a verify of its rows and emits
    its accepted drafts plus one whatever the layers do; an MTP round follows the
    layers' trace under the setting. (Counting every start instead would weigh the
    lookup's long rounds by their length once more.)"""
    from bisect import bisect_left

    rounds, depth = trace.probs.shape
    vm = np.asarray(verify_ms, np.float64)
    look_ms = vm[n_drafts] if rounds else np.zeros(0)
    look_tok = 1 + np.asarray(accepted, np.int64)
    by_window: dict[int, list[tuple[int, int]]] = {}
    for r, (w, t) in enumerate(keys):
        by_window.setdefault(int(w), []).append((int(t), r))
    walks = [sorted(v) for v in by_window.values()]
    best = None
    for d in range(1, depth + 1):
        sub = ProbeTrace(trace.probs[:, :d], trace.right[:, :d])
        for th in candidates:
            ms, tok, _ = _round_outcomes(sub, th, draft_ms, vm)
            ms = np.where(looked, look_ms, ms)
            tok = np.where(looked, look_tok, tok)
            total_ms = total_tok = 0.0
            n_look = n_rounds = 0
            for walk in walks:
                ts = [t for t, _ in walk]
                i = 0
                while i < len(walk):
                    r = walk[i][1]
                    total_ms += ms[r]
                    total_tok += tok[r]
                    n_look += bool(looked[r])
                    n_rounds += 1
                    i = bisect_left(ts, walk[i][0] + int(tok[r]), i + 1)
            ms_tok = total_ms / total_tok
            if best is None or ms_tok < best[0]:
                best = (ms_tok, d, float(th), n_look, n_rounds, total_tok)
    assert best is not None  # every traced window walks at least one round
    ms_tok, d, th, n_look, n_rounds, total_tok = best
    return {
        "lookup": int(lookup),
        "ngram": [int(ngram[0]), int(ngram[1])],
        "depth": d,
        "threshold": th,
        "modelled_speedup": round(float(vm[0] / ms_tok), 4),
        "lookup_rounds": n_look,
        "rounds": n_rounds,
        "tokens_per_round": round(total_tok / n_rounds, 4),
    }


@dataclass(frozen=True)
class LiveDefaults:
    """What ``measure_defaults`` found: the fastest depth and threshold (``record``, as
    ``formats.sidecar.write_defaults`` stores it) or why none (``reason``)."""

    record: dict | None
    rounds: int
    counts: Acceptance | None
    reason: str = ""


def measure_defaults(
    model,
    stack,
    head,
    tokens: np.ndarray,
    greedy: np.ndarray,
    source: str,
    progress: Callable[[int], None] | None = None,
    *,
    lookup: int = DEFAULT_LOOKUP,
    ngram: tuple[int, int] = DEFAULT_NGRAM,
) -> LiveDefaults:
    """The depth and adaptive-depth threshold of least modelled time per token on windows
    of the backbone's own greedy text (``tokens``, ``greedy`` [W, T]: mtp-train's held-out
    windows), through the drafts generate runs (independent layers, pre-norm hidden, the
    ``head`` generate scores): the live rounds of each window (``live_starts``) are probed
    at every depth, then replayed under each threshold with this machine's draft and
    verify costs (``best_setting``). With ``lookup`` > 0 the record also holds
    ``with_lookup``: the setting measured fastest when n-gram lookup drafts first (what
    generate runs by default), from the same rounds (``with_lookup_setting``)."""
    depth = stack.num_layers
    if stack.default_chain(depth) != "independent":
        return LiveDefaults(
            None, 0, None, "the drafts chain recursively (defaults are measured for independent layers)"
        )
    variant = Variant("independent", "pre")
    counts = Acceptance(depth)
    probs, right, looks, keys = [], [], [], []
    for w in range(tokens.shape[0]):
        starts = live_starts(tokens[w], greedy[w], depth)
        if not len(starts):
            continue
        traces: list[ProbeTrace] = []
        ((_, c),) = probe(model, stack, tokens[w], depth, [variant], progress, head=head, traces=traces, starts=starts)
        counts.merge(c)
        probs.append(traces[0].probs)
        right.append(traces[0].right)
        looks.append(lookup_rounds(tokens[w], starts, lookup, ngram, greedy[w]))
        keys.extend((w, int(t)) for t in starts)
    rounds = int(sum(len(p) for p in probs))
    if rounds < MIN_LIVE_ROUNDS:
        return LiveDefaults(
            None,
            rounds,
            counts if rounds else None,
            f"{rounds} live round(s) in the held-out windows (the backbone's own text), "
            f"fewer than {MIN_LIVE_ROUNDS}: train with --self-distill or --chat",
        )
    trace = ProbeTrace(np.concatenate(probs), np.concatenate(right))
    verify_ms = verify_costs(model, max(depth, lookup) + 1)
    draft_ms = 1e3 * counts.draft_seconds / max(counts.drafting_rounds, 1) / depth  # per computed draft
    d, row = best_setting(trace, draft_ms, verify_ms)
    record = {
        "depth": d,
        "threshold": row.threshold,
        "modelled_speedup": round(row.speedup, 4),
        "tokens_per_step": round(row.tokens_per_step, 4),
        "text": source,
        "tokens": rounds,
        "draft_vocab": head.label,
        "verify_ms_by_rows": verify_ms,
        "draft_ms": draft_ms,
        "measured_on": "live rounds of the held-out windows (the backbone's greedy text)",
    }
    if lookup > 0:
        looked, n_drafts, accepted = (np.concatenate(x) for x in zip(*looks))
        record["with_lookup"] = with_lookup_setting(
            trace, looked, n_drafts, accepted, keys, draft_ms, verify_ms, lookup, ngram
        )
    return LiveDefaults(record, rounds, counts)


def save_live_defaults(
    model_path,
    sidecar,
    tokens: np.ndarray,
    greedy: np.ndarray,
    source: str,
    *,
    threads: int | None = None,
    progress: Callable[[int], None] | None = None,
) -> LiveDefaults:
    """``measure_defaults`` on the backbone at ``model_path`` with the draft layers of
    ``sidecar`` (the engine generate runs, its draft vocabulary), and the record written
    into the sidecar when one was found: ``generate`` then drafts so by default."""
    from cortiq_engine import Engine
    from formats.sidecar import write_defaults

    eng = Engine.load(model_path, threads=threads, mtp=sidecar)
    found = measure_defaults(
        eng.model,
        eng.drafts,
        eng.draft_head(None),
        np.asarray(tokens, np.int64),
        np.asarray(greedy, np.int64),
        source,
        progress,
    )
    if found.record is not None:
        write_defaults(sidecar, found.record)  # staged and renamed over: the open map stays valid
    return found


# ------------------------------------------------------------ the probe of a model on a text
@dataclass(frozen=True)
class ProbeRequest:
    """What ``cortiq mtp-probe`` probes: the model, the text and the drafts as given."""

    model: Path
    text: TextSpec = TextSpec()
    max_tokens: int = 512  # the text's first tokens
    mtp: Path | None = None  # the sidecar (None: inline layers, else the sidecar beside the model)
    depth: int | None = None  # None: every draft layer
    chain: str = "all"  # "all" or one of cortiq_engine.mtp.CHAINS
    hidden: str = "all"  # "all" or one of cortiq_engine.mtp.HIDDENS
    vocab: str | None = None  # read as --mtp-vocab is (cortiq_engine.draft_vocab.parse_vocab)
    threshold: float | None = None
    choose_threshold: bool = False  # also time verifies and replay the rounds under candidate thresholds
    save: bool = False  # record the fastest independent/pre setting in the sidecar
    threads: int | None = None


@dataclass(frozen=True)
class ProbeRun:
    """Everything ``run_probe`` found, per variant in the order probed."""

    model: Path
    mtp: str  # where the draft layers came from: "inline" or the sidecar's path
    style: str
    draft_layers: int
    depth: int
    text: str  # the text's one-line description
    tokens: int
    draft_vocab: Any  # the draft head's label: its size, or "full"
    threshold: float
    results: list[tuple[Variant, Acceptance]]
    verify_ms: list[float] | None = None  # with choose_threshold: a verify of 1.. rows
    thresholds: list[list[ThresholdRow]] | None = None  # with choose_threshold, per variant
    saved: dict | None = None  # with save: the record written into the sidecar
    cluster: ClusterReport | None = None

    def to_json(self) -> dict:
        doc = {
            "model": str(self.model),
            "mtp": self.mtp,
            "style": self.style,
            "draft_layers": self.draft_layers,
            "depth": self.depth,
            "text": self.text,
            "tokens": self.tokens,
            "draft_vocab": self.draft_vocab,
            "threshold": self.threshold,
            "variants": [{"chain": v.chain, "hidden": v.hidden, **counts.to_json()} for v, counts in self.results],
            **({"cluster": self.cluster.to_json()} if self.cluster is not None else {}),
        }
        if self.thresholds is not None:
            doc["verify_ms_by_rows"] = self.verify_ms
            for entry, rows in zip(doc["variants"], self.thresholds):
                entry["thresholds"] = [r.to_json() for r in rows]
        if self.saved is not None:
            doc["saved"] = self.saved
        return doc


def _choices(value: str, allowed: tuple[str, ...], flag: str) -> list[str]:
    if value == "all":
        return list(allowed)
    if value not in allowed:
        raise CortiqError(f"unknown {flag} {value!r}; choose all or one of {', '.join(allowed)}")
    return [value]


def _check_save(req: ProbeRequest, source: str, variants: Sequence[Variant]) -> None:
    """The combinations ``choose_threshold`` and ``save`` refuse (``source``: the draft layers')."""
    if req.choose_threshold and req.threshold:
        raise CortiqError("--choose-threshold replays thresholds itself; leave --mtp-threshold out")
    if req.save and not req.choose_threshold:
        raise CortiqError("--save records what --choose-threshold measures: give both")
    if req.save and source == "inline":
        raise CortiqError("--save writes to an MTP sidecar; these draft layers are inline in the model file")
    if req.save and req.vocab is not None:
        raise CortiqError(
            "--save measures the sidecar's own draft vocabulary (the one generate uses): leave --mtp-vocab out"
        )
    if req.save and not any(v.chain == "independent" and v.hidden == "pre" for v in variants):
        raise CortiqError(
            "--save measures the drafts generate runs (independent layers, pre-norm hidden): "
            "leave --mtp-chain and --mtp-hidden at all, or set them to independent and pre"
        )


def _saved_setting(
    trace: ProbeTrace, draft_ms: float, verify_ms: list[float], ids: list[int], text: str, draft_vocab: Any
) -> dict:
    """The record ``save`` writes: the fastest depth and threshold of the traced rounds, and
    the fastest when n-gram lookup drafts first (generate's default), the probe's rounds
    being every t and the text their truth."""
    d, row = best_setting(trace, draft_ms, verify_ms)
    rounds = trace.probs.shape[0]
    looked = lookup_rounds(ids, range(rounds), DEFAULT_LOOKUP, DEFAULT_NGRAM)
    keys = [(0, t) for t in range(rounds)]
    return {
        "depth": d,
        "threshold": row.threshold,
        "modelled_speedup": round(row.speedup, 4),
        "tokens_per_step": round(row.tokens_per_step, 4),
        "text": text,
        "tokens": len(ids),
        "draft_vocab": draft_vocab,
        "verify_ms_by_rows": verify_ms,
        "with_lookup": with_lookup_setting(trace, *looked, keys, draft_ms, verify_ms, DEFAULT_LOOKUP, DEFAULT_NGRAM),
    }


def run_probe(
    req: ProbeRequest, progress: Callable[[int, int], None] | None = None, cluster: ClusterRun | None = None
) -> ProbeRun:
    """Teacher-forced acceptance of every asked variant of the model's draft layers over the
    text's first ``max_tokens`` tokens (in this process, ``progress`` getting (rounds done,
    rounds to do); or on a Ray cluster in windows of rounds, ``evals.cluster.probe_mtp``).
    With ``choose_threshold`` each variant's rounds are replayed under candidate thresholds
    with this machine's draft and verify costs; with ``save`` the fastest independent/pre
    setting is written into the sidecar, as generate's defaults. A cluster run interrupted
    before its last window raises ``evals.runs.ClusterInterrupted`` (no figures of part of
    the rounds)."""
    from cortiq_engine import Engine
    from cortiq_engine.mtp import CHAINS, HIDDENS
    from evals.tokens import encode_sharded

    loaded = load_text(req.text)
    eng = Engine.load(req.model, threads=req.threads, mtp=req.mtp if req.mtp is not None else True)
    stack = eng.drafts
    if stack is None:
        raise CortiqError(
            f"{req.model}: no MTP draft layers (none inline, no sidecar beside it); train them with "
            f"`cortiq mtp-train {req.model}` (it writes the sidecar beside the model), or give --mtp PATH"
        )
    ids = encode_sharded(eng.tokenizer, loaded.pieces(), limit=req.max_tokens).tolist()  # the text's first tokens
    k = req.depth or stack.num_layers
    chains, hiddens = _choices(req.chain, CHAINS, "--mtp-chain"), _choices(req.hidden, HIDDENS, "--mtp-hidden")
    variants = [v for v in default_variants(stack.num_layers, k) if v.chain in chains and v.hidden in hiddens]
    if not variants:
        raise CortiqError(
            f"--mtp-chain independent needs a draft layer per depth: depth {k}, {stack.num_layers} layers"
        )
    _check_save(req, stack.source, variants)
    head = eng.draft_head(req.vocab)
    threshold = req.threshold or 0.0
    traces: list[ProbeTrace] | None = [] if req.choose_threshold else None
    creport = None
    if cluster is not None:
        from evals.cluster import probe_mtp
        from evals.runs import ClusterInterrupted

        # The workers load the same draft layers: inline, or this sidecar (checked to be the driver's file).
        sidecar = None if stack.source == "inline" else Path(stack.source)
        results, got, complete, creport = probe_mtp(
            cluster.where,
            cluster.threads or eng.threads,
            req.model,
            sidecar,
            ids,
            k,
            variants,
            vocab=req.vocab,
            threshold=threshold,
            trace=traces is not None,
            resume=cluster.resume,
            progress=cluster.progress,
        )
        if not complete:
            raise ClusterInterrupted(creport)
        if traces is not None:
            traces.extend(got)
    else:
        step = None
        if progress is not None:
            total, done = max(len(ids) - k - 1, 0) * len(variants), 0
            progress(0, total)

            def step(n: int) -> None:
                nonlocal done
                done += n
                progress(done, total)

        results = probe(eng.model, stack, ids, k, variants, step, head=head, threshold=threshold, traces=traces)
    run = ProbeRun(
        req.model,
        stack.source,
        stack.style,
        stack.num_layers,
        k,
        loaded.source,
        len(ids),
        head.label,
        threshold,
        results,
        cluster=creport,
    )
    if traces is None:
        return run
    verify_ms = verify_costs(eng.model, max(k, DEFAULT_LOOKUP) + 1)
    tables, saved = [], None
    for (v, counts), trace in zip(results, traces):
        draft_ms = 1e3 * counts.draft_seconds / max(counts.drafting_rounds, 1) / k  # per computed draft
        tables.append(threshold_table(trace, draft_ms, verify_ms))
        if req.save and (v.chain, v.hidden) == ("independent", "pre"):
            saved = _saved_setting(trace, draft_ms, verify_ms, ids, loaded.source, head.label)
    if saved is not None:
        from formats.sidecar import write_defaults

        write_defaults(stack.source, saved)  # staged and renamed over: the open map stays valid
    return dataclasses.replace(run, verify_ms=verify_ms, thresholds=tables, saved=saved)
