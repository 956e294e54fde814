"""Text sources: files, table columns, offline data sets, and their one-line errors."""

from __future__ import annotations

import json

import pytest

from evals.text_source import BUNDLED_TEXT, DOC_SEPARATOR, TextSpec, load_text
from formats.errors import CortiqError

DOCS = ["The first record.", "Second, with ünïcödé.", "Third line\nspans two lines."]
JOINED = DOC_SEPARATOR.join(DOCS)


def test_bundled_text_is_english_and_small():
    t = load_text(TextSpec())
    assert t.text.startswith("\n") and "Alice was beginning to get very tired" in t.text
    assert 100_000 < t.n_bytes < 500_000
    assert BUNDLED_TEXT.stat().st_size == t.n_bytes  # ASCII, LF line endings
    assert "\r" not in t.text


def test_plain_file(tmp_path):
    p = tmp_path / "a.txt"
    p.write_text("héllo world\n", encoding="utf-8")
    t = load_text(TextSpec(path=str(p)))
    assert t.text == "héllo world\n" and t.n_bytes == 13 and t.documents == 1


def test_jsonl_json_csv_tsv_parquet(tmp_path):
    rows = [{"id": i, "body": d} for i, d in enumerate(DOCS)]
    (tmp_path / "a.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n", encoding="utf-8")
    (tmp_path / "a.json").write_text(json.dumps(rows), encoding="utf-8")
    import csv

    for name, delim in (("a.csv", ","), ("a.tsv", "\t")):
        with open(tmp_path / name, "w", newline="", encoding="utf-8") as f:
            w = csv.DictWriter(f, fieldnames=["id", "body"], delimiter=delim)
            w.writeheader()
            w.writerows(rows)
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"id": [r["id"] for r in rows], "body": DOCS}), tmp_path / "a.parquet")
    for name in ("a.jsonl", "a.json", "a.csv", "a.tsv", "a.parquet"):
        t = load_text(TextSpec(path=str(tmp_path / name), column="body"))
        assert t.text == JOINED, name
        assert t.documents == 3
        with pytest.raises(CortiqError, match=r"no column 'text' \(available: id, body\)"):
            load_text(TextSpec(path=str(tmp_path / name)))


def test_datasets_offline(tmp_path):
    import datasets

    ds = datasets.Dataset.from_dict({"text": DOCS, "n": [1, 2, 3]})
    ds.save_to_disk(str(tmp_path / "single"))
    assert load_text(TextSpec(dataset=str(tmp_path / "single"))).text == JOINED
    datasets.DatasetDict({"train": ds, "test": ds.select([0])}).save_to_disk(str(tmp_path / "dict"))
    assert load_text(TextSpec(dataset=str(tmp_path / "dict"), split="test")).text == DOCS[0]
    with pytest.raises(CortiqError, match="has splits train, test; pick one with --split"):
        load_text(TextSpec(dataset=str(tmp_path / "dict")))
    with pytest.raises(CortiqError, match="no split 'validation'"):
        load_text(TextSpec(dataset=str(tmp_path / "dict"), split="validation"))
    with pytest.raises(CortiqError, match="no column 'body'"):
        load_text(TextSpec(dataset=str(tmp_path / "single"), column="body"))

    files = tmp_path / "d.jsonl"
    files.write_text("\n".join(json.dumps({"content": d}) for d in DOCS), encoding="utf-8")
    t = load_text(TextSpec(dataset="json", data_files=(str(files),), column="content"))
    assert t.text == JOINED and t.source.startswith("json")
    pq_file = tmp_path / "d.parquet"
    ds.to_parquet(str(pq_file))
    assert load_text(TextSpec(dataset="parquet", data_files=(str(pq_file),), split="train")).text == JOINED


@pytest.mark.parametrize(
    "spec,msg",
    [
        (TextSpec(path="/nonexistent/x.txt"), "no such file"),
        (TextSpec(path="x.txt", dataset="y"), "not both"),
        (TextSpec(data_files=("a.json",)), "--data-files needs --dataset"),
        (TextSpec(dataset="json", data_files=("/nonexistent/a.json",)), "no such file"),
        (TextSpec(dataset="wikitext", data_files=("a.json",)), "--data-files works with"),
    ],
)
def test_errors(spec, msg):
    with pytest.raises(CortiqError, match=msg):
        load_text(spec)


def test_file_errors(tmp_path):
    (tmp_path / "e.txt").write_text("   \n")
    with pytest.raises(CortiqError, match="empty"):
        load_text(TextSpec(path=str(tmp_path / "e.txt")))
    (tmp_path / "b.txt").write_bytes(b"ok \xff\xfe")
    with pytest.raises(CortiqError, match="not UTF-8"):
        load_text(TextSpec(path=str(tmp_path / "b.txt")))
    (tmp_path / "c.txt").write_text("plain")
    with pytest.raises(CortiqError, match="--column applies"):
        load_text(TextSpec(path=str(tmp_path / "c.txt"), column="text"))
    (tmp_path / "d.jsonl").write_text('{"text": "a"}\n{oops\n')
    with pytest.raises(CortiqError, match=r"d.jsonl:2: not valid JSON"):
        load_text(TextSpec(path=str(tmp_path / "d.jsonl")))
    (tmp_path / "n.jsonl").write_text('{"text": 3}\n')
    with pytest.raises(CortiqError, match="not text"):
        load_text(TextSpec(path=str(tmp_path / "n.jsonl")))
    (tmp_path / "x.parquet").write_bytes(b"not parquet")
    with pytest.raises(CortiqError, match="not a Parquet file"):
        load_text(TextSpec(path=str(tmp_path / "x.parquet")))


@pytest.mark.parametrize(
    "name,first,size",
    [
        ("hamlet", "HAMLET, PRINCE OF DENMARK", 173942),
        ("sonnets", "THE SONNETS", 95728),
        ("alice", "ALICE'S ADVENTURES IN WONDERLAND", 148481),
    ],
)
def test_bundled_corpora_by_name(name, first, size):
    import hashlib

    from evals.text_source import BUNDLED_CORPORA

    for spec in (TextSpec(path=name), TextSpec(dataset=name)):
        t = load_text(spec)
        assert t.text.lstrip().startswith(first) and t.n_bytes == size
        assert t.text.isascii() and "\r" not in t.text and "gutenberg" not in t.text.lower()
        assert name in t.source
    # The README's sha256 of each file (provenance).
    readme = (BUNDLED_CORPORA[name][0].parent / "README.md").read_text()
    assert hashlib.sha256(BUNDLED_CORPORA[name][0].read_bytes()).hexdigest() in readme


def test_unknown_name_lists_bundled_texts():
    with pytest.raises(CortiqError, match="bundled texts by name: alice, hamlet, sonnets"):
        load_text(TextSpec(path="macbeth"))


def test_sources_are_read_in_pieces_and_again_on_demand(tmp_path):
    import datasets

    ds = datasets.Dataset.from_dict({"text": DOCS * 700})
    ds.save_to_disk(str(tmp_path / "many"))
    t = load_text(TextSpec(dataset=str(tmp_path / "many")))
    docs = [list(d) for d in t.read()]
    assert len(docs) == t.documents == 2100 and all(len(d) == 1 for d in docs)  # record by record
    assert t.text == DOC_SEPARATOR.join(DOCS * 700)
    import hashlib

    assert t.sha256 == hashlib.sha256(t.text.encode()).hexdigest() and t.n_bytes == len(t.text.encode())
    big = tmp_path / "big.txt"
    big.write_text("a line of text\n" * 100_000, encoding="utf-8")
    pieces = list(load_text(TextSpec(path=str(big))).pieces())
    assert len(pieces) > 4 and max(map(len, pieces)) < 300_000 and "".join(pieces) == big.read_text()
