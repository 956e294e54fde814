"""A text tokenized shard by shard gives the ids of the whole text, token for token."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from cortiq_engine.tokenizer import Tokenizer
from evals.text_source import DATA_DIR, TextSpec, _file_blocks, load_text
from evals.tokens import encode_sharded, shards, tokenize_for

# Lines and paragraphs of every kind a shard can be cut after: blank runs, CRLF,
# indentation, tabs, digits, punctuation before a break, non-ASCII, a long line.
ODD = (
    "Title\n\n\n\nFirst paragraph, with 12345 digits and ünïcödé;\nits second line.\r\n"
    "  indented line\n\ttabbed line\n\n  \n...\n\nA line ending in spaces   \n"
    + "word " * 400
    + "\nlast line without a newline"
)


def _tokenizer(hf: Path) -> Tokenizer:
    cfg = json.loads((hf / "tokenizer_config.json").read_text())
    vocab = json.loads((hf / "tokenizer.json").read_text())["model"]["vocab"]
    header = {"add_bos_token": bool(cfg.get("add_bos_token")), "bos_token_id": vocab.get(cfg.get("bos_token"))}
    return Tokenizer((hf / "tokenizer.json").read_bytes(), header)


class Counting:
    """A tokenizer that records the length of every text it encodes."""

    def __init__(self, tok: Any):
        self.tok, self.lengths = tok, []

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        self.lengths.append(len(text))
        return self.tok.encode(text, add_bos=add_bos)


class MarksStart:
    """A tokenizer that marks the start of its input (as a SentencePiece prefix space
    does): no cut restarts it, so the text is encoded whole."""

    def __init__(self, tok: Any):
        self.tok = tok

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        return self.tok.encode(" " + text, add_bos=add_bos)


def _corpus() -> str:
    return "".join((DATA_DIR / n).read_text(encoding="utf-8") for n in ("alice.txt", "hamlet.txt", "sonnets.txt"))


@pytest.fixture(scope="module", params=["smollm2", "gemma3"])
def tokenizer(request: pytest.FixtureRequest) -> Tokenizer:
    return _tokenizer(request.getfixturevalue(f"{request.param}_hf"))


@pytest.mark.parametrize("size", [300, 2000, 20_000])
def test_shards_give_the_whole_texts_ids(tokenizer: Tokenizer, size: int) -> None:
    for text in (_corpus()[:120_000], ODD):
        whole = tokenizer.encode(text, add_bos=True)
        counting = Counting(tokenizer)
        # pieces of 61 characters: shard cuts fall inside paragraphs and inside lines' reads
        pieces = [text[i : i + 61] for i in range(0, len(text), 61)]
        ids = encode_sharded(counting, pieces, size=size)
        assert ids.dtype == np.int32
        assert ids.tolist() == whole
        if len(text) > 10 * size:  # it was really encoded in shards
            assert max(counting.lengths) < len(text) / 4


def test_a_file_read_in_blocks_and_shards(tokenizer: Tokenizer, tmp_path: Path) -> None:
    path = tmp_path / "corpus.txt"
    path.write_text(_corpus() + ODD, encoding="utf-8")
    blocks = list(_file_blocks(path, size=4096))
    assert len(blocks) > 50 and all(b.endswith("\n") for b in blocks[:-1])
    whole = tokenizer.encode(path.read_bytes().decode("utf-8"), add_bos=True)  # no newline translation
    assert encode_sharded(tokenizer, blocks, size=8192).tolist() == whole

    class Model:
        vocab_size = tokenizer.vocab_size

    Model.tokenizer = tokenizer
    loaded = load_text(TextSpec(path=str(path)))
    assert tokenize_for([Model()], ["m"], loaded).tolist() == whole


def test_a_limit_gives_the_first_ids_and_reads_no_further(tokenizer: Tokenizer) -> None:
    text = _corpus()
    whole = tokenizer.encode(text, add_bos=True)
    read: list[int] = []

    def pieces():
        for i in range(0, len(text), 1000):
            read.append(i)
            yield text[i : i + 1000]

    assert encode_sharded(tokenizer, pieces(), size=2000, limit=512).tolist() == whole[:512]
    assert read[-1] < len(text) // 10
    assert encode_sharded(tokenizer, [text[:3000]], size=2000, limit=10**9).tolist() == tokenizer.encode(text[:3000])


def test_a_tokenizer_that_marks_its_start_is_encoded_whole(tokenizer: Tokenizer) -> None:
    marked = MarksStart(tokenizer)
    text = _corpus()[:30_000]
    assert encode_sharded(marked, [text], size=500).tolist() == marked.encode(text)


def test_shards_end_after_a_newline_and_join_to_the_text() -> None:
    pieces = ["ab\ncd", "ef", "\n", "g" * 50, "h\n", "tail"]
    got = list(shards(pieces, size=4))
    assert "".join(got) == "".join(pieces)
    assert all(s.endswith("\n") for s in got[:-1])
