"""The settings of one ``mtp-train`` run, checked before any work starts."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from formats.errors import CortiqError

HIDDEN_CHOICES = ("pre", "post")
VOCAB_CHOICES = ("active", "full")
CHAIN_CHOICES = ("independent", "recursive")
FEATURE_DTYPES = ("f16", "f32")
# Settings a resumed run must share with the checkpoint (the rest may change, e.g. steps).
RESUME_KEYS = (
    "layers",
    "seq",
    "batch",
    "lr",
    "warmup",
    "topk",
    "intermediate",
    "init_layer",
    "hidden",
    "vocab",
    "negatives",
    "seed",
    "holdout",
    "ttt",
    "chain",
    "depth",
    "self_distill",
    "self_temperature",
    "chat",
)


@dataclass
class TrainConfig:
    layers: int = 1  # K draft layers, depth k predicts the token k+2 ahead of the hidden
    steps: int = 200
    seq: int = 256  # tokens per window (the backbone context and the draft sequence)
    batch: int = 2  # windows per step
    lr: float = 5e-4
    warmup: int = 10
    topk: int = 32  # teacher probabilities kept per position (renormalized)
    intermediate: int | None = None  # draft MLP width; None = the backbone's
    init_layer: int = -1  # backbone layer the draft block starts from
    hidden: str = "pre"  # backbone hidden before ("pre") or after ("post") its final norm
    vocab: str = "active"  # student softmax over the active vocabulary (+ negatives) or all of it
    negatives: int = 1024  # random extra vocabulary rows per step with vocab="active"
    holdout: float = 0.1
    max_tokens: int | None = None
    seed: int = 0
    checkpoint_every: int = 50
    # Training-time test: depth k reads this round's drafts of depths < k where inference
    # does (cortiq_engine.mtp.Drafter); False = teacher forcing with the true tokens;
    # None = on for the recursive chain only (unmeasured on the independent one yet:
    # there, chained acceptance sees the same inputs either way).
    ttt: bool | None = None
    chain: str = "independent"  # how the drafts chain at inference: K layers, or layer 0 re-fed
    depth: int = 0  # depths trained; 0 = layers (independent) or 3 (recursive)
    feature_dtype: str = "f16"  # the cached backbone hidden rows
    # > 0: each window keeps this many real tokens, the rest is the backbone's own
    # continuation (greedy, or sampled at self_temperature): the drafts' real task.
    self_distill: int = 0
    self_temperature: float = 0.0
    # True: every window is a chat turn (an ask about a passage of the text, through the
    # chat template) answered by the backbone; the text supplies passages, not windows.
    # With self_distill too, chat turns alternate with plain self-distilled windows.
    chat: bool = False

    @property
    def use_ttt(self) -> bool:
        return self.ttt if self.ttt is not None else self.chain == "recursive"

    @property
    def depths(self) -> int:
        if self.depth:
            return self.depth
        return self.layers if self.chain == "independent" else 3

    def check(self, num_layers: int) -> None:
        if self.layers < 1:
            raise CortiqError(f"--layers must be at least 1 (got {self.layers})")
        if self.steps < 0:
            raise CortiqError(f"--steps must be >= 0 (got {self.steps})")
        if self.seq < self.layers + 2:
            raise CortiqError(
                f"--seq {self.seq} is too short for {self.layers} draft layers (needs >= {self.layers + 2})"
            )
        if self.batch < 1:
            raise CortiqError(f"--batch must be at least 1 (got {self.batch})")
        if not 0.0 <= self.holdout < 1.0:
            raise CortiqError(f"--holdout must be in [0, 1) (got {self.holdout})")
        if self.hidden not in HIDDEN_CHOICES:
            raise CortiqError(f"--mtp-hidden {self.hidden!r}: choose one of {', '.join(HIDDEN_CHOICES)}")
        if self.vocab not in VOCAB_CHOICES:
            raise CortiqError(f"--vocab {self.vocab!r}: choose one of {', '.join(VOCAB_CHOICES)}")
        if self.intermediate is not None and self.intermediate < 1:
            raise CortiqError(f"--intermediate must be positive (got {self.intermediate})")
        if not -num_layers <= self.init_layer < num_layers:
            raise CortiqError(f"--init-layer {self.init_layer} is outside the backbone's {num_layers} layers")
        if self.topk < 1:
            raise CortiqError(f"--topk must be at least 1 (got {self.topk})")
        if self.lr <= 0:
            raise CortiqError(f"--lr must be positive (got {self.lr})")
        if self.checkpoint_every < 0:
            raise CortiqError(f"--checkpoint-every must be >= 0 (got {self.checkpoint_every})")
        if self.chain not in CHAIN_CHOICES:
            raise CortiqError(f"--chain {self.chain!r}: choose one of {', '.join(CHAIN_CHOICES)}")
        if self.feature_dtype not in FEATURE_DTYPES:
            raise CortiqError(f"--feature-dtype {self.feature_dtype!r}: choose one of {', '.join(FEATURE_DTYPES)}")
        if self.depth < 0:
            raise CortiqError(f"--depth must be >= 0 (got {self.depth})")
        if self.chain == "independent" and self.depth not in (0, self.layers):
            raise CortiqError(f"--depth {self.depth} with independent layers must equal --layers {self.layers}")
        if self.chain == "recursive" and self.layers != 1:
            raise CortiqError(f"--chain recursive trains one layer re-fed to each depth (got --layers {self.layers})")
        if self.seq < self.depths + 2:
            raise CortiqError(f"--seq {self.seq} is too short for depth {self.depths} (needs >= {self.depths + 2})")
        if self.self_distill and not 1 <= self.self_distill < self.seq:
            raise CortiqError(
                f"--self-distill {self.self_distill}: the real prompt must be 1..{self.seq - 1} tokens of each window"
            )
        if self.self_temperature < 0:
            raise CortiqError(f"--self-temperature must be >= 0 (got {self.self_temperature})")
        if self.max_tokens is not None and self.max_tokens < 2:
            raise CortiqError(f"--max-tokens must be at least 2 (got {self.max_tokens})")

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def resume_mismatch(self, saved: dict[str, Any]) -> list[str]:
        """Settings that differ from a checkpoint's (a resume with them would not continue the same run)."""
        mine = self.to_json()
        default = asdict(TrainConfig())
        # A setting newer than the checkpoint is read as its default (what that run used).
        return [
            f"{k} {saved.get(k, default[k])!r} in the checkpoint, {mine[k]!r} now"
            for k in RESUME_KEYS
            if saved.get(k, default[k]) != mine[k]
        ]
