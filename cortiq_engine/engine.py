"""``Engine``: the Python API the CLI, the evals and the tests use.

It opens a CMF file (weights stay in its memory map), builds the model for the
file's architecture, loads the embedded tokenizer, and compiles the kernels up
front so the first token's timing is not JIT time.

It owns speculation too: ``Engine.load(path, mtp=True)`` loads the model's MTP
draft layers (inline, or the sidecar beside it; ``mtp=PATH`` a given sidecar), and
``Engine.generate(..., speculative=...)`` decides plain or speculative decoding
(``drafter``) and builds the per-sequence drafter.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Iterator, Sequence

import numpy as np

from formats.arch import ArchConfig
from formats.cmf import CmfFile
from formats.convert import TOKENIZER_TENSOR
from formats.errors import CortiqError
from formats.untrusted_json import section
from cortiq_engine.cache import kv_dtype
from cortiq_engine.generate import PREFILL_CHUNK, DraftSource, GenerationResult, TokenEvent, generate
from cortiq_engine.kernels import (
    CompileMeter,
    CompileReport,
    WarmupEvent,
    cold_estimate,
    compiles,
    get_kernels,
    is_warm,
    mark_warm,
)
from cortiq_engine.memory import release_free_heap
from cortiq_engine.model import Model, State, forward
from cortiq_engine.models import build_model, read_arch
from cortiq_engine.draft_vocab import DraftHead, full_head, pick_vocab, sub_head
from cortiq_engine.lookup import DEFAULT_LOOKUP, DEFAULT_NGRAM, LookupDrafter
from cortiq_engine.mtp import DEFAULT_THRESHOLD, DraftStack, Drafter, header_digest, load_draft_stack, make_drafter
from cortiq_engine.sampling import SamplingConfig
from cortiq_engine.spec_decision import MODELLED_ROUNDS, Prior, SpecDecision, SpecMemory, modelled_ratio
from cortiq_engine.threads import DecodeThreads, set_threads
from cortiq_engine.tokenizer import Tokenizer, header_eos_ids

DEFAULT_CTX = 4096
# f32 logits per output-layer call of ``iter_logits``: 128 rows of SmolLM2's 49,152-token
# vocabulary, 32 of Gemma 3's 262,144.
LOGIT_BLOCK_BYTES = 32 << 20


def check_ctx_memory(model: Model, ctx: int) -> None:
    """Refuse a context whose KV caches could not fit in this machine's memory (a
    typo such as --ctx 1000000000000 is one line, not a MemoryError). Latent attention
    caches one row of kv_lora_rank + qk_rope_head_dim values per position and layer
    (``cortiq_engine.mla.MlaCache``), not per-head keys and values."""
    a = model.arch
    row = (
        a.mla.kv_lora_rank + a.mla.qk_rope_head_dim
        if a.mla is not None
        else a.num_kv_heads * (a.head_dim + a.v_head_dim)
    )
    per_token = a.num_layers * row * np.dtype(kv_dtype(model.kv_cache)).itemsize
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        total = 1 << 40
    if ctx * per_token > total:
        raise CortiqError(
            f"--ctx {ctx} needs {ctx * per_token / 2**30:.1f} GiB of KV cache, more than this machine's {total / 2**30:.1f} GiB"
        )


@dataclass(frozen=True)
class SpeculativeConfig:
    """How to draft: ``depth`` drafts per round (default: every draft layer), ``chain``
    "independent" | "recursive" (default: independent when there is a layer per depth),
    ``hidden`` "pre" | "post" (the backbone hidden before or after its final norm),
    ``vocab`` the draft vocabulary: None, the sidecar's when it has one; "full" (or 0),
    the full lm_head; n, the first n ids of the sidecar's; ``threshold`` the adaptive-depth
    probability below which a round stops drafting (None: ``mtp.DEFAULT_THRESHOLD``; 0: off).
    Unset ``depth`` and ``threshold`` take the sidecar's measured defaults where it has
    them (``cortiq mtp-probe --choose-threshold --save``) and ``vocab`` is unset.

    ``lookup``: drafts per round from n-gram lookup in the sequence itself
    (``cortiq_engine.lookup``), tried before the MTP layers each round; None, the
    default (``lookup.DEFAULT_LOOKUP``), alone when no draft layers are loaded (for
    ``speculative=None``: greedy decoding without draft layers drafts by lookup); 0, off;
    n > 0, on (alone when no draft layers are loaded). ``ngram``: its
    (min, max) match length.

    ``decide``: each source (lookup, the MTP layers) drafts only while its rounds emit
    tokens faster than plain steps on this machine, measured during the generation
    (``cortiq_engine.spec_decision``; the output is plain greedy's either way); False,
    every round drafts (benchmarks measuring a source's own rate). ``mtp_gate`` is
    accepted for the CLI's flag and adds nothing: ``decide`` covers the MTP rounds."""

    depth: int | None = None
    chain: str | None = None
    hidden: str | None = None
    vocab: int | str | None = None
    threshold: float | None = None
    lookup: int | None = None
    ngram: tuple[int, int] | None = None
    mtp_gate: bool = False
    decide: bool = True

    @property
    def explicit(self) -> bool:
        """MTP settings were given (they need draft layers)."""
        return any(v is not None for v in (self.depth, self.chain, self.hidden, self.vocab, self.threshold))


@dataclass(eq=False)
class Trunk:
    """A model file opened for computing: its map, its architecture, the trunk on a
    kernel set, its tokenizer (None: the file has none, or it was not asked for) and
    the thread count the pools were set to."""

    cmf: CmfFile
    arch: ArchConfig
    model: Model
    tokenizer: Tokenizer | None
    threads: int

    @property
    def header(self) -> dict:
        return self.cmf.header

    @property
    def path(self) -> Path:
        return Path(self.cmf.path)


def open_trunk(
    path: str | os.PathLike,
    *,
    threads: int | None = None,
    kernels: str | object | None = None,
    wrap_kernels: Callable[[object], object] | None = None,
    kv_cache: str = "f32",
    tokenizer: bool = True,
) -> Trunk:
    """The one way every command opens a model file: the thread pools set up
    (``threads.set_threads``: ``threads`` None is every usable core), the kernel set
    chosen (a name, see ``Engine.load``, or a set; ``wrap_kernels`` wraps it, as
    imatrix's recorder does), the file mapped and checked to be a model, its trunk
    built and, with ``tokenizer``, its tokenizer loaded. Bad input is a one-line
    ``CortiqError`` and leaves the file closed."""
    kv_dtype(kv_cache)  # an unknown name fails before the model is mapped
    n_threads = set_threads(threads)  # before the kernels: numba's pool starts with its wait policy
    ks = get_kernels(kernels) if kernels is None or isinstance(kernels, str) else kernels
    if wrap_kernels is not None:
        ks = wrap_kernels(ks)
    cmf = CmfFile(path)
    try:
        header = cmf.header
        if header.get("role", "model") != "model":
            raise CortiqError(
                f"{path}: not a model file (role {header.get('role')!r}); an MTP sidecar is loaded with its model"
            )
        if not isinstance(header.get("arch"), dict):
            raise CortiqError(f"{path}: not a model file (the header has no arch section)")
        arch = read_arch(cmf)
        model = replace(build_model(cmf, arch, ks), kv_cache=kv_cache)
        tok = None
        if tokenizer and TOKENIZER_TENSOR in cmf:
            tok = Tokenizer(
                cmf.raw_bytes(TOKENIZER_TENSOR), section(header, "tokenizer", str(path)), name=Path(path).name
            )
    except BaseException:
        cmf.close()
        raise
    return Trunk(cmf, arch, model, tok, n_threads)


class Engine:
    def __init__(
        self,
        cmf: CmfFile,
        model: Model,
        tokenizer: Tokenizer | None,
        ctx: int,
        threads: int,
        drafts: DraftStack | None = None,
        adaptive_threads: bool = False,
    ):
        self.cmf = cmf
        self.path = cmf.path
        self.model = model
        self.header = cmf.header
        self.arch: ArchConfig = model.arch
        self.ctx = ctx
        self.threads = threads
        # Adapts when the user left the count open (see DecodeThreads).
        self.decode_threads = DecodeThreads(threads, adaptive=adaptive_threads)
        self.kernels = model.kernels
        self._tokenizer = tokenizer
        self.drafts = drafts  # the MTP draft layers, when loaded with mtp=...
        # Draft heads built so far, by vocabulary size (the row gather runs once per size).
        self._draft_heads: dict[int | None, DraftHead] = {}
        # What the load's warm-up compiled (None: loaded without one).
        self.compile_report: CompileReport | None = None
        # Where the measured rates of speculative decoding are remembered across runs
        # (``SpecMemory.default()``, as the CLI sets it); None: each generation measures anew.
        self.spec_memory: SpecMemory | None = None
        self._model_digest: str | None = None  # the model's name in that memory, taken at first use

    # ---------------------------------------------------------------- loading
    @classmethod
    def load(
        cls,
        path: str | os.PathLike,
        threads: int | None = None,
        ctx: int | None = None,
        kernels: str | object | None = None,
        warmup: bool = True,
        mtp: bool | str | os.PathLike = False,
        kv_cache: str = "f32",
        on_warmup: Callable[[WarmupEvent], None] | None = None,
    ) -> "Engine":
        """Open ``path``; ``ctx`` defaults to min(max_position_embeddings, 4096);
        ``kernels`` a kernel set's name (``cortiq_engine.kernels.KERNEL_CHOICES``; default
        $CORTIQ_KERNELS, else numba) or a kernel set itself (e.g. ``NumbaKernels(amx_tiles=False)``).

        ``mtp``: False, no draft layers; True, the model's own (inline, else the sidecar
        ``<stem>.mtp.cmf`` beside it, else none); a path, that sidecar. A sidecar that
        does not fit the backbone is an error, never a silent fallback.

        ``kv_cache``: the KV caches' element type, "f32" or "f16" (``cache.KV_DTYPES``).

        ``warmup``: compile every kernel a run uses before returning (``Engine.warmup``;
        ``on_warmup`` hears its progress, ``compile_report`` says what it compiled)."""
        trunk = open_trunk(path, threads=threads, kernels=kernels, kv_cache=kv_cache)
        cmf, arch, model = trunk.cmf, trunk.arch, trunk.model
        try:
            if ctx is None:
                ctx = min(arch.max_position_embeddings, DEFAULT_CTX)
            if ctx < 1:
                raise CortiqError(f"--ctx must be >= 1, got {ctx}")
            check_ctx_memory(model, int(ctx))
        except BaseException:
            cmf.close()
            raise
        # Parsing tokenizer.json leaves ~25 MiB of freed heap (SmolLM2's 49k-token BPE);
        # returned now, before later allocations land above it and pin it.
        release_free_heap()
        ks, tok, n_threads = model.kernels, trunk.tokenizer, trunk.threads
        drafts = None
        if mtp is not False:
            drafts = load_draft_stack(cmf, arch, ks, path=None if mtp is True else mtp)
        eng = cls(cmf, model, tok, int(ctx), n_threads, drafts, adaptive_threads=threads is None)
        if drafts is not None and drafts.vocab is not None:
            eng.draft_head()  # the row gather at load, not in the first generation
        if warmup:
            eng.warmup(on_warmup)
        release_free_heap()
        return eng

    def _model_kind(self) -> list[str]:
        """What selects this model's kernels: its dtypes, KV cache type and attention geometry."""
        a = self.arch
        return [
            a.arch,
            self.model.kv_cache,
            f"{a.head_dim}/{a.v_head_dim}",
            repr(getattr(a, "sliding", None)),
            repr(a.mla is not None),
            *sorted({w.dtype for w in self._weights()}),
        ]

    def _weights(self) -> list:
        """The backbone's weights and the loaded draft layers'."""
        return list(self.model.weights()) + (list(self.drafts.weights()) if self.drafts is not None else [])

    def warmup(self, on_event: Callable[[WarmupEvent], None] | None = None) -> CompileReport:
        """Run every kernel a run of this model uses once on tiny inputs, so each is
        compiled (or loaded from the on-disk caches) before any timed work: each dtype's
        dequantization, a decode step and a 2-row speculative verify, a prefill of more
        rows than the small-batch kernels take (its tile products, blocked attention and
        row-parallel activations are other kernels) and the output layer on both.

        ``on_event`` hears a "cold" event before compiling when this machine has not
        warmed this kind of model with these caches (or at the first compile when it
        turns out to need one), then each step and compile. Returns (and keeps as
        ``compile_report``) what was compiled."""
        ks, model = self.kernels, self.model
        say = on_event or (lambda ev: None)
        kind = self._model_kind()
        n = int(ks.row_exact_rows) + 1  # the first row count that takes the prefill kernels
        by_dtype = {w.dtype: w for w in self._weights()}

        def decode() -> None:
            st = model.new_state(3)
            forward(st, [0, 0])
            model.lm_head(model.final_norm(forward(st, [0])))

        def prefill() -> None:
            st = model.new_state(n)
            model.lm_head(model.final_norm(forward(st, [0] * n)))

        steps: list[tuple[str, Callable[[], None]]] = [
            *((f"{d} tiles", (lambda w=w: ks.warmup([w]))) for d, w in sorted(by_dtype.items())),
            ("decode", decode),
            ("prefill", prefill),
        ]
        announced = compiles(ks) and not is_warm(ks, kind)
        cold = [announced]

        def on_kernel(name: str) -> None:
            if not cold[0]:
                cold[0] = True
                say(WarmupEvent("cold", total=len(steps), estimate=cold_estimate()))
            say(WarmupEvent("kernel", name=name))

        if announced:
            say(WarmupEvent("cold", total=len(steps), estimate=cold_estimate()))
        meter = CompileMeter(on_kernel)
        t0 = time.perf_counter()
        try:
            with meter.measure():
                for i, (name, run) in enumerate(steps):
                    say(WarmupEvent("step", name=name, done=i, total=len(steps)))
                    run()
        finally:
            say(WarmupEvent("done", done=len(steps), total=len(steps)))
        seconds = time.perf_counter() - t0 if meter.kernels else 0.0
        if compiles(ks):
            mark_warm(ks, kind, seconds)
        self.compile_report = CompileReport(seconds, meter.kernels, announced)
        return self.compile_report

    # ---------------------------------------------------------------- properties
    @property
    def tokenizer(self) -> Tokenizer:
        if self._tokenizer is None:
            raise CortiqError(f"{self.path}: no embedded tokenizer (tensor {TOKENIZER_TENSOR}); reconvert the model")
        return self._tokenizer

    @property
    def has_tokenizer(self) -> bool:
        return self._tokenizer is not None

    @property
    def vocab_size(self) -> int:
        return self.model.vocab_size

    @property
    def calibration_temperature(self) -> float | None:
        cal = self.header.get("calibration")
        t = cal.get("temperature") if isinstance(cal, dict) else None
        if t is None:
            return None
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 < t < 1e6:
            raise CortiqError(f"{self.path}: header calibration.temperature is {str(t)[:40]!r}, expected a number > 0")
        return float(t)

    @property
    def eos_ids(self) -> list[int]:
        tok = self.header.get("tokenizer")
        return header_eos_ids(tok) if isinstance(tok, dict) else []

    def new_state(self, capacity: int | None = None) -> State:
        return self.model.new_state(capacity or self.ctx)

    # ---------------------------------------------------------------- teacher forcing
    def _check_ids(self, ids: Sequence[int]) -> np.ndarray:
        arr = np.asarray(ids, dtype=np.int64).reshape(-1)
        if arr.size == 0:
            raise CortiqError("no tokens to score")
        if arr.size > self.ctx:
            raise CortiqError(f"{arr.size} tokens exceed the context of {self.ctx} (load with a larger ctx)")
        if arr.min() < 0 or arr.max() >= self.vocab_size:
            raise CortiqError(f"token id outside the vocabulary (0..{self.vocab_size - 1})")
        return arr

    def iter_logits(
        self, ids: Sequence[int], chunk: int = PREFILL_CHUNK, sub: int | None = None, first: int = 0
    ) -> Iterator[tuple[int, np.ndarray]]:
        """Teacher-forced logits of a fresh sequence, ``(start, block)`` at a time:
        block row j predicts ids[start + j + 1]. The model runs ``chunk`` tokens a
        forward; the output layer ``sub`` rows a call (default: as many as fit
        LOGIT_BLOCK_BYTES, 16..128), so memory stays bounded by the block. Rows before
        ``first`` get no logits (their tokens still enter the cache): a sliding window
        scores only its last rows. SmolLM2 q8, ``cortiq ppl --ctx 512``: chunks of 128 and
        output blocks of 32 rows ran 1.25x and 1.8x slower (each call re-reads, and the
        prefill kernels re-widen, every weight)."""
        arr = self._check_ids(ids)
        if sub is None:
            sub = max(16, min(128, LOGIT_BLOCK_BYTES // (4 * self.vocab_size)))
        if chunk < 1 or sub < 1:
            raise CortiqError("chunk and sub must be >= 1")
        state = self.model.new_state(int(arr.size))
        for s in range(0, arr.size, chunk):
            x = forward(state, arr[s : s + chunk])
            skip = min(x.shape[0], max(0, first - s))
            if skip == x.shape[0]:
                continue
            hn = self.model.final_norm(x[skip:])
            for j in range(0, hn.shape[0], sub):
                yield s + skip + j, self.model.lm_head(hn[j : j + sub])

    def logits(self, ids: Sequence[int]) -> np.ndarray:
        """f32 [len(ids), vocab]: row i is the next-token logits after ids[:i+1]."""
        arr = self._check_ids(ids)
        out = np.empty((arr.size, self.vocab_size), np.float32)
        for s, block in self.iter_logits(arr):
            out[s : s + block.shape[0]] = block
        return out

    # ---------------------------------------------------------------- generation
    def drafter(
        self,
        speculative: bool | SpeculativeConfig | DraftSource | None = None,
        config: SamplingConfig | None = None,
        *,
        evict: bool = False,
    ) -> tuple[DraftSource | None, str]:
        """The plain-vs-speculative policy: (the drafter a generation with these settings
        decodes with, None for plain decoding; a one-line note when drafts are possible
        but go unused). ``speculative``: None, when possible (draft layers loaded, greedy,
        no eviction); False, plain; True, required (else an error); a ``SpeculativeConfig``,
        when possible, drafted so; a drafter (``Drafter``, ``LookupDrafter``), that one (a
        conversation keeps its own)."""
        if speculative is False:
            return None, ""
        if isinstance(speculative, (Drafter, LookupDrafter)):
            return speculative, ""
        required = speculative is True
        spec = speculative if isinstance(speculative, SpeculativeConfig) else SpeculativeConfig()
        # Without draft layers, greedy decoding drafts by lookup alone unless told not to
        # (lookup 0, or speculative=True, which asks for the MTP layers): exact, and faster
        # in every model/text/machine case measured (1.07-1.48x, docs/performance.md).
        by_default = spec.lookup is None and not required
        lookup_only = self.drafts is None and (bool(spec.lookup) or by_default)
        if self.drafts is None:
            if spec.explicit or (required and not lookup_only):
                raise CortiqError(
                    f"{self.path}: no MTP draft layers (none loaded, inline or beside it); train them with "
                    f"`cortiq mtp-train {self.path}`, give --mtp PATH, or draft by lookup alone (--lookup 3)"
                )
            if not lookup_only:
                if spec.ngram is not None:
                    raise CortiqError(
                        "lookup n-gram sizes given, but no lookup drafts: drop --lookup 0 (no draft layers here)"
                    )
                return None, ""
        why = ""
        if not (config or SamplingConfig()).greedy:
            why = "it is exact for greedy decoding only (temperature 0)"
        elif evict:
            why = "it does not evict (--evict)"
        if why:
            if required:
                raise CortiqError(f"speculative decoding: {why}")
            if lookup_only and by_default:
                return None, ""  # nothing was asked for: plain decoding, no note
            return None, f"speculative decoding is off: {why}"
        lookup = DEFAULT_LOOKUP if spec.lookup is None else int(spec.lookup)
        ngram = spec.ngram or DEFAULT_NGRAM
        if lookup_only:
            dec = self._decision(lookup, ngram, None) if spec.decide else None
            return LookupDrafter(self.ctx, lookup, ngram, gate=spec.decide, decision=dec), ""
        # Unset depth and threshold: the sidecar's measured defaults (``mtp-train``,
        # ``mtp-probe --save``) when it has them and the draft vocabulary is the one they
        # were measured with; with lookup drafting first, those measured so (the MTP
        # layers then see only the rounds the lookup leaves them), if the record has them.
        stack = self.drafts
        measured = stack.default_depth is not None and spec.vocab is None
        best_depth, best_threshold = stack.default_depth, stack.default_threshold
        ld = stack.lookup_defaults
        if lookup > 0 and ld is not None and (ld.lookup, ld.ngram) == (lookup, tuple(ngram)):
            best_depth, best_threshold = ld.depth, ld.threshold
        depth = spec.depth if spec.depth is not None else (best_depth if measured else None)
        threshold = (
            spec.threshold if spec.threshold is not None else (best_threshold if measured else DEFAULT_THRESHOLD)
        )
        d = make_drafter(
            self.model,
            stack,
            self.ctx,
            depth=depth,
            chain=spec.chain,
            hidden=spec.hidden or "pre",
            head=self.draft_head(spec.vocab),
            threshold=threshold,
        )
        if spec.decide:
            d.decision = self._decision(lookup, ngram, d)
        if lookup == 0:
            return d, ""
        dec, d.decision = d.decision, None  # the lookup drafter's choice covers both sources
        return LookupDrafter(self.ctx, lookup, ngram, mtp=d, gate=spec.decide, decision=dec), ""

    def _decision(self, lookup: int, ngram: Sequence[int], mtp: Drafter | None) -> SpecDecision:
        """The measured choice of sources for a drafter of these settings, starting from
        what is known of their rates: remembered (``spec_memory``, under a key naming the
        model, the draft layers, the settings and the threads), else for the MTP layers
        modelled from their sidecar's held-out acceptance."""
        if self._model_digest is None:
            self._model_digest = header_digest(self.header, Path(self.path).stat().st_size)
        what = {
            "model": self._model_digest,
            "threads": self.threads,
            "lookup": [lookup, *ngram] if lookup else 0,
            "mtp": None if mtp is None else {"layers": mtp.stack.fingerprint, **mtp.describe(), "source": None},
        }
        key = header_digest(what, 0)
        priors = self.spec_memory.priors(key) if self.spec_memory is not None else {}
        held = mtp.stack.held_out if mtp is not None else None
        if mtp is not None and "mtp" not in priors and held:
            priors["mtp"] = Prior(modelled_ratio(held, mtp.depth), MODELLED_ROUNDS, "modelled")
        return SpecDecision(priors=priors, memory_key=key if self.spec_memory is not None else None)

    def draft_head(self, vocab: int | str | None = None) -> DraftHead:
        """The lm_head rows drafts score (see ``SpeculativeConfig.vocab``), built once per size."""
        ids = pick_vocab(self.drafts.vocab if self.drafts is not None else None, vocab)
        key = None if ids is None else int(ids.size)
        if key not in self._draft_heads:
            self._draft_heads[key] = full_head(self.model.head) if ids is None else sub_head(self.model.head, ids)
        return self._draft_heads[key]

    def generate(
        self,
        prompt_ids: Sequence[int],
        config: SamplingConfig | None = None,
        max_tokens: int = 256,
        stop: Sequence[str] = (),
        on_token: Callable[[TokenEvent], bool | None] | None = None,
        *,
        on_text: Callable[[str], None] | None = None,
        evict: bool = False,
        ignore_eos: bool = False,
        logprobs: int = 0,
        speculative: bool | SpeculativeConfig | DraftSource | None = None,
        state: State | None = None,
        history: Sequence[int] = (),
    ) -> GenerationResult:
        """``cortiq_engine.generate.generate`` on this model; plain or speculative as
        ``drafter(speculative, config, evict=evict)`` decides. A speculative result has
        ``extra["mtp"]``; a note on why draft layers went unused is ``extra["mtp_note"]``."""
        config = config or SamplingConfig()
        drafter, note = self.drafter(speculative, config, evict=evict)
        res = generate(
            self.model,
            self._tokenizer,
            prompt_ids,
            config,
            capacity=self.ctx,
            max_tokens=max_tokens,
            stop=stop,
            eos_ids=() if ignore_eos else self.eos_ids,
            evict=evict,
            calibration_temperature=self.calibration_temperature,
            on_token=on_token,
            on_text=on_text,
            state=state,
            logprobs=logprobs,
            history=history,
            drafter=drafter,
            threads=self.decode_threads,
        )
        if note:
            res.extra["mtp_note"] = note
        decision = getattr(drafter, "decision", None)
        if self.spec_memory is not None and decision is not None and decision.memory_key is not None:
            self.spec_memory.remember(decision.memory_key, decision)
        return res

    def close(self) -> None:
        self.cmf.close()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
