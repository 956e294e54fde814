"""The quantization decision in one pass (``cortiq quant-sweep``): convert a source to
each type, score each against the f32 reference on the same windows, time its decode.

The f32 reference is converted and scored once; its distributions go to a saved
reference (``.cref``, compact form, ``evals.reference``) so every later type is
scored with only its own model in memory. Every file lives in ``workdir`` and each
type's CMF is removed as soon as it is measured (unless ``keep_files``).

With ``remote`` each type's scoring against the saved reference runs elsewhere (``cortiq
quant-sweep --cluster``: ``evals.cluster.score_ppl``, the reference's rows going out with
each window), with the figures of the loop here; the reference pass, the conversions and
the decode timings stay in this process.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from evals.perplexity import Comparison, PerplexityAccumulator, PerplexityReport, build_reports
from evals.reference import (
    ReferenceIdentity,
    ReferenceRecorder,
    SavedReference,
    form_name,
    tokenizer_fingerprint,
)
from evals.scoring import iter_scored, scored_text_bytes
from evals.text_source import LoadedText
from evals.tokens import chunk_bos, tokenize_for
from evals.windows import Window
from cortiq_engine.convert import convert_checkpoint  # the engine passes its architecture families in
from formats.convert import KEEP, ConvertReport, QuantPolicy
from formats.errors import CortiqError

REFERENCE_TYPE = "f32"


@dataclass(frozen=True)
class SweepRow:
    quant: str
    params: int
    tensor_bytes: int  # bytes of every tensor (weights, norms, embeddings)
    file_bytes: int
    convert_seconds: float
    report: PerplexityReport
    comparison: Comparison
    decode_tok_s: float | None  # median over the repetitions
    decode_samples: list[float] = field(default_factory=list)

    @property
    def bits_per_weight(self) -> float:
        """8 x tensor bytes / parameters, as llama.cpp's "BPW" (all tensors, not only matrices)."""
        return 8.0 * self.tensor_bytes / self.params if self.params else float("nan")

    def to_json(self) -> dict[str, Any]:
        c = self.comparison
        return {
            "type": self.quant,
            "bits_per_weight": self.bits_per_weight,
            "params": self.params,
            "tensor_bytes": self.tensor_bytes,
            "file_bytes": self.file_bytes,
            "convert_seconds": self.convert_seconds,
            "ppl": self.report.ppl,
            "ppl_ratio": c.ppl_ratio,
            "ppl_ratio_ci95": list(c.ppl_ratio_ci95),
            "kl_mean": c.kl.mean,
            "kl_se": c.kl.se,
            "kl_p99": c.kl_quantiles["p99"],
            "kl_max": c.kl_quantiles["max"],
            "top1_agreement": c.top1.mean,
            "top1_agreement_se": c.top1.se,
            "delta_p_rms": c.dp_rms.rms,
            "decode_tok_s": self.decode_tok_s,
            "decode_tok_s_samples": self.decode_samples,
            "comparison": c.to_json(),
        }


@dataclass(frozen=True)
class SweepResult:
    source: str
    reference: PerplexityReport
    reference_form: str
    reference_bytes: int
    tokens_scored: int
    windows: int
    rows: list[SweepRow]

    def to_json(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "reference": dict(self.reference.to_json(), type=REFERENCE_TYPE),
            "reference_form": self.reference_form,
            "saved_reference_bytes": self.reference_bytes,
            "tokens_scored": self.tokens_scored,
            "windows": self.windows,
            "types": [r.to_json() for r in self.rows],
        }


def parse_types(spec: str) -> list[str]:
    """``q8,q4`` -> ["q8", "q4"]; the converter decides which names exist."""
    types = [t.strip() for t in spec.split(",") if t.strip()]
    if not types:
        raise CortiqError("--types is empty; give a comma-separated list such as q8,q4")
    if len(set(types)) != len(types):
        raise CortiqError(f"--types names a type twice: {spec}")
    for t in types:  # before the first (long) conversion
        if t != KEEP:
            QuantPolicy(t, [])
    return types


Loader = Callable[[Path], Any]  # CMF path -> an Engine (iter_logits, tokenizer, vocab_size, close)
Planner = Callable[[int, int | None], list[Window]]  # (text tokens, chunk BOS) -> windows
Event = Callable[[str, dict[str, Any]], None]  # ("convert" | "score" | "decode" | "done", details)
ScoreProgress = Callable[[str, int, int], None]  # (type, tokens scored, tokens to score)
# (type, its CMF, tokens, windows, its loaded engine, the saved reference) -> a PerplexityResult
# over [REFERENCE_TYPE, type], every window scored, as the loop in ``run_sweep`` scores them.
RemoteScore = Callable[[str, Path, np.ndarray, list[Window], Any, SavedReference], Any]


def _tensor_totals(rep: ConvertReport) -> tuple[int, int]:
    return sum(s.params for s in rep.by_dtype.values()), sum(s.bytes for s in rep.by_dtype.values())


def run_sweep(
    src: str,
    types: Sequence[str],
    text: LoadedText,
    workdir: Path,
    load: Loader,
    plan: Planner,
    *,
    top_k: int = 64,
    samples: int = 64,
    decode_tokens: int = 64,
    decode_reps: int = 3,
    chunk: int = 128,
    keep_files: bool = False,
    settings: dict[str, Any] | None = None,
    event: Event | None = None,
    progress: ScoreProgress | None = None,
    remote: RemoteScore | None = None,
) -> SweepResult:
    from evals.speed import decode as decode_speed

    say = event or (lambda _kind, _info: None)
    workdir.mkdir(parents=True, exist_ok=True)
    ref_cmf = workdir / f"{REFERENCE_TYPE}.cmf"
    ref_file = workdir / "reference.cref"

    say("convert", {"type": REFERENCE_TYPE})
    t0 = time.perf_counter()
    ref_rep = convert_checkpoint(src, ref_cmf, quant=REFERENCE_TYPE, force=True)
    ref_seconds = time.perf_counter() - t0

    eng = load(ref_cmf)
    try:
        tokens = tokenize_for([eng], [REFERENCE_TYPE], text)
        windows = plan(len(tokens), chunk_bos(eng.tokenizer))
        if not windows:
            raise CortiqError("nothing to score: the window plan is empty")
        total = sum(w.n_scored for w in windows)
        ident = ReferenceIdentity(
            tokenizer_fingerprint(eng.tokenizer, eng.vocab_size), text.sha256, int(eng.vocab_size)
        )
        meta = {
            "model": {"path": str(src), "label": f"{Path(src).name} (f32)"},
            "tokenizer": {"fingerprint": ident.tokenizer, "vocab_size": ident.vocab_size},
            "text": {"sha256": ident.text_sha256, "source": "quant-sweep"},
            "settings": dict(settings or {}),
            "tool": "cortiq quant-sweep",
        }
        rec = ReferenceRecorder(
            ref_file,
            tokens=tokens,
            windows=windows,
            vocab_size=int(eng.vocab_size),
            top_k=top_k,
            samples=samples,
            meta=meta,
        )
        say("score", {"type": REFERENCE_TYPE, "tokens": total})
        acc = PerplexityAccumulator(1)
        try:
            for block in iter_scored([eng], tokens, windows, chunk=chunk):
                rec.add(block.logits[0], block.targets)
                acc.add(block)
                if progress:
                    progress(REFERENCE_TYPE, acc.count, total)
            rec.commit()
        except BaseException:
            rec.abort()
            raise
        n_bytes = scored_text_bytes(eng.tokenizer, tokens, windows)
        (ref_report,), _ = build_reports(acc, [REFERENCE_TYPE], n_bytes)
        ref_speed = None
        if REFERENCE_TYPE in types:
            say("decode", {"type": REFERENCE_TYPE})
            ref_speed = decode_speed(eng, decode_tokens, decode_reps)
    finally:
        eng.close()

    rows: list[SweepRow] = []
    for quant in types:
        if quant == REFERENCE_TYPE:
            params, nbytes = _tensor_totals(ref_rep)
            zero = _self_comparison(ref_report, acc)
            rows.append(
                SweepRow(
                    quant,
                    params,
                    nbytes,
                    ref_rep.output_bytes,
                    ref_seconds,
                    ref_report,
                    zero,
                    ref_speed.median if ref_speed else None,
                    ref_speed.tok_s if ref_speed else [],
                )
            )
            say("done", {"type": quant})
            continue
        out = workdir / f"{quant}.cmf"
        say("convert", {"type": quant})
        t0 = time.perf_counter()
        rep = convert_checkpoint(src, out, quant=quant, force=True)
        seconds = time.perf_counter() - t0
        eng = load(out)
        saved = SavedReference(ref_file)
        try:
            mine = tokenize_for([eng], [quant], text)
            saved.check(ident, mine, windows)
            say("score", {"type": quant, "tokens": total})
            if remote is not None:
                scored = remote(quant, out, np.asarray(tokens), windows, eng, saved)
                (ref_again, report), (comp,) = scored.reports, scored.comparisons
            else:
                qacc = PerplexityAccumulator(1, saved_ref=True)
                for block in iter_scored([eng], tokens, windows, chunk=chunk):
                    qacc.add(block, saved.next_rows(len(block.targets)))
                    if progress:
                        progress(quant, qacc.count, total)
                (ref_again, report), (comp,) = build_reports(qacc, [REFERENCE_TYPE, quant], n_bytes, saved.form)
            say("decode", {"type": quant})
            speed = decode_speed(eng, decode_tokens, decode_reps)
        finally:
            saved.close()
            eng.close()
        params, nbytes = _tensor_totals(rep)
        rows.append(SweepRow(quant, params, nbytes, rep.output_bytes, seconds, report, comp, speed.median, speed.tok_s))
        if not keep_files:
            out.unlink(missing_ok=True)
        say("done", {"type": quant})
    ref_bytes = ref_file.stat().st_size
    if not keep_files:
        ref_cmf.unlink(missing_ok=True)
        ref_file.unlink(missing_ok=True)
    return SweepResult(str(src), ref_report, form_name(rec.top_k, rec.samples), ref_bytes, total, len(windows), rows)


def _self_comparison(report: PerplexityReport, acc: PerplexityAccumulator) -> Comparison:
    """The reference against itself: every divergence 0, top-1 agreement 1."""
    from evals.kl import RowStats

    nll = acc.nll_of(0)
    z = np.zeros_like(nll)
    return Comparison.of(report.model, report.model, nll, RowStats(nll, z, z, z, np.ones(len(nll), bool)))


def finite(x: float | None) -> bool:
    return x is not None and math.isfinite(x)


__all__ = ["SweepRow", "SweepResult", "run_sweep", "parse_types", "REFERENCE_TYPE", "RemoteScore"]
