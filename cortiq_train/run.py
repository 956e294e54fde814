"""One ``mtp-train`` run end to end: text -> features -> training -> sidecar -> held-out acceptance."""

from __future__ import annotations

import hashlib
import os
import shutil
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from formats.errors import CortiqError
from formats.untrusted_json import section
from formats.sidecar import sidecar_path
from cortiq_engine.acceptance import Acceptance
from cortiq_train.config import TrainConfig


EVAL_WINDOWS = 32
BACKENDS = ("engine", "torch")  # who runs the frozen backbone to collect its rows


TORCH_CHECK_TOKENS = 64
TORCH_CHECK_TOLERANCE = 1e-3  # relative; SmolLM2 q8 measures 8.8e-7, Gemma 3 (unsupported) 48


def check_torch_backbone(runner, backbone, ids: np.ndarray) -> None:
    """--backbone torch re-implements the backbone's blocks in torch (llama-style blocks
    only): its hidden rows must be the engine's, or the drafts learn another model. One
    short window through both, before any collection."""
    from cortiq_train.features import EngineRunner

    e = EngineRunner(backbone).hidden(ids)
    t = runner.hidden(ids)
    rel = float(np.linalg.norm(e - t) / max(float(np.linalg.norm(e)), 1e-30))
    if not rel <= TORCH_CHECK_TOLERANCE:
        raise CortiqError(
            f"--backbone torch does not reproduce the engine on this {backbone.arch.arch} model "
            f"(relative difference {rel:.3g} over {len(ids)} tokens): use --backbone engine"
        )


FEATURES_NAME = "features"


def work_dir(out: Path, environ: Mapping[str, str] = os.environ) -> Path:
    """Where a run keeps its checkpoint and collected rows until it succeeds:
    ``$XDG_CACHE_HOME/cortiq/mtp-train/<OUT's name>-<digest of OUT's absolute path>``
    (``~/.cache`` by default), so a ``--resume`` for the same OUT finds them and
    nothing but the sidecar lands beside the model."""
    out = Path(out).resolve()
    base = environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    digest = hashlib.sha256(str(out).encode()).hexdigest()[:16]
    return Path(base) / "cortiq" / "mtp-train" / f"{out.name}-{digest}"


@dataclass
class Callbacks:
    phase: Callable[[str], None] | None = None
    collect: Callable[[int, int], None] | None = None
    generate: Callable[[int, int], None] | None = None  # windows continued by the backbone
    step: Callable[[int, int, float, list[float]], None] | None = None


@dataclass
class RunResult:
    sidecar: Path
    checkpoint: Path | None
    config: TrainConfig
    source: str
    tokens: int
    train_windows: int
    held_windows: int
    active_vocab: int
    start_step: int
    steps: int
    losses: list[float]
    train_seconds: float
    collect_seconds: float
    backbone: str = "engine"  # who ran the backbone: engine or torch
    threads: int = 1  # the engine's pools and torch's
    held_torch: Acceptance | None = None
    held_engine: Acceptance | None = None
    # The held-out windows the report drafted (tokens, the backbone's greedy token after
    # each position; [W, T]), for measuring the sidecar's defaults on them.
    held_tokens: np.ndarray | None = None
    held_greedy: np.ndarray | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "sidecar": str(self.sidecar),
            "checkpoint": str(self.checkpoint) if self.checkpoint else None,
            "backbone": self.backbone,
            "threads": self.threads,
            "config": self.config.to_json(),
            "text": self.source,
            "tokens": self.tokens,
            "train_windows": self.train_windows,
            "held_windows": self.held_windows,
            "active_vocab": self.active_vocab,
            "start_step": self.start_step,
            "steps": self.steps,
            "first_loss": self.losses[self.start_step] if len(self.losses) > self.start_step else None,
            "last_loss": self.losses[-1] if self.losses else None,
            "losses": self.losses,
            "train_seconds": self.train_seconds,
            "collect_seconds": self.collect_seconds,
            "held_out": self.held_engine.to_json() if self.held_engine else None,
            "held_out_torch": self.held_torch.to_json() if self.held_torch else None,
            **self.extra,
        }


def train_mtp(
    model_path: str | Path,
    text: str,
    source: str,
    cfg: TrainConfig,
    *,
    out: str | Path | None = None,
    quant: str | None = None,
    resume: bool = False,
    keep_checkpoint: bool = False,
    force: bool = False,
    threads: int | None = None,
    kernels: str | None = None,
    backend: str = "engine",
    callbacks: Callbacks | None = None,
    features: str | Path | None = None,
    work: str | Path | None = None,
    draft_vocab: int | None = None,
) -> RunResult:
    """Train, write the sidecar ``out`` (default ``MODEL.mtp.cmf``) and nothing else beside it.

    ``work``: the folder of the run's checkpoint and collected rows (default
    ``work_dir(out)``); a run that stops leaves them there for ``resume``, a run that
    succeeds removes them unless ``keep_checkpoint``. ``features``: a folder of the
    collected backbone rows of the caller's own (memory-mapped, resumable, reused by any
    run of the same backbone, text and collection settings; never removed).
    ``threads``: the engine's pools and torch's (None: every usable core)."""
    from cortiq_train.backbone import open_backbone
    from cortiq_train.export import write_sidecar
    from cortiq_train.features import EngineRunner, collect
    from cortiq_train.trainer import CHECKPOINT_NAME, Trainer, missing_checkpoint, require_torch

    cb = callbacks or Callbacks()
    require_torch()  # before any slow work
    if backend not in BACKENDS:
        raise CortiqError(f"--backbone {backend!r}: choose {' or '.join(BACKENDS)}")
    model_path = Path(model_path)
    out = Path(out) if out else sidecar_path(model_path)
    if out.resolve() == model_path.resolve():
        raise CortiqError("--out would overwrite the backbone; give another file name")
    if out.exists() and not (force or resume):
        raise CortiqError(f"{out} exists (use --force to overwrite)")
    if not out.parent.is_dir():
        raise CortiqError(f"output folder {out.parent} does not exist")
    work = Path(work) if work else work_dir(out)
    ckpt = work / CHECKPOINT_NAME
    if resume and not ckpt.is_file():
        raise missing_checkpoint(ckpt, out)
    backbone = open_backbone(model_path, kernels, threads)
    cfg.check(backbone.arch.num_layers)
    # The draft block starts from a backbone layer: refused now, not after the collection.
    from cortiq_train.draft_torch import require_llama_blocks  # torch is there (require_torch)

    require_llama_blocks(backbone, [cfg.init_layer % backbone.arch.num_layers], "choose another --init-layer")
    if resume:
        check_resume(ckpt, backbone, cfg)  # before any backbone row is collected
    else:
        ckpt.unlink(missing_ok=True)  # an earlier run's, for this OUT: never resumed by accident
    q = section(backbone.header, "quant").get("default")
    quant = quant or (q if isinstance(q, str) else None) or "f32"

    ids = backbone.tokenizer.encode(text, add_bos=True)
    if cfg.max_tokens is not None and not cfg.chat:
        ids = ids[: cfg.max_tokens]
    if len(ids) < 2:
        raise CortiqError(f"{source}: too little text ({len(ids)} token)")
    fingerprint = backbone.fingerprint or str(model_path.resolve())
    feature_dir = Path(features) if features else work / FEATURES_NAME
    if cfg.chat or cfg.self_distill:
        from cortiq_train.features import chat_prompts, continuations, continue_windows

        if cb.phase:
            cb.phase("continue")
        # The backbone's own text is decoded token by token (the slow part): resumable
        # from its own folder beside the collected rows.
        common = dict(
            seq=cfg.seq,
            temperature=cfg.self_temperature,
            seed=cfg.seed,
            progress=cb.generate,
            cache=feature_dir / "continuations",
            backbone=fingerprint,
        )
        if cfg.chat:
            limit = cfg.max_tokens // cfg.seq if cfg.max_tokens else None
            if cfg.self_distill:
                limit = max(1, limit // 2) if limit else None
            prompts = chat_prompts(backbone.tokenizer, text, seq=cfg.seq, limit=limit)
            if cfg.self_distill:
                # Both kinds: chat turns alternate with plain windows of the text, as many of each.
                n = min(len(prompts), len(ids) // cfg.seq)
                plain = [np.asarray(ids[w * cfg.seq : w * cfg.seq + cfg.self_distill]) for w in range(n)]
                prompts = [p for pair in zip(prompts[:n], plain) for p in pair]
            ids = continue_windows(backbone.model, prompts, **common)
        else:
            ids = continuations(backbone.model, ids, prompt=cfg.self_distill, **common)
    if cb.phase:
        cb.phase("collect")
    t0 = time.perf_counter()
    if backend == "torch":
        from cortiq_train.draft_torch import TorchBackbone

        runner = TorchBackbone(backbone, cfg.seq)
        check_torch_backbone(runner, backbone, np.asarray(ids[: min(len(ids), cfg.seq, TORCH_CHECK_TOKENS)]))
    else:
        runner = EngineRunner(backbone)
    feats = collect(
        runner,
        ids,
        seq=cfg.seq,
        topk=cfg.topk,
        hidden=cfg.hidden,
        holdout=cfg.holdout,
        min_len=cfg.depths + 2,
        progress=cb.collect,
        cache=feature_dir,
        dtype=cfg.feature_dtype,
        backbone=fingerprint,
    )
    collect_s = time.perf_counter() - t0
    del runner  # the f32 backbone copy is not needed for training

    # The report's held-out windows: the first EVAL_WINDOWS (a large text's tenth would
    # take longer to draft through the engine than the training).
    held = feats.held[:EVAL_WINDOWS]
    trainer = Trainer(backbone, feats, cfg, threads=threads)
    if resume:
        trainer.load(ckpt)
    if cb.phase:
        cb.phase("train")
    if cfg.checkpoint_every:
        work.mkdir(parents=True, exist_ok=True)
    res = trainer.run(ckpt if cfg.checkpoint_every else None, cb.step)

    result = RunResult(
        sidecar=out,
        checkpoint=None,
        config=cfg,
        source=source,
        tokens=len(ids),
        train_windows=len(feats.train),
        held_windows=len(held),
        active_vocab=len(trainer.active),
        start_step=res.start_step,
        steps=res.steps_done,
        losses=res.losses,
        train_seconds=res.seconds,
        collect_seconds=collect_s,
        backbone=backend,
        threads=backbone.threads,
    )
    if cb.phase:
        cb.phase("evaluate")
    if len(held):
        result.held_torch = trainer.evaluate(held)
    trained = {
        "text": source,
        "tokens": len(ids),
        "train_windows": len(feats.train),
        "held_windows": len(held),
        "steps": res.steps_done,
        "loss": res.last_loss,
        "config": cfg.to_json(),
        "held_out": result.held_torch.to_json() if result.held_torch else None,
    }
    vocab = None
    if draft_vocab:  # the draft vocabulary from the training text (cortiq_engine/draft_vocab.py)
        from cortiq_engine.draft_vocab import vocab_from_text
        from formats.sidecar import draft_vocab_record

        if cfg.chat or cfg.self_distill:
            # The windows trained on (the backbone's own text): what the drafts predict.
            from cortiq_engine.draft_vocab import choose_draft_vocab

            tok = backbone.tokenizer
            v_ids = choose_draft_vocab(ids, draft_vocab, backbone.arch.vocab_size, [*tok.eos_ids, *tok.special_ids()])
            n_tok = len(ids)
        else:
            v_ids, n_tok = vocab_from_text(
                backbone.tokenizer,
                backbone.arch.vocab_size,
                backbone.tokenizer.eos_ids,
                text,
                draft_vocab,
                cfg.max_tokens,
            )
        vocab = (v_ids, draft_vocab_record(v_ids, source, n_tok))
    write_sidecar(
        out,
        backbone.header,
        model_path.name,
        res.stack.tensors(),
        quant=quant,
        hidden=cfg.hidden,
        trained=trained,
        force=force or resume,
        draft_vocab=vocab,
    )
    if len(held):
        from cortiq_train.engine_drafts import engine_drafts, load_draft_layers

        layers = load_draft_layers(out, backbone)
        drafts = engine_drafts(
            backbone, layers, np.asarray(feats.tokens[held], np.int64), np.asarray(feats.hidden[held], np.float32)
        )
        result.held_tokens = np.asarray(feats.tokens[held], np.int64)
        result.held_greedy = np.asarray(feats.greedy[held], np.int64)
        result.held_engine = Acceptance.from_arrays(drafts, result.held_greedy)
    if keep_checkpoint:
        result.checkpoint = ckpt if ckpt.is_file() else None
    else:
        remove_work(work, feature_dir if not features else None)
    return result


def check_resume(ckpt: Path, backbone, cfg: TrainConfig) -> None:
    """The checkpoint fits this run (``trainer.read_checkpoint``), checked on a fresh
    stack of the run's shapes before the slow collection starts."""
    from cortiq_train.draft_torch import build_stack
    from cortiq_train.trainer import CheckpointLayout, read_checkpoint

    stack = build_stack(backbone, cfg.layers, cfg.intermediate, cfg.init_layer, 1.0, cfg.seq + cfg.depths, cfg.seed)
    read_checkpoint(ckpt, CheckpointLayout.of(stack), cfg, backbone.fingerprint)


def remove_work(work: Path, feature_dir: Path | None) -> None:
    """A finished run's checkpoint and collected rows (``feature_dir``: None when they
    are the caller's own folder), then the work folder when nothing else is in it."""
    from cortiq_train.trainer import CHECKPOINT_NAME

    (work / CHECKPOINT_NAME).unlink(missing_ok=True)
    if feature_dir is not None:
        shutil.rmtree(feature_dir, ignore_errors=True)
    try:
        work.rmdir()
    except OSError:
        pass
