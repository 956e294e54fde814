#!/usr/bin/env python3
"""What exact speculative decoding can gain from the engine alone: drafts rigged to an acceptance rate.

    python benchmarks/spec_rigged.py MODEL.cmf --accept 0.7 --depths 1,2,3 --prompts 3 --tokens 64

For each prompt, plain greedy decoding runs first and gives the true continuation.
A rigged drafter then proposes, at each depth independently, the true next token
with probability ``--accept`` and a wrong one otherwise (so depth k is accepted
with probability accept^k in a chain), at no draft cost. The speculative run must
reproduce the plain tokens exactly; its speed over plain decoding is what the
batched verify alone allows (the speculative target: depth 3 at 70% on the
1.1B shape >= 1.8x). Plain decoding runs again after each speculative run and the
faster plain run is kept, so machine drift does not flatter speculation.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cortiq_engine.engine import Engine  # noqa: E402
from cortiq_engine.generate import generate  # noqa: E402
from cortiq_engine.sampling import SamplingConfig  # noqa: E402

TEXT = Path(__file__).resolve().parents[1] / "evals" / "data" / "alice.txt"


@dataclass
class _Label:
    source: str = "rigged"
    label: str = "rigged"


@dataclass
class RiggedDrafter:
    """The decode loop's drafter protocol, drafting from a known continuation."""

    truth: list[int]  # prompt + the plain greedy continuation
    depth: int
    accept: float
    capacity: int
    seed: int = 0
    chain: str = "rigged"
    hidden: str = "none"
    threshold: float = 0.0
    stack: _Label = field(default_factory=_Label)
    head: _Label = field(default_factory=_Label)
    last_source: str = "rigged"  # every round's drafts come from here
    hist_len: int = 0

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)

    def reset(self) -> None:
        self.hist_len = 0

    def keep(self, n: int) -> None:
        self.hist_len = n

    def note(self, first_pos: int, rows) -> None:
        self.hist_len = first_pos + len(rows)

    def observe(self, emitted: int, seconds: float) -> None:
        pass

    def describe(self) -> dict:
        """The settings a result reports, in the MTP drafter's keys (``mtp.Drafter.describe``)."""
        return {
            "source": self.stack.source,
            "mtp_depth": self.depth,
            "chain": self.chain,
            "hidden": self.hidden,
            "draft_vocab": self.head.label,
            "threshold": self.threshold,
            "accept": self.accept,
        }

    def draft(self, t: int, ids, depth: int | None = None) -> list[int]:
        out = []
        for k in range(depth or self.depth):
            pos = t + 2 + k  # t: the last forwarded position; t + 1 is the pending token
            good = self.truth[pos] if pos < len(self.truth) else 0
            out.append(good if self.rng.random() < self.accept else (good + 1) % 1000)
        return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--accept", type=float, default=0.7)
    ap.add_argument("--depths", default="1,2,3")
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=None, help="default: the engine's (adaptive)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    eng = Engine.load(a.model, threads=a.threads, ctx=1024)
    paras = [p for p in TEXT.read_text(encoding="utf-8").split("\n\n") if len(p) > 300][: a.prompts]
    depths = [int(x) for x in a.depths.split(",")]
    rows = {d: [] for d in depths}
    for pi, p in enumerate(paras):
        ids = eng.tokenizer.encode(p[:400])
        plain = eng.generate(ids, max_tokens=a.tokens, ignore_eos=True, speculative=False)
        truth = list(ids) + list(plain.token_ids)
        for d in depths:
            rig = RiggedDrafter(truth, d, a.accept, eng.ctx, seed=pi)
            # The engine's one decode loop, handed a drafter that is not a draft-layer stack.
            spec = generate(
                eng.model,
                eng.tokenizer,
                ids,
                SamplingConfig(),
                capacity=eng.ctx,
                max_tokens=a.tokens,
                drafter=rig,
                threads=eng.decode_threads,
            )
            again = eng.generate(ids, max_tokens=a.tokens, ignore_eos=True, speculative=False)
            if spec.token_ids != plain.token_ids or again.token_ids != plain.token_ids:
                raise SystemExit(f"prompt {pi}, depth {d}: speculative tokens differ from plain greedy")
            base = max(plain.decode_tok_s, again.decode_tok_s)
            acc = spec.extra["mtp"]
            rows[d].append(
                {
                    "speedup": spec.decode_tok_s / base,
                    "plain_tok_s": base,
                    "spec_tok_s": spec.decode_tok_s,
                    "tokens_per_round": acc.get("tokens_per_round"),
                }
            )
            plain = again if again.decode_tok_s > plain.decode_tok_s else plain
    report = {
        "model": a.model,
        "accept": a.accept,
        "tokens": a.tokens,
        "prompts": len(paras),
        "load": os.getloadavg(),
        "depths": {
            d: {
                "speedup_median": statistics.median(r["speedup"] for r in rs),
                "tokens_per_round": statistics.median(r["tokens_per_round"] or 0 for r in rs),
                "plain_tok_s": statistics.median(r["plain_tok_s"] for r in rs),
                "spec_tok_s": statistics.median(r["spec_tok_s"] for r in rs),
            }
            for d, rs in rows.items()
        },
    }
    if a.json:
        print(json.dumps(report, indent=1))
        return
    print(
        f"{Path(a.model).name}: drafts rigged to {a.accept:.0%} per depth, {len(paras)} prompts x {a.tokens} tokens, "
        f"output identical to plain greedy; load {report['load'][0]:.2f}"
    )
    print(f"{'depth':>5} {'tokens/round':>12} {'plain tok/s':>11} {'spec tok/s':>10} {'speedup':>8}")
    for d, r in report["depths"].items():
        print(
            f"{d:5d} {r['tokens_per_round']:12.2f} {r['plain_tok_s']:11.2f} {r['spec_tok_s']:10.2f} {r['speedup_median']:7.2f}x"
        )


if __name__ == "__main__":
    main()
