"""``cortiq mtp-vocab``: give an existing MTP sidecar a draft vocabulary (no retraining)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from cortiq_cli import text_options as opt
from cortiq_cli.options import option_groups
from cortiq_cli.common import console, handle_errors, print_json
from cortiq_cli.mtp_options import Backbone
from formats.errors import CortiqError


@handle_errors
@option_groups
def mtp_vocab(
    model: Backbone,
    text_opts: opt.BoundedTextArgs = opt.BoundedTextArgs(),
    size: Annotated[
        Optional[int],
        typer.Option(
            "--size", min=0, help="Ids in the draft vocabulary; 0 removes it (drafts score the full vocabulary)."
        ),
    ] = 8192,
    mtp: Annotated[
        Optional[Path], typer.Option("--mtp", help="The sidecar to read (default: MODEL.mtp.cmf beside the model).")
    ] = None,
    out: Annotated[
        Optional[Path], typer.Option("--out", "-o", help="Sidecar to write (default: rewrite the one read, in place).")
    ] = None,
    force: Annotated[bool, typer.Option("--force", help="Overwrite an existing --out file.")] = False,
    json_out: opt.Json = False,
) -> None:
    """Choose the N token ids the draft head scores (the text's most frequent target tokens,
    plus the EOS and special ids) and write them into the sidecar; its draft layers are
    copied byte for byte."""
    from cortiq_engine import Engine
    from cortiq_engine.draft_vocab import vocab_from_text
    from formats.sidecar import copy_with_draft_vocab, draft_vocab_record, open_sidecar, sidecar_path

    eng = Engine.load(model, threads=1, warmup=False)
    side = open_sidecar(eng.path, eng.header, mtp)  # validated against this backbone
    if side is None:
        raise CortiqError(f"{model}: no sidecar {sidecar_path(model)} beside it; give --mtp PATH")
    src = side.path
    side.close()
    target = out if out is not None else src
    ids, record, tokens, source = None, None, 0, None
    if size:
        if eng.tokenizer is None:
            raise CortiqError(f"{model}: no embedded tokenizer to read the text with")
        loaded = text_opts.load()
        ids, tokens = vocab_from_text(
            eng.tokenizer, eng.vocab_size, eng.eos_ids, loaded.text, size, text_opts.max_tokens
        )
        source = loaded.source
        record = draft_vocab_record(ids, source, tokens)
    copy_with_draft_vocab(src, target, ids, record, force=force or out is None)
    doc = {
        "sidecar": str(target),
        "draft_vocab": int(len(ids)) if ids is not None else None,
        "text": source,
        "tokens": tokens,
        "vocab_size": eng.vocab_size,
    }
    if json_out:
        print_json(doc)
        return
    what = (
        f"a draft vocabulary of {len(ids)} ids (from {tokens} tokens of {source})"
        if ids is not None
        else "no draft vocabulary"
    )
    console.print(f"wrote [bold]{target}[/]: {what}", highlight=False)
