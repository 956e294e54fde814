"""An HF checkpoint as the converter sees it: config, tokenizer files, and a lazy
name -> tensor map over one or many safetensors shards.

``Checkpoint`` is what the converter reads of any source; ``HFCheckpoint`` (a folder
or a hub repo id) and ``formats.gguf_import.GgufCheckpoint`` (a .gguf file, nothing
written to disk) provide it.

SRC may be a local folder or a hub repo id; a hub id goes through
huggingface_hub, which offline fails with a clear message.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Protocol

import numpy as np

from formats.errors import CortiqError
from formats.untrusted_json import read_object, read_text
from formats.quants import bf16_to_f32
from formats.safetensors_reader import SafetensorsFile

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "generation_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
)


class Checkpoint(Protocol):
    """A source of named tensors plus the HF files the converter reads (config.json,
    tokenizer.json, tokenizer_config.json, generation_config.json...)."""

    root: Path
    origin: str
    config: dict[str, Any]

    def names(self) -> list[str]: ...
    def shape(self, name: str) -> tuple[int, ...]: ...
    def source_dtype(self, name: str) -> str: ...
    def iter_f32_rows(self, name: str, max_elems: int = 1 << 20) -> Iterator[np.ndarray]: ...
    def tensor(self, name: str) -> np.ndarray: ...
    def sample_f32(self, name: str, count: int = 64) -> np.ndarray: ...
    def release_pages(self) -> None: ...
    def close(self) -> None: ...
    def read_text(self, name: str) -> str | None: ...
    def read_json(self, name: str) -> dict[str, Any] | None: ...


@dataclass
class HFCheckpoint:
    root: Path
    config: dict[str, Any]
    shards: list[Path]
    origin: str = ""  # what the user named: a folder, a hub repo id
    weight_map: dict[str, Path] = field(default_factory=dict)
    _open: dict[Path, SafetensorsFile] = field(default_factory=dict)

    # --------------------------------------------------------------- tensors
    def names(self) -> list[str]:
        return list(self.weight_map)

    def _file(self, path: Path) -> SafetensorsFile:
        if path not in self._open:
            self._open[path] = SafetensorsFile(path)
        return self._open[path]

    def shape(self, name: str) -> tuple[int, ...]:
        return self._file(self.weight_map[name]).entries[name].shape

    def source_dtype(self, name: str) -> str:
        return self._file(self.weight_map[name]).entries[name].dtype

    def tensor(self, name: str) -> np.ndarray:
        if name not in self.weight_map:
            raise CortiqError(f"{self.root}: missing tensor {name}")
        return self._file(self.weight_map[name]).f32(name)

    def iter_f32_rows(self, name: str, max_elems: int = 1 << 20) -> Iterator[np.ndarray]:
        """f32[rows, cols] slices of a tensor, releasing consumed pages (see SafetensorsFile)."""
        if name not in self.weight_map:
            raise CortiqError(f"{self.root}: missing tensor {name}")
        return self._file(self.weight_map[name]).iter_f32_rows(name, max_elems)

    def raw(self, name: str) -> np.ndarray:
        """The tensor in its stored dtype (bf16 as uint16), a view into the map."""
        if name not in self.weight_map:
            raise CortiqError(f"{self.root}: missing tensor {name}")
        return self._file(self.weight_map[name]).raw(name)

    def sample_f32(self, name: str, count: int = 64) -> np.ndarray:
        """``count`` evenly spaced elements of a tensor as f32 (a cheap content probe)."""
        flat = self._file(self.weight_map[name]).raw(name).reshape(-1)
        if flat.size == 0:
            return np.zeros(0, np.float32)
        idx = np.linspace(0, flat.size - 1, num=min(count, flat.size)).astype(np.int64)
        vals = flat[idx]  # a copy
        # The kernel maps whole neighbourhoods around each touched page: drop them now.
        self._file(self.weight_map[name]).release(name)
        if self.source_dtype(name) == "BF16":
            return bf16_to_f32(vals)
        return vals.astype(np.float32)

    def release_pages(self) -> None:
        """Unmap the pages scattered reads (sampling, planning) faulted in, so they do
        not count against the conversion's memory."""
        for f in self._open.values():
            f.release_all()

    def close(self) -> None:
        for f in self._open.values():
            f.close()
        self._open.clear()

    # --------------------------------------------------------------- files
    def read_text(self, name: str) -> str | None:
        p = self.root / name
        return read_text(p) if p.is_file() else None

    def read_json(self, name: str) -> dict[str, Any] | None:
        """A JSON object file of the checkpoint (untrusted: bounded, one-line errors)."""
        p = self.root / name
        return read_object(p) if p.is_file() else None


def _resolve_hub(repo_id: str) -> Path:
    try:
        from huggingface_hub import snapshot_download
    except ImportError:  # pragma: no cover - a declared dependency
        raise CortiqError("huggingface_hub is not installed; pass a local checkpoint folder") from None
    try:
        return Path(snapshot_download(repo_id, allow_patterns=["*.json", "*.safetensors", "*.jinja", "tokenizer*"]))
    except Exception as e:  # network errors, missing repos, offline mode: one line for the user
        kind = type(e).__name__
        if kind in ("LocalEntryNotFoundError", "OfflineModeIsEnabled") or "connect" in str(e).lower():
            reason = "the Hugging Face hub is unreachable (offline?) and it is not in the local cache"
        elif kind in ("RepositoryNotFoundError", "GatedRepoError", "RevisionNotFoundError"):
            reason = f"the hub refused it ({kind})"
        else:
            lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
            reason = f"{kind}: {lines[0] if lines else 'no details'}"
        raise CortiqError(
            f"{repo_id!r} is not a local folder and could not be fetched from the hub: {reason}"
        ) from None


def looks_like_repo_id(src: str) -> bool:
    parts = src.split("/")
    return len(parts) == 2 and all(parts) and not src.startswith((".", "/", "~")) and not os.path.exists(src)


def open_checkpoint(src: str | os.PathLike) -> HFCheckpoint:
    origin = str(src)
    root = Path(src)
    if not root.exists():
        if looks_like_repo_id(str(src)):
            root = _resolve_hub(str(src))
        else:
            raise CortiqError(f"{src}: no such checkpoint folder")
    if not root.is_dir():
        raise CortiqError(
            f"{src}: not a checkpoint folder (expected a folder with config.json, a hub repo id, or a .gguf file)"
        )
    cfg_path = root / "config.json"
    if not cfg_path.is_file():
        raise CortiqError(f"{root}: missing config.json")
    config = read_object(cfg_path)
    # Multimodal wrappers (Qwen3.5, some MoE releases) nest the LM config.
    if "text_config" in config and "hidden_size" not in config:
        if not isinstance(config["text_config"], dict):
            raise CortiqError(f"{cfg_path}: text_config is not a JSON object")
        config = {**config["text_config"], "_wrapper_model_type": config.get("model_type")}
    index = root / "model.safetensors.index.json"
    weight_map: dict[str, Path] = {}
    if index.is_file():
        idx = read_object(index).get("weight_map")
        if not isinstance(idx, dict):
            raise CortiqError(f"{index}: invalid index (no weight_map object)")
        for name, shard in idx.items():
            if not isinstance(shard, str) or Path(shard).name != shard:
                raise CortiqError(f"{index}: shard {str(shard)[:80]!r} for {name} is not a file name in the folder")
            p = root / shard
            if not p.is_file():
                raise CortiqError(f"{root}: shard {shard} named in the index is missing")
            weight_map[name] = p
        shards = sorted(set(weight_map.values()))
    else:
        shards = sorted(root.glob("*.safetensors"))
    if not shards:
        raise CortiqError(f"{root}: no *.safetensors weights")
    ck = HFCheckpoint(root=root, config=config, shards=shards, origin=origin)
    if not weight_map:
        for s in shards:
            for name in ck._file(s).entries:
                if name in weight_map:
                    ck.close()
                    raise CortiqError(f"{root}: tensor {name} is in both {weight_map[name].name} and {s.name}")
                weight_map[name] = s
    else:
        for name, s in weight_map.items():
            if name not in ck._file(s).entries:
                ck.close()
                raise CortiqError(f"{root}: the index puts {name} in {s.name}, which does not hold it")
    ck.weight_map = weight_map
    return ck
