"""The one acceptance counter of MTP drafts.

Speculative decoding (``cortiq generate``, ``chat``, ``bench``, benchmarks/mtp_speedup.py),
the teacher-forced probe (``cortiq mtp-probe``) and the trainer's held-out evaluation
(``cortiq mtp-train``) all count into ``Acceptance``, so they report the same figures
under the same names. Lists are per depth (index 0 = depth 1):

- ``drafted[d]``: rounds that drafted depth d+1; ``accepted[d]``: of those, rounds whose
  drafts 1..d+1 were all accepted (chained, what a speculative round keeps);
- ``checked[d]``, ``right[d]``: drafts of depth d+1 compared with the truth on their own
  (teacher-forced only: live decoding never learns the truth past the first rejection);
- tokens per round = 1 + sum(accepted) / rounds: the accepted drafts plus the verify's
  own token;
- ``depth_hist[k]``: rounds that drafted and proposed exactly k drafts (adaptive depth
  stops a round early; ``depth_hist[0]``: its first draft was already too unlikely, the
  step decoded one token plainly). A step with no room for drafts (the token budget or
  the context) is a ``plain_step`` only.

With more than one draft source (``cortiq_engine.lookup``: n-gram lookup first, MTP
layers otherwise) ``by_source[name]`` holds the same counts for the rounds each source
drafted; the totals cover every round.

Draft and verify times are summed over every round that drafted (``drafting_rounds``,
which includes the ``depth_hist[0]`` ones), so ``draft_ms_per_round`` is what drafting
costs per decode step that tried it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np


@dataclass
class Acceptance:
    depth: int
    drafted: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)
    checked: list[int] = field(default_factory=list)
    right: list[int] = field(default_factory=list)
    accept_hist: list[int] = field(default_factory=list)  # [a] = rounds that accepted exactly a drafts
    depth_hist: list[int] = field(default_factory=list)  # [k] = drafting rounds that proposed exactly k drafts
    plain_steps: int = 0  # decode steps without drafts (the token budget or context left no room)
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    by_source: dict[str, "Acceptance"] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("drafted", "accepted", "checked", "right"):
            setattr(self, name, getattr(self, name) or [0] * self.depth)
        self.accept_hist = self.accept_hist or [0] * (self.depth + 1)
        self.depth_hist = self.depth_hist or [0] * (self.depth + 1)

    # ------------------------------------------------------------ counting
    def record(
        self,
        drafted: int,
        accepted: int,
        draft_s: float = 0.0,
        verify_s: float = 0.0,
        *,
        tried: bool = True,
        source: str | None = None,
    ) -> None:
        """One decode step: ``drafted`` drafts proposed, the first ``accepted`` of them kept.
        ``tried``: the step ran the drafter (False: no room for drafts, a plain step);
        ``source``: which draft source proposed them (also counted in ``by_source``)."""
        if source and tried:
            self.by_source.setdefault(source, Acceptance(self.depth)).record(drafted, accepted, draft_s, verify_s)
        if tried:
            self.depth_hist[drafted] += 1
            self.draft_seconds += draft_s
            self.verify_seconds += verify_s
        if drafted == 0:
            self.plain_steps += 1
            return
        for d in range(drafted):
            self.drafted[d] += 1
            self.accepted[d] += d < accepted
        self.accept_hist[accepted] += 1

    def record_forced(self, drafts: Sequence[int], truth: Sequence[int], draft_s: float = 0.0) -> None:
        """One teacher-forced round: each draft against the true token of its depth."""
        ok = [int(d) == int(y) for d, y in zip(drafts, truth)]
        run = next((i for i, r in enumerate(ok) if not r), len(ok))
        for d, r in enumerate(ok):
            self.checked[d] += 1
            self.right[d] += r
        self.record(len(ok), run, draft_s)

    @classmethod
    def from_arrays(cls, drafts: list[np.ndarray], greedy: np.ndarray) -> "Acceptance":
        """Teacher-forced counts of whole windows at once (the trainer's evaluation).

        ``drafts[k][w, j]`` is what depth k+1 drafts in the round after position j of
        window w: the token for j+k+2, right when it equals ``greedy[w, j+k+1]``. Alone,
        depth k counts every row that has a teacher; chained counts the rows that have
        one at every depth."""
        kk = len(drafts)
        t = greedy.shape[1]
        acc = cls(kk)
        ok = []
        for k, d in enumerate(drafts):
            n = max(t - k - 1, 0)  # rows j = 0..T-k-2 have a teacher at j+k+1
            hit = d[:, :n] == greedy[:, k + 1 : k + 1 + n]
            ok.append(hit)
            acc.checked[k], acc.right[k] = int(hit.size), int(hit.sum())
        m = max(t - kk, 0)  # rows with every depth: j <= T-K-1
        run = np.ones((greedy.shape[0], m), bool)
        runs = np.zeros((greedy.shape[0], m), np.int64)
        for k in range(kk):
            run = run & ok[k][:, :m]
            acc.drafted[k], acc.accepted[k] = int(run.size), int(run.sum())
            runs += run
        acc.accept_hist = np.bincount(runs.ravel(), minlength=kk + 1).tolist()
        acc.depth_hist[kk] = int(run.size)
        return acc

    def merge(self, other: "Acceptance") -> None:
        """Add another run's counts (same depth), e.g. over a benchmark's prompts."""
        if other.depth != self.depth:
            raise ValueError(f"merging counts of depth {other.depth} into depth {self.depth}")
        for name in ("drafted", "accepted", "checked", "right", "accept_hist", "depth_hist"):
            setattr(self, name, [x + y for x, y in zip(getattr(self, name), getattr(other, name))])
        self.plain_steps += other.plain_steps
        self.draft_seconds += other.draft_seconds
        self.verify_seconds += other.verify_seconds
        for name, sub in other.by_source.items():
            self.by_source.setdefault(name, Acceptance(self.depth)).merge(sub)

    # ------------------------------------------------------------ figures
    @property
    def rounds(self) -> int:
        """Rounds that carried drafts."""
        return self.drafted[0] if self.depth else 0

    @property
    def drafting_rounds(self) -> int:
        """Steps that ran the drafter (those that proposed no draft included)."""
        return sum(self.depth_hist)

    @property
    def tokens_per_round(self) -> float:
        """Tokens a drafting step emits on average (a step that proposed nothing: 1)."""
        return 1.0 + sum(self.accepted) / self.drafting_rounds if self.drafting_rounds else 1.0

    @property
    def acceptance(self) -> float:
        """Accepted drafts over drafted ones, every depth together."""
        n = sum(self.drafted)
        return sum(self.accepted) / n if n else 0.0

    @property
    def chained(self) -> list[float]:
        """Per depth: P(drafts 1..d all accepted), over the rounds that drafted depth d."""
        return [a / n if n else 0.0 for a, n in zip(self.accepted, self.drafted)]

    @property
    def alone(self) -> list[float]:
        """Per depth: P(the draft is right on its own) (teacher-forced counts only)."""
        return [r / n if n else 0.0 for r, n in zip(self.right, self.checked)]

    def to_json(self) -> dict:
        out = self._figures()
        if self.by_source:
            out["by_source"] = {name: sub._figures() for name, sub in sorted(self.by_source.items())}
        return out

    def _figures(self) -> dict:
        r = max(self.drafting_rounds, 1)
        return {
            "depth": self.depth,
            "rounds": self.rounds,
            "plain_steps": self.plain_steps,
            "drafted": sum(self.drafted),
            "accepted": sum(self.accepted),
            "acceptance": self.acceptance,
            "tokens_per_round": self.tokens_per_round,
            "acceptance_per_depth": self.chained,
            "acceptance_alone": self.alone if any(self.checked) else None,
            "depth_drafted": self.drafted,
            "depth_accepted": self.accepted,
            "depth_checked": self.checked,
            "depth_right": self.right,
            "accept_histogram": self.accept_hist,
            "depth_histogram": self.depth_hist,
            "drafting_rounds": self.drafting_rounds,
            "mean_depth": sum(k * n for k, n in enumerate(self.depth_hist)) / r,
            "draft_ms_per_round": 1e3 * self.draft_seconds / r,
            "verify_ms_per_round": 1e3 * self.verify_seconds / r,
        }
