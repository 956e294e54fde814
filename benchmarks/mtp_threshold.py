"""Choose the adaptive-depth threshold on held-out text against the backbone's greedy tokens.

    python benchmarks/mtp_threshold.py MODEL.cmf SIDECAR.mtp.cmf HELD.txt --vocab 8192 \\
        --draft-ms 0.6 --verify-ms 10.46,16.1,19.8,25.0

Teacher-forced on the text: each round's drafts (depth = len(verify-ms) - 1, the default
chain) with their own probabilities, each right when it equals the backbone's greedy
token at its position (what a live verify accepts; ``mtp-probe`` compares with the text
instead). ``evals.mtp_probe.threshold_table`` replays the rounds under each threshold
with the given costs (ms per computed draft; ms of a verify of 1, 2, ... rows, 1 = a
plain decode step). Prints the depth-1 calibration and one table per depth.
"""

from __future__ import annotations

import argparse
import json

import numpy as np

from cortiq_engine import Engine
from cortiq_engine.mtp import make_drafter
from evals.mtp_probe import ProbeTrace, backbone_hiddens, threshold_table


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("sidecar")
    ap.add_argument("text")
    ap.add_argument("--tokens", type=int, default=768)
    ap.add_argument("--vocab", default="sidecar", help="full, sidecar, or N")
    ap.add_argument("--draft-ms", type=float, required=True)
    ap.add_argument("--verify-ms", required=True, help="comma list: verify of 1, 2, ... rows")
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    verify = [float(x) for x in a.verify_ms.split(",")]
    depth = len(verify) - 1
    eng = Engine.load(a.model, threads=a.threads, mtp=a.sidecar)
    ids = eng.tokenizer.encode(open(a.text, encoding="utf-8").read(), add_bos=True)[: a.tokens]
    greedy = eng.logits(ids).argmax(axis=1)  # greedy[j]: the backbone's token for position j+1
    head = eng.draft_head(None if a.vocab == "sidecar" else a.vocab if a.vocab == "full" else int(a.vocab))
    d = make_drafter(eng.model, eng.drafts, len(ids), depth=depth, head=head, record_probs=True)
    d.note(0, backbone_hiddens(eng.model, np.array(ids)))
    probs, right = [], []
    for t in range(len(ids) - depth - 1):
        drafts = d.draft(t, ids, depth)
        probs.append(d.probs)
        right.append([int(x) == int(greedy[t + 1 + k]) for k, x in enumerate(drafts)])
    tr = ProbeTrace(np.array(probs), np.array(right))
    p, r = tr.probs[:, 0], tr.right[:, 0]
    edges = [0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.8, 1.0001]
    calib = [
        {"p": f"{lo:.1f}-{hi:.1f}", "rounds": int(m.sum()), "accepted": float(r[m].mean()) if m.any() else None}
        for lo, hi in zip(edges, edges[1:])
        for m in [(p >= lo) & (p < hi)]
    ]
    print(
        json.dumps(
            {
                "vocab": head.label,
                "chained_vs_greedy": np.cumprod(tr.right, axis=1).mean(axis=0).tolist(),
                "d1_calibration": calib,
            }
        )
    )
    for k in range(1, depth + 1):
        sub = ProbeTrace(tr.probs[:, :k], tr.right[:, :k])
        print(
            json.dumps({"depth": k, "rows": [x.to_json() for x in threshold_table(sub, a.draft_ms, verify[: k + 1])]})
        )


if __name__ == "__main__":
    main()
