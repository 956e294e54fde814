"""An HF checkpoint as the converter sees it: config, tokenizer files, and a lazy
name -> tensor map over one or many safetensors shards.

SRC may be a local folder or a hub repo id; a hub id goes through
huggingface_hub, which offline fails with a clear message.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from formats.errors import CortiqError
from formats.safetensors_reader import SafetensorsFile

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "special_tokens_map.json", "chat_template.jinja")


@dataclass
class HFCheckpoint:
    root: Path
    config: dict[str, Any]
    shards: list[Path]
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

    def close(self) -> None:
        for f in self._open.values():
            f.close()
        self._open.clear()

    # --------------------------------------------------------------- files
    def read_text(self, name: str) -> str | None:
        p = self.root / name
        return p.read_text(encoding="utf-8") if p.is_file() else None

    def read_json(self, name: str) -> dict[str, Any] | None:
        t = self.read_text(name)
        if t is None:
            return None
        try:
            return json.loads(t)
        except json.JSONDecodeError as e:
            raise CortiqError(f"{self.root / name}: invalid JSON ({e})") from None


def _resolve_hub(repo_id: str) -> Path:
    try:
        from huggingface_hub import snapshot_download
    except ImportError:  # pragma: no cover - a declared dependency
        raise CortiqError("huggingface_hub is not installed; pass a local checkpoint folder") from None
    try:
        return Path(
            snapshot_download(repo_id, allow_patterns=["*.json", "*.safetensors", "*.jinja", "tokenizer*"])
        )
    except Exception as e:  # network errors, missing repos, offline mode: one line for the user
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CortiqError(
            f"{repo_id!r} is not a local folder and could not be fetched from the hub ({type(e).__name__}: {msg})"
        ) from None


def looks_like_repo_id(src: str) -> bool:
    parts = src.split("/")
    return len(parts) == 2 and all(parts) and not src.startswith((".", "/", "~")) and not os.path.exists(src)


def open_checkpoint(src: str | os.PathLike) -> HFCheckpoint:
    root = Path(src)
    if not root.exists():
        if looks_like_repo_id(str(src)):
            root = _resolve_hub(str(src))
        else:
            raise CortiqError(f"{src}: no such checkpoint folder")
    if not root.is_dir():
        raise CortiqError(f"{src}: not a checkpoint folder")
    cfg_path = root / "config.json"
    if not cfg_path.is_file():
        raise CortiqError(f"{root}: missing config.json")
    try:
        config = json.loads(cfg_path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise CortiqError(f"{cfg_path}: invalid JSON ({e})") from None
    # Multimodal wrappers (Qwen3.5, some MoE releases) nest the LM config.
    if "text_config" in config and "hidden_size" not in config:
        config = {**config["text_config"], "_wrapper_model_type": config.get("model_type")}
    index = root / "model.safetensors.index.json"
    weight_map: dict[str, Path] = {}
    if index.is_file():
        try:
            idx = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise CortiqError(f"{index}: invalid index ({e})") from None
        for name, shard in idx.items():
            p = root / shard
            if not p.is_file():
                raise CortiqError(f"{root}: shard {shard} named in the index is missing")
            weight_map[name] = p
        shards = sorted(set(weight_map.values()))
    else:
        shards = sorted(root.glob("*.safetensors"))
    if not shards:
        raise CortiqError(f"{root}: no *.safetensors weights")
    ck = HFCheckpoint(root=root, config=config, shards=shards)
    if not weight_map:
        for s in shards:
            for name in ck._file(s).entries:
                weight_map[name] = s
    ck.weight_map = weight_map
    return ck
