"""The training loop: distill the backbone's next-token distribution into K draft
layers, with checkpoints a later run resumes from.

Loss of depth k at row j: cross-entropy from the teacher's top-k distribution at
position j+k+1 (renormalized) to the draft's softmax, i.e. KL(teacher || draft)
up to the teacher's entropy. With ``vocab="active"`` the draft softmax runs over
the tokens the teacher ever ranks in its top-k on the training windows plus the
text's own tokens, plus ``negatives`` random others per step (a draft vocabulary,
as EAGLE-3 uses): the shared lm_head is the costliest product by far on a CPU.

Depth k's inputs follow ``cfg.chain`` and ``cfg.use_ttt`` (``draft_torch.depth_outputs``):
with the training-time test the later depths read the round's own drafts (argmax over
the step's candidate rows) wherever the engine's Drafter would, else the true tokens.
The features may be memory-mapped files (``features.FeatureCache``): each step reads
only its windows' rows.

Every random choice is a function of (seed, step), and the checkpoint holds the
weights, the optimizer and the step, so a resumed run equals an uninterrupted one.
The checkpoint (``train.safetensors`` in the run's work folder, ``run.work_dir``) is
a safetensors file: tensors ``model.*`` (the draft stack) and ``optim.<param>.<key>``
(AdamW moments and step counters), everything else (version, step, settings, backbone
fingerprint, losses, optimizer hyper-parameters) as JSON in its metadata.
``read_checkpoint`` checks all of it against the run it would continue (names, shapes,
dtypes, step counts) before any weight is read. It is never a pickle: a file someone
placed beside a model cannot run code (an old ``.train.pt`` pickle beside the sidecar
is named in the error, never opened).
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from formats.errors import CortiqError
from formats.untrusted_json import load_object
from cortiq_engine.acceptance import Acceptance
from cortiq_train.config import TrainConfig
from cortiq_train.features import Features

CHECKPOINT_VERSION = 2  # 2: safetensors + JSON metadata (1 was a torch pickle, no longer read)
CHECKPOINT_KEY = "cortiq_mtp_train"
StepFn = Callable[[int, int, float, list[float]], None]  # (step, total, loss, per-depth top-1 agreement)


def require_torch():
    try:
        import torch
    except ImportError:
        raise CortiqError("mtp-train needs torch: pip install 'cortiq[train]'") from None
    return torch


def _json_scalar(v: Any) -> Any:
    """Optimizer settings JSON cannot hold as they are (tuples are fine; tensors, numpy scalars not)."""
    if hasattr(v, "item"):
        return v.item()
    raise TypeError(f"{type(v).__name__} in the optimizer settings")


CHECKPOINT_NAME = "train.safetensors"
OPTIM_KEYS = ("step", "exp_avg", "exp_avg_sq")  # AdamW's state of one parameter


def missing_checkpoint(path: Path, out: Path) -> CortiqError:
    stem = out.name[: -len(".cmf")] if out.name.endswith(".cmf") else out.name
    legacy = out.with_name(f"{stem}.train.pt")
    hint = f" ({legacy.name} is an old pickle checkpoint, which cortiq never opens)" if legacy.is_file() else ""
    return CortiqError(
        f"--resume: no checkpoint at {path}{hint}; a run keeps it when stopped, or with --keep-checkpoint"
    )


@dataclass(frozen=True)
class CheckpointLayout:
    """What a checkpoint of one draft stack holds: its state tensors' shapes by name and
    the shapes of its trainable parameters in the optimizer's order."""

    model: dict[str, tuple[int, ...]]
    params: list[tuple[int, ...]]

    @classmethod
    def of(cls, stack) -> "CheckpointLayout":
        return cls(
            {k: tuple(v.shape) for k, v in stack.state_dict().items()},
            [tuple(p.shape) for p in stack.parameters() if p.requires_grad],
        )

    def tensors(self, step: int) -> dict[str, tuple[int, ...]]:
        """Every tensor name with its shape; the optimizer holds state once a step ran."""
        out = {f"model.{k}": shape for k, shape in self.model.items()}
        if step > 0:
            for i, shape in enumerate(self.params):
                out.update({f"optim.{i}.step": (), f"optim.{i}.exp_avg": shape, f"optim.{i}.exp_avg_sq": shape})
        return out


@dataclass(frozen=True)
class CheckpointMeta:
    step: int
    losses: list[float]
    param_groups: list[dict[str, Any]]


def read_checkpoint(path: Path, layout: CheckpointLayout, cfg: TrainConfig, fingerprint: str | None) -> CheckpointMeta:
    """Check the checkpoint at ``path`` against the run it would continue, reading no
    weight: its metadata (version, backbone, settings), its step against the losses, the
    optimizer's counters and ``--steps``, and every tensor's name, shape and dtype
    against ``layout``. One-line ``CortiqError``s."""
    from formats.safetensors_reader import SafetensorsFile

    st = SafetensorsFile(path)
    try:
        raw_meta = st.metadata.get(CHECKPOINT_KEY)
        if not isinstance(raw_meta, str):
            raise CortiqError(f"{path}: not an mtp-train checkpoint (no {CHECKPOINT_KEY} metadata)")
        meta = load_object(raw_meta, f"{path} (checkpoint metadata)")
        if meta.get("version") != CHECKPOINT_VERSION:
            raise CortiqError(f"{path}: not an mtp-train checkpoint of version {CHECKPOINT_VERSION}")
        if meta.get("fingerprint") != fingerprint:
            raise CortiqError(
                f"{path}: the checkpoint was trained on another backbone (fingerprint {str(meta.get('fingerprint'))[:40]})"
            )
        saved_cfg = meta.get("config")
        diffs = cfg.resume_mismatch(saved_cfg if isinstance(saved_cfg, dict) else {})
        if diffs:
            raise CortiqError(f"{path}: settings differ from the checkpoint: " + "; ".join(diffs))
        step, losses, groups = meta.get("step"), meta.get("losses"), meta.get("param_groups")
        if not (isinstance(step, int) and not isinstance(step, bool) and step >= 0):
            raise CortiqError(f"{path}: bad step {str(step)[:20]} in the checkpoint")
        if step > cfg.steps:
            raise CortiqError(
                f"{path}: the checkpoint is at step {step}, past --steps {cfg.steps} (the total, a resumed run included)"
            )
        if not (
            isinstance(losses, list) and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in losses)
        ):
            raise CortiqError(f"{path}: bad losses in the checkpoint")
        if len(losses) != step:
            raise CortiqError(f"{path}: the checkpoint is at step {step} but holds {len(losses)} losses")
        if not (
            isinstance(groups, list)
            and len(groups) == 1
            and isinstance(groups[0], dict)
            and groups[0].get("params") == list(range(len(layout.params)))
        ):
            raise CortiqError(
                f"{path}: the checkpoint's optimizer settings do not fit the {len(layout.params)} draft parameters"
            )
        want = layout.tensors(step)
        missing = sorted(set(want) - set(st.entries))
        extra = sorted(set(st.entries) - set(want))
        if missing or extra:
            first = f"{missing[0]} is missing" if missing else f"{extra[0][:80]} is not a tensor of these draft layers"
            more = len(missing) + len(extra) - 1
            raise CortiqError(
                f"{path}: the checkpoint's tensors do not match the draft layers ({first}"
                + (f", and {more} more" if more else "")
                + ")"
            )
        for name, shape in want.items():
            e = st.entries[name]
            if e.shape != shape:
                raise CortiqError(f"{path}: tensor {name} is {list(e.shape)} in the checkpoint, {list(shape)} here")
            if e.dtype != "F32":
                raise CortiqError(f"{path}: tensor {name} is {e.dtype} in the checkpoint, F32 here")
        for i in range(len(layout.params) if step else 0):
            n = float(st.raw(f"optim.{i}.step"))
            if n != step:
                raise CortiqError(
                    f"{path}: the optimizer's counter optim.{i}.step is {n:g}, the checkpoint's step {step}"
                )
        return CheckpointMeta(step, [float(x) for x in losses], groups)
    finally:
        st.close()


@dataclass
class TrainResult:
    stack: Any  # draft_torch.DraftStack
    steps_done: int
    start_step: int
    losses: list[float] = field(default_factory=list)  # every step, resumed runs included
    seconds: float = 0.0
    hnorm_scale: float = 1.0

    @property
    def first_loss(self) -> float | None:
        return self.losses[0] if self.losses else None

    @property
    def last_loss(self) -> float | None:
        return self.losses[-1] if self.losses else None


def lr_at(cfg: TrainConfig, step: int) -> float:
    """Linear warm-up, then cosine down to a tenth of ``lr`` at ``steps``."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    span = max(cfg.steps - cfg.warmup, 1)
    frac = min((step - cfg.warmup) / span, 1.0)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))


class Trainer:
    def __init__(self, backbone, feats: Features, cfg: TrainConfig, threads: int | None = None):
        self.torch = torch = require_torch()
        from cortiq_train.draft_torch import build_stack

        # torch's pool takes the count the engine's pools were set to (threads.set_threads,
        # through open_trunk); left open on tiny matrices, one thread: hand-offs cost more
        # than they save.
        tiny = threads is None and backbone.arch.hidden_size < 256
        torch.set_num_threads(1 if tiny else backbone.threads)
        self.backbone, self.f, self.cfg = backbone, feats, cfg
        # Statistics from a sample of windows: the features may be a memory-mapped file
        # far larger than RAM, read a batch at a time.
        sample = feats.train[:64]
        tr = np.asarray(feats.hidden[np.sort(sample)], np.float64)
        self.hnorm_scale = float(np.sqrt((tr**2).mean(-1)).mean())
        del tr
        torch.manual_seed(cfg.seed)
        self.stack = build_stack(
            backbone, cfg.layers, cfg.intermediate, cfg.init_layer, self.hnorm_scale, feats.seq + cfg.depths, cfg.seed
        )
        self.head = torch.tensor(backbone.head_f32())  # frozen, shared
        self.vocab = self.head.shape[0]
        if cfg.vocab == "active":
            self.active = _active_vocab(feats)
        else:
            self.active = np.arange(self.vocab, dtype=np.int64)
        self.params = [p for p in self.stack.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(self.params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0)
        self.step = 0
        self.losses: list[float] = []

    # ------------------------------------------------------------ checkpoints
    def save(self, path: Path) -> None:
        """Tensors in safetensors, everything else as JSON in its metadata: no pickle,
        so a checkpoint someone left beside a model can never run code."""
        tensors = {f"model.{k}": v for k, v in self.stack.state_dict().items()}
        opt = self.opt.state_dict()
        for idx, st in opt["state"].items():
            for key, v in st.items():
                tensors[f"optim.{idx}.{key}"] = v if self.torch.is_tensor(v) else self.torch.tensor(v)
        meta = {
            "version": CHECKPOINT_VERSION,
            "step": self.step,
            "config": self.cfg.to_json(),
            "fingerprint": self.backbone.fingerprint,
            "losses": self.losses,
            "param_groups": opt["param_groups"],
        }
        tensors = {k: v.detach().contiguous().cpu() for k, v in tensors.items()}
        tmp = path.with_name(f".{path.name}.tmp")
        try:
            from safetensors.torch import save_file

            save_file(tensors, str(tmp), metadata={CHECKPOINT_KEY: json.dumps(meta, default=_json_scalar)})
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise

    def load(self, path: Path) -> None:
        """Resume from ``path``, checked first (``read_checkpoint``: metadata, names,
        shapes, dtypes, step counts) against this stack."""
        from formats.safetensors_reader import SafetensorsFile

        meta = read_checkpoint(path, CheckpointLayout.of(self.stack), self.cfg, self.backbone.fingerprint)
        st = SafetensorsFile(path)
        try:
            model = {k: self._tensor(st, f"model.{k}") for k in self.stack.state_dict()}
            state: dict[int, dict[str, Any]] = {}
            for n in st.entries:
                if n.startswith("optim."):
                    _, idx, key = n.split(".", 2)
                    state.setdefault(int(idx), {})[key] = self._tensor(st, n)
            self.stack.load_state_dict(model)
            try:
                self.opt.load_state_dict({"state": state, "param_groups": meta.param_groups})
            except (ValueError, KeyError, TypeError, RuntimeError) as e:
                raise CortiqError(f"{path}: optimizer state does not fit ({str(e)[:120]})") from None
            self.step = meta.step
            self.losses = list(meta.losses)
        finally:
            st.close()

    def _tensor(self, st, name: str):
        try:
            return self.torch.from_numpy(np.array(st.raw(name)))
        except KeyError:
            raise CortiqError(f"{st.path}: tensor {name} is missing") from None

    # ------------------------------------------------------------ one step
    def _vocab_for(self, rng: np.random.Generator) -> np.ndarray:
        if self.cfg.vocab != "active" or self.cfg.negatives <= 0 or len(self.active) >= self.vocab:
            return self.active
        rest = np.setdiff1d(np.arange(self.vocab, dtype=np.int64), self.active, assume_unique=True)
        neg = rng.choice(rest, size=min(self.cfg.negatives, len(rest)), replace=False)
        return np.concatenate([self.active, np.sort(neg)])

    def embed(self, ids: np.ndarray):
        """Embedding rows [.., H] of token ids [..] (looked up per step: the table of
        every window's rows would be as large as the hidden rows)."""
        return self.torch.from_numpy(self.backbone.embed_f32(ids.reshape(-1)).reshape(*ids.shape, -1))

    def hidden_rows(self, wins: np.ndarray):
        return self.torch.from_numpy(np.asarray(self.f.hidden[wins], np.float32))

    def train_step(self) -> tuple[float, list[float]]:
        from cortiq_train.draft_torch import depth_outputs

        torch, cfg, f = self.torch, self.cfg, self.f
        rng = np.random.default_rng([cfg.seed, self.step])
        wins = rng.choice(f.train, size=cfg.batch, replace=len(f.train) < cfg.batch)
        cand = self._vocab_for(rng)
        lut = np.full(self.vocab, -1, np.int64)
        lut[cand] = np.arange(len(cand))
        w_c = self.head[torch.from_numpy(cand)]
        t = f.seq
        tokens = np.asarray(f.tokens[wins], np.int64)
        top_idx = np.asarray(f.top_idx[wins])
        top_logp = np.asarray(f.top_logp[wins], np.float32)
        for g in self.opt.param_groups:
            g["lr"] = lr_at(cfg, self.step)
        self.opt.zero_grad(set_to_none=True)
        logits: list = []

        def pick(d, rows):
            # The draft later depths read: the argmax over the step's candidate rows (the
            # teacher's vocabulary + negatives); with --vocab full, the engine's argmax.
            lg = rows @ w_c.T
            logits.append(lg)
            return cand[lg.detach().argmax(-1).numpy()]

        outs = depth_outputs(
            self.stack, self.embed, tokens, self.hidden_rows(wins), cfg.depths, cfg.chain, cfg.use_ttt, pick
        )
        total = torch.zeros(())
        agree = []
        for k, y in enumerate(outs):
            lg = logits[k] if k < len(logits) else y @ w_c.T
            logq = torch.log_softmax(lg, dim=-1)
            tgt = torch.from_numpy(lut[top_idx[:, k + 1 : t]])
            p = torch.softmax(torch.from_numpy(top_logp[:, k + 1 : t]), dim=-1)
            loss_k = -(p * logq.gather(-1, tgt)).sum(-1).mean()
            total = total + loss_k / len(outs)
            with torch.no_grad():
                agree.append(float((logq.argmax(-1) == tgt[..., 0]).float().mean()))
        total.backward()
        self.opt.step()
        self.step += 1
        loss = float(total.detach())
        self.losses.append(loss)
        return loss, agree

    def run(self, ckpt: Path | None, on_step: StepFn | None = None) -> TrainResult:
        start = self.step
        t0 = time.perf_counter()
        while self.step < self.cfg.steps:
            loss, agree = self.train_step()
            if ckpt is not None and self.cfg.checkpoint_every and self.step % self.cfg.checkpoint_every == 0:
                self.save(ckpt)
            if on_step:
                on_step(self.step, self.cfg.steps, loss, agree)
        if ckpt is not None and self.cfg.checkpoint_every and self.step > start:
            self.save(ckpt)
        return TrainResult(self.stack, self.step, start, list(self.losses), time.perf_counter() - t0, self.hnorm_scale)

    # ------------------------------------------------------------ evaluation
    def drafts(self, windows: np.ndarray, ttt: bool = False) -> list[np.ndarray]:
        """Full-vocabulary argmax drafts [W, T] per depth (torch weights, f32). Teacher-forced
        by default, as the engine's check (``engine_drafts``) and ``mtp-probe`` read the
        text; ``ttt`` feeds each depth the earlier depths' drafts, as the Drafter does."""
        from cortiq_train.draft_torch import depth_outputs

        torch, f, cfg = self.torch, self.f, self.cfg
        t = f.seq
        out = [np.full((len(windows), t), -1, np.int64) for _ in range(cfg.depths)]

        def pick(d, rows):
            return (rows @ self.head.T).argmax(-1).numpy()

        with torch.no_grad():
            for i, w in enumerate(windows):
                ys = depth_outputs(
                    self.stack,
                    self.embed,
                    np.asarray(f.tokens[w : w + 1], np.int64),
                    self.hidden_rows(np.array([w])),
                    cfg.depths,
                    cfg.chain,
                    ttt,
                    pick,
                )
                for k, y in enumerate(ys):
                    out[k][i, : t - k - 1] = pick(k, y[0])
        return out

    def evaluate(self, windows: np.ndarray) -> Acceptance:
        return Acceptance.from_arrays(self.drafts(windows), self.f.greedy[windows])


def _active_vocab(feats: Features, chunk: int = 256) -> np.ndarray:
    """Every token the teacher ranks in its top-k on the training windows, and the text's
    own tokens (read in chunks of windows: the arrays may be memory-mapped)."""
    seen = np.zeros(0, np.int64)
    tr = np.sort(feats.train)
    for s in range(0, len(tr), chunk):
        w = tr[s : s + chunk]
        part = np.concatenate([np.asarray(feats.top_idx[w]).ravel(), np.asarray(feats.tokens[w]).ravel()])
        seen = np.union1d(seen, part.astype(np.int64))
    return seen
