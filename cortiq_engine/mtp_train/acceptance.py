"""Teacher-forced acceptance of K draft depths against the backbone's greedy tokens.

``drafts[k][w, j]`` is what depth k+1 drafts from row j of window w (the round
that starts after position j): the token for position j+k+2. It is accepted when
it equals ``greedy[w, j+k+1]``, the backbone's greedy token after position j+k+1
(teacher-forced: the earlier tokens are the text's). A round accepts depth d only
if every depth before it was accepted too (chained), and emits the accepted
drafts plus the verify's own token: tokens per round = 1 + sum_d chain_d.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class Acceptance:
    alone: list[float]  # per depth: P(depth d accepted), over every row that has depth d
    chained: list[float]  # per depth: P(depths 1..d all accepted), over rows that have all K
    rows: list[int]  # rows counted per depth (alone)
    chain_rows: int

    @property
    def tokens_per_round(self) -> float:
        return 1.0 + float(sum(self.chained))

    def to_json(self) -> dict:
        return {
            "alone": self.alone,
            "chained": self.chained,
            "rows": self.rows,
            "chain_rows": self.chain_rows,
            "tokens_per_round": self.tokens_per_round,
        }


def acceptance(drafts: list[np.ndarray], greedy: np.ndarray) -> Acceptance:
    """drafts: K arrays [W, T] (entries past T-k-2 are ignored); greedy [W, T]."""
    kk = len(drafts)
    t = greedy.shape[1]
    ok = []
    alone, rows = [], []
    for k, d in enumerate(drafts):
        n = t - k - 1  # rows j = 0..T-k-2 have a teacher at j+k+1
        hit = d[:, :n] == greedy[:, k + 1 : k + 1 + n]
        ok.append(hit)
        alone.append(float(hit.mean()) if hit.size else 0.0)
        rows.append(int(hit.size))
    m = t - kk  # rows with every depth: j <= T-K-1
    chained = []
    run = np.ones((greedy.shape[0], max(m, 0)), bool)
    for k in range(kk):
        run = run & ok[k][:, : max(m, 0)]
        chained.append(float(run.mean()) if run.size else 0.0)
    return Acceptance(alone, chained, rows, int(run.size))
