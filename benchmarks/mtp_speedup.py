"""Plain greedy vs MTP speculative greedy decoding, same prompts, same tokens checked.

    python benchmarks/mtp_speedup.py MODEL.cmf SIDECAR.mtp.cmf TEXT.txt --prompts 4 --tokens 64 --depths 1,2,3

Prompts are the first 400 characters of the text's paragraphs longer than 300
characters. Plain decoding runs again after each speculative run and the faster
of the plain runs is kept, so machine drift does not flatter speculation.
"""

from __future__ import annotations

import argparse
import json

from cortiq_engine.engine import Engine
from cortiq_engine.mtp import load_draft_stack, make_drafter
from cortiq_engine.speculative import generate_with_engine


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("sidecar")
    ap.add_argument("text")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--depths", default="1,2,3")
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    eng = Engine.load(a.model, threads=a.threads)
    paras = [p for p in open(a.text, encoding="utf-8").read().split("\n\n") if len(p) > 300][: a.prompts]
    stack = load_draft_stack(eng.cmf, eng.arch, eng.model.kernels, a.sidecar)
    depths = [int(x) for x in a.depths.split(",")]
    rows = []
    for p in paras:
        ids = eng.tokenizer.encode(p[:400])
        plain = eng.generate(ids, max_tokens=a.tokens, ignore_eos=True)
        for depth in depths:
            drafter = make_drafter(eng.model, stack, eng.ctx, depth=depth)
            spec = generate_with_engine(eng, ids, drafter, max_tokens=a.tokens, eos_ids=())
            again = eng.generate(ids, max_tokens=a.tokens, ignore_eos=True)
            if again.decode_seconds < plain.decode_seconds:
                plain = again
            rows.append(dict(depth=depth, same=plain.token_ids == spec.token_ids, plain_s=plain.decode_seconds,
                             spec_s=spec.decode_seconds, plain_tok_s=plain.decode_tok_s, spec_tok_s=spec.decode_tok_s,
                             mtp=spec.extra["mtp"]))
            print(json.dumps(rows[-1]), flush=True)
    for depth in depths:
        rs = [r for r in rows if r["depth"] == depth]
        rounds = sum(r["mtp"]["rounds"] for r in rs)
        acc = [sum(r["mtp"]["depth_accepted"][k] for r in rs) / max(1, sum(r["mtp"]["depth_drafted"][k] for r in rs))
               for k in range(depth)]
        print(json.dumps({"depth": depth, "all_same": all(r["same"] for r in rs),
                          "speedup": sum(r["plain_s"] for r in rs) / sum(r["spec_s"] for r in rs),
                          "acceptance_per_depth": acc,
                          "tokens_per_round": sum(r["mtp"]["accepted"] for r in rs) / rounds + 1}))


if __name__ == "__main__":
    main()
