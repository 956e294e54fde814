"""Plain greedy vs MTP speculative greedy decoding, same prompts, same tokens and text checked.

    python benchmarks/mtp_speedup.py MODEL.cmf SIDECAR.mtp.cmf TEXT.txt --prompts 4 --tokens 64 --depths 1,2,3 \
        [--vocabs full,8192] [--thresholds 0,0.3]

``--depths default,1``: ``default`` runs what ``cortiq generate`` drafts unless told (the
sidecar's measured depth and threshold, ``mtp-train``/``mtp-probe --save``).
``--lookups default,0,3``: n-gram lookup drafts per round before the MTP layers
(``cortiq_engine.lookup``; ``default`` = the engine's, 0 = MTP alone). SIDECAR ``none``:
no draft layers, lookup alone (``--lookups 3 --depths default``).

Every (depth, draft vocabulary, threshold, lookup, decide) combination runs on every
prompt; ``--vocabs`` takes ``full``, ``sidecar`` (the sidecar's own) or a count of the
sidecar's first ids. ``--decide on,off``: with the measured choice of sources
(``cortiq_engine.spec_decision``, the default: a source drafts only while its rounds
beat plain steps) and without it (every round drafts), so both the sources' own rate
and what the choice makes of it are measured; each result carries the choice's line.

Prompts are the first 400 characters of the text's paragraphs longer than 300
characters (``--min-chars``). ``--chat`` wraps each in the model's chat template as a
user message with an instruction (``--asks summary``: CHAT_ASKS, cycled; ``continue``:
CONTINUE_ASKS, asking the model to go on with the text) and lets the answer end at its
end-of-turn token, as ``cortiq generate --chat`` does. Each combination runs ``--reps`` alternating pairs of
plain and speculative decodes of a prompt (the order flips every pair, so drift favours
neither) and each side's median time counts: the same statistic over the same number
of runs for both (the fastest of many plain runs against one speculative run would be a
best-of-six against a single draw on a machine whose step time wanders 7-11 ms). ``speedup_min`` compares the fastest of each. The
acceptance figures come from the engine's one counter (``cortiq_engine.acceptance``),
summed over the prompts: what ``generate --json`` and ``mtp-probe`` report.

``--memory``: where the measured choice remembers the sources' rates between runs
(``cortiq_engine.spec_decision.SpecMemory``, what ``cortiq generate`` uses): ``fresh``
(the default), an empty file of this benchmark's own, so its first speculative run
starts knowing nothing but what the sidecar records and every later one starts from the
runs before it, as a user's second generation does; ``off``, every run starts knowing
nothing but the sidecar's record (a first generation on a new machine); or a path.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

from cortiq_engine.acceptance import Acceptance
from cortiq_engine.engine import Engine, SpeculativeConfig
from cortiq_engine.spec_decision import SpecMemory


# What a chat user asks about a passage (cycled over the prompts).
CHAT_ASKS = (
    "Summarize this passage in a few sentences:\n\n{p}",
    "What happens in this passage?\n\n{p}",
    "Explain this passage to a child:\n\n{p}",
    "Rewrite this passage in plain modern English:\n\n{p}",
)


# What a chat user asks to have continued (cycled over the prompts).
CONTINUE_ASKS = (
    "Continue this text from where it stops:\n\n{p}",
    "Write what comes next after this passage:\n\n{p}",
)


def _vocab(v: str):
    return None if v == "sidecar" else v if v == "full" else int(v)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("sidecar")
    ap.add_argument("text")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--depths", default="1,2,3")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--vocabs", default="sidecar", help="comma list of full, sidecar, or N")
    ap.add_argument("--thresholds", default="0", help="comma list of adaptive-depth thresholds (0 = off)")
    ap.add_argument(
        "--lookups", default="default", help="comma list of n-gram lookup drafts per round: default, 0 (off) or N"
    )
    ap.add_argument(
        "--reps", type=int, default=3, help="alternating plain/speculative pairs per prompt and combination"
    )
    ap.add_argument(
        "--chat",
        action="store_true",
        help="chat prompts (--asks) through the chat template; answers stop at end of turn",
    )
    ap.add_argument(
        "--asks", choices=("summary", "continue"), default="summary", help="with --chat: CHAT_ASKS or CONTINUE_ASKS"
    )
    ap.add_argument(
        "--decide", default="on", help="comma list of on (the measured choice of sources) and off (every round drafts)"
    )
    ap.add_argument(
        "--min-chars", type=int, default=300, help="paragraphs (blank-line separated) at least this long become prompts"
    )
    ap.add_argument("--memory", default="fresh", help="fresh (a new memory file), off, or a memory file's path")
    a = ap.parse_args()
    print(json.dumps({"loadavg_start": os.getloadavg(), "memory": a.memory}), flush=True)
    eng = Engine.load(a.model, threads=a.threads, mtp=False if a.sidecar == "none" else a.sidecar)
    scratch = tempfile.TemporaryDirectory()
    if a.memory != "off":
        eng.spec_memory = SpecMemory(Path(scratch.name) / "speculation.json" if a.memory == "fresh" else Path(a.memory))
    paras = [p for p in open(a.text, encoding="utf-8").read().split("\n\n") if len(p) > a.min_chars][: a.prompts]
    asks = CHAT_ASKS if a.asks == "summary" else CONTINUE_ASKS
    # "default": what `cortiq generate` drafts unless told (the sidecar's measured
    # depth and threshold when it has them, else every layer at mtp.DEFAULT_THRESHOLD).
    combos = [
        ("default", "sidecar", None, lk, dc) if d == "default" else (int(d), v, float(t), lk, dc)
        for d in a.depths.split(",")
        for v in (["sidecar"] if d == "default" else a.vocabs.split(","))
        for t in ([None] if d == "default" else a.thresholds.split(","))
        for lk in [None if x == "default" else int(x) for x in a.lookups.split(",")]
        for dc in [x == "on" for x in a.decide.split(",")]
    ]
    rows = []
    ignore_eos = not a.chat
    for n, p in enumerate(paras):
        if a.chat:
            msg = asks[n % len(asks)].format(p=p[:400])
            ids = eng.tokenizer.encode(
                eng.tokenizer.apply_chat_template([{"role": "user", "content": msg}]), add_bos=False
            )
        else:
            ids = eng.tokenizer.encode(p[:400])
        for depth, vocab, th, lookup, decide in combos:
            cfg = (
                SpeculativeConfig(lookup=lookup, decide=decide)
                if depth == "default"
                else SpeculativeConfig(depth=depth, vocab=_vocab(vocab), threshold=th, lookup=lookup, decide=decide)
            )
            plains, specs = [], []
            for r in range(a.reps):
                for speculative in (False, cfg) if r % 2 == 0 else (cfg, False):
                    res = eng.generate(ids, max_tokens=a.tokens, ignore_eos=ignore_eos, speculative=speculative)
                    (plains if speculative is False else specs).append(res)
            plains.sort(key=lambda g: g.decode_seconds)
            specs.sort(key=lambda g: g.decode_seconds)
            plain, spec = plains[len(plains) // 2], specs[len(specs) // 2]
            same = all(g.token_ids == plain.token_ids and g.text == plain.text for g in plains + specs)
            rows.append(
                dict(
                    depth=depth,
                    vocab=vocab,
                    threshold=th,
                    lookup=lookup,
                    decide=decide,
                    same=same,
                    plain_s=plain.decode_seconds,
                    spec_s=spec.decode_seconds,
                    plain_min_s=plains[0].decode_seconds,
                    spec_min_s=specs[0].decode_seconds,
                    plain_tok_s=plain.decode_tok_s,
                    spec_tok_s=spec.decode_tok_s,
                    speculative=spec.extra.get("speculative", {}).get("decision"),
                    mtp=spec.extra["mtp"],
                )
            )
            print(json.dumps(rows[-1]), flush=True)
            rows[-1]["counts"] = spec.acceptance
    for depth, vocab, th, lookup, decide in combos:
        rs = [
            r
            for r in rows
            if (r["depth"], r["vocab"], r["threshold"], r["lookup"], r["decide"]) == (depth, vocab, th, lookup, decide)
        ]
        total = Acceptance(rs[0]["counts"].depth)
        for r in rs:
            total.merge(r.pop("counts"))
        print(
            json.dumps(
                {
                    "depth": depth,
                    "vocab": vocab,
                    "threshold": th,
                    "lookup": lookup,
                    "decide": decide,
                    "all_same": all(r["same"] for r in rs),
                    "speedup": sum(r["plain_s"] for r in rs) / sum(r["spec_s"] for r in rs),
                    "speedup_min": sum(r["plain_min_s"] for r in rs) / sum(r["spec_min_s"] for r in rs),
                    "plain_tok_s": sum(r["plain_tok_s"] for r in rs) / len(rs),
                    "spec_tok_s": sum(r["spec_tok_s"] for r in rs) / len(rs),
                    **{k: v for k, v in total.to_json().items() if k != "depth"},
                }
            )
        )
    print(json.dumps({"loadavg_end": os.getloadavg()}), flush=True)
    scratch.cleanup()


if __name__ == "__main__":
    main()
