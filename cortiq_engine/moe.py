"""Mixture-of-experts feed-forward: a router picks top-k experts per position.

Routing (``route``) follows the published models:

- ``softmax`` (Qwen2-MoE, Qwen3-MoE, Mixtral, Qwen3-Next): softmax over all
  experts, top-k, renormalized over the k when ``norm_topk_prob``;
- ``sigmoid`` (MiMo-V2, DeepSeek-V3 style): per-expert sigmoid scores; the choice
  adds a learned bias and may be restricted to the best ``topk_group`` of
  ``n_group`` expert groups; the weights are the unbiased scores of the chosen
  experts, renormalized when ``norm_topk_prob``, times ``routed_scaling_factor``.

Ties go to the lower expert index. The block then groups the positions of a
batch by expert, so each chosen expert's weights are read once per call and the
pages of experts nobody chose are never touched. Qwen2-MoE / Qwen3-Next add a
shared expert scaled by a sigmoid gate.

GPT-OSS adds a router bias to the logits (top-k of the logits, softmax over the k: the
same weights as softmax, top-k, renormalize) and experts with biases and a clamped
SwiGLU (``BiasedExpert``).
"""

from __future__ import annotations

import numpy as np

from formats.arch import MoeConfig
from formats.errors import CortiqError
from cortiq_engine.layers import Block, GatedMLP, Step
from cortiq_engine.weights import Weight


def _top_k(scores: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k largest scores per row, best first; equal scores: lower index first."""
    return np.argsort(-scores, axis=-1, kind="stable")[:, :k]


def route(logits: np.ndarray, cfg: MoeConfig, bias: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Router logits [n, experts] -> (expert ids [n, k] int64, weights [n, k] f32)."""
    logits = logits.astype(np.float32, copy=False)
    if cfg.scoring == "softmax":
        z = np.exp(logits - logits.max(axis=-1, keepdims=True))
        probs = z / z.sum(axis=-1, keepdims=True)
        idx = _top_k(probs, cfg.top_k)
        w = np.take_along_axis(probs, idx, axis=-1)
        if cfg.norm_topk_prob:
            w = w / w.sum(axis=-1, keepdims=True)
        return idx, w.astype(np.float32)
    if cfg.scoring == "sigmoid":
        scores = (np.float32(1.0) / (np.float32(1.0) + np.exp(-logits))).astype(np.float32)
        choice = scores + bias if bias is not None else scores.copy()
        if cfg.n_group > 1:
            n, e = choice.shape
            grouped = choice.reshape(n, cfg.n_group, e // cfg.n_group)
            # A group's score is the sum of its two best experts.
            best2 = -np.sort(-grouped, axis=-1)[:, :, :2].sum(axis=-1)
            keep = _top_k(best2, cfg.topk_group)
            mask = np.zeros((n, cfg.n_group), bool)
            np.put_along_axis(mask, keep, True, axis=-1)
            choice = np.where(np.repeat(mask, e // cfg.n_group, axis=-1), choice, -np.inf)
        idx = _top_k(choice, cfg.top_k)
        w = np.take_along_axis(scores, idx, axis=-1)
        if cfg.norm_topk_prob:
            w = w / (w.sum(axis=-1, keepdims=True) + np.float32(1e-20))
        return idx, (w * np.float32(cfg.routed_scaling_factor)).astype(np.float32)
    raise ValueError(f"unknown MoE scoring {cfg.scoring!r}")  # arch.py only writes the two above


class MoE:
    """Routed experts (+ optional gated shared expert) over [n, hidden] rows."""

    def __init__(
        self,
        kernels,
        cfg: MoeConfig,
        router: Weight,
        experts: list[GatedMLP],
        *,
        score_bias: np.ndarray | None = None,
        shared: GatedMLP | None = None,
        shared_gate: Weight | None = None,
        router_bias: np.ndarray | None = None,
    ):
        self.ks = kernels
        self.cfg = cfg
        self.router = router
        self.experts = experts
        self.score_bias = score_bias
        self.shared = shared
        self.shared_gate = shared_gate
        self.router_bias = router_bias
        # Experts with their own biases or activation (GPT-OSS) take the generic path of _one_row.
        self._plain = not any(isinstance(e, BiasedExpert) for e in experts)

    @property
    def num_experts(self) -> int:
        return len(self.experts)

    def weights(self) -> list[Weight]:
        out = [self.router]
        for e in self.experts:
            out.extend(e.weights())
        if self.shared is not None:
            out.extend(self.shared.weights())
        if self.shared_gate is not None:
            out.append(self.shared_gate)
        return out

    def __call__(self, x: np.ndarray, usage: np.ndarray | None = None) -> np.ndarray:
        """The FFN output for rows ``x``; adds each row's chosen experts to ``usage`` [experts]."""
        ks = self.ks
        logits = ks.matmul((self.router,), x)
        if self.router_bias is not None:
            logits += self.router_bias
        idx, w = route(logits, self.cfg, self.score_bias)
        if usage is not None:
            np.add.at(usage, idx.reshape(-1), 1)
        if x.shape[0] == 1:
            out = self._one_row(x, idx[0], w[0])
        else:
            out = self._grouped(x, idx, w)
        if self.shared is not None:
            s = self.shared(x)
            if self.shared_gate is not None:
                g = ks.matmul((self.shared_gate,), x)
                s *= np.float32(1.0) / (np.float32(1.0) + np.exp(-g))
            out += s
        return out

    def _one_row(self, x: np.ndarray, idx: np.ndarray, w: np.ndarray) -> np.ndarray:
        """Decode: the chosen experts' gate|up products in one kernel call."""
        ks = self.ks
        order = [int(e) for e in np.sort(idx)]
        mats = [self.experts[e].weights() for e in order]  # [gate, up, down] each
        gu = ks.matmul([m for gate, up, _ in mats for m in (gate, up)], x)
        out = np.zeros_like(x)
        wide = gu.shape[1] // len(order)
        weight = dict(zip(idx.tolist(), w.tolist()))
        # The same per-row operations, in the same expert order, as ``_grouped``.
        for j, (e, (_, _, down)) in enumerate(zip(order, mats)):
            if not self._plain:
                expert = self.experts[e]
                out += expert.down_rows(expert.activate(gu[:, j * wide : (j + 1) * wide])) * np.float32(weight[e])
                continue
            a = ks.silu_mul(np.ascontiguousarray(gu[:, j * wide : (j + 1) * wide]))
            out += ks.matmul((down,), a) * np.float32(weight[e])
        return out

    def _grouped(self, x: np.ndarray, idx: np.ndarray, w: np.ndarray) -> np.ndarray:
        out = np.zeros_like(x)
        # Experts in ascending order: a row's sum has the same order whatever the batch.
        for e in np.unique(idx):
            rows, slot = np.nonzero(idx == e)
            y = self.experts[int(e)](np.ascontiguousarray(x[rows]))
            out[rows] += y * w[rows, slot][:, None]
        return out


class MoeBlock(Block):
    """A pre-norm block whose FFN is an ``MoE``; counts expert choices per layer in
    the sequence's ``State`` (through ``Step.expert_usage``)."""

    def __init__(self, attn_norm, attn, mlp_norm, mlp: MoE, layer: int):
        super().__init__(attn_norm, attn, mlp_norm, mlp)
        self.layer = int(layer)

    def __call__(self, x: np.ndarray, cache, step: Step) -> None:
        a = self.attn(self.attn_norm(x), cache, step)
        h = self.mlp_norm.add_then_norm(x, a)
        x += self.mlp(h, step_usage(step, self.layer, self.mlp.num_experts))


def step_usage(step: Step, layer: int, experts: int) -> np.ndarray | None:
    """The expert-count row of ``layer`` in the sequence's usage table (None if not kept)."""
    table = step.expert_usage
    if table is None:
        return None
    if layer not in table:
        table[layer] = np.zeros(experts, np.int64)
    return table[layer]


class BiasedExpert(GatedMLP):
    """A GPT-OSS expert: ``down(act(gate(x) + bg, up(x) + bu)) + bd`` where, with
    ``limit`` > 0, gate is clamped above at ``limit`` and up to [-limit, limit], and
    ``act`` is ``(up + 1) * gate * sigmoid(alpha * gate)`` (``alpha`` 0: ``silu(gate) * up``).
    Gate and up run as one fused matmul, as in the ``GatedMLP`` it extends."""

    def __init__(
        self,
        kernels,
        gate: Weight,
        up: Weight,
        down: Weight,
        gate_bias: np.ndarray | None,
        up_bias: np.ndarray | None,
        down_bias: np.ndarray | None,
        limit: float = 0.0,
        alpha: float = 0.0,
    ):
        super().__init__(kernels, gate, up, down)  # refuses shapes that disagree
        width = gate.rows
        for name, b, n in (("gate", gate_bias, width), ("up", up_bias, width), ("down", down_bias, down.rows)):
            if b is not None and b.shape != (n,):
                raise CortiqError(f"expert {name} bias has {b.size} values, its projection has {n} rows")
        self.gu_bias = (
            None
            if gate_bias is None and up_bias is None
            else np.concatenate(
                [np.zeros(width, np.float32) if b is None else b.astype(np.float32) for b in (gate_bias, up_bias)]
            )
        )
        self.down_bias = None if down_bias is None else down_bias.astype(np.float32)
        self.limit = np.float32(limit)
        self.alpha = np.float32(alpha)

    def activate(self, gu: np.ndarray) -> np.ndarray:
        """[n, 2 * width] gate|up products (biases not yet added) -> [n, width] activations."""
        if self.gu_bias is not None:
            gu = gu + self.gu_bias
        width = gu.shape[1] // 2
        gate, up = gu[:, :width], gu[:, width:]
        if self.limit > 0:
            gate = np.minimum(gate, self.limit)
            up = np.clip(up, -self.limit, self.limit)
        one = np.float32(1.0)
        with np.errstate(over="ignore"):  # exp overflows to inf for very negative gates: sigmoid 0
            if self.alpha > 0:
                glu = gate * (one / (one + np.exp(-(gate * self.alpha))))
                return np.ascontiguousarray((up + one) * glu, dtype=np.float32)
            return np.ascontiguousarray(gate * (one / (one + np.exp(-gate))) * up, dtype=np.float32)

    def down_rows(self, a: np.ndarray) -> np.ndarray:
        y = self.ks.matmul(self._down, a)
        if self.down_bias is not None:
            y += self.down_bias
        return y

    def __call__(self, x: np.ndarray) -> np.ndarray:
        return self.down_rows(self.activate(self.ks.matmul(self._gu, x)))
