"""A seeded mutator of CMF files and sidecars, and the CLI runs that judge the result.

Used by ``tests/test_fuzz.py`` (in-process, a few hundred cases; thousands with
``-m slow``) and ``benchmarks/fuzz_cli.py`` (a fresh corpus through the real CLI).

Every case is one file of a tiny model (``base_files``: q8, q4 and f32 conversions of
a Llama trunk with one MTP layer in a sidecar) changed one way. A mutation is
either *unsealed* (an accident or an attacker that does not recompute the header
checksum: byte flips, truncation, raw header/directory edits) or *resealed* (the
checksum recomputed, so the header and directory checks behind it are reached).

What must hold, per run:
- no traceback (an exception other than a clean exit) and no crash (a signal);
- ``verify`` never exits 0 on a file changed without resealing (every byte of a CMF
  file is covered by a checksum);
- no command exits 0 on a file whose header or directory changed without resealing;
- a resealed file is a valid file an attacker may have written: it may pass, but
  only with shapes the kernels agree with (else no crash would hold).
"""

from __future__ import annotations

import functools
import json
import math
import random
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from tests.cmf_edit import reseal

_FMT = "<8sHHIQQQQQQ"
COMMANDS = ("inspect", "verify", "generate", "ppl")
# A tiny text for ppl (the tiny models have a byte tokenizer: one token per byte).
PPL_TEXT = "The quick brown fox jumps over the lazy dog. " * 3


# ------------------------------------------------------------------ base files

@dataclass(frozen=True)
class Base:
    name: str  # q8 | q4 | f32
    main: bytes
    sidecar: bytes


def build_base(folder: Path) -> list[Base]:
    """Convert one tiny checkpoint (Llama trunk + one MTP layer) to q8, q4 and f32 CMF files."""
    from cortiq_engine.convert import convert_checkpoint
    from tests.mtp_tiny import save_tiny_mtp

    from formats.cmf import CmfFile, rewrite_header

    src = save_tiny_mtp("deepseek", folder / "src", n_layers=1)
    out = []
    for quant in ("q8", "q4", "f32"):
        path = folder / f"base-{quant}.cmf"
        convert_checkpoint(src, path, quant=quant)
        side = path.with_name(f"base-{quant}.mtp.cmf")
        for p in (path, side):  # the same bytes wherever the folder is, so a seed names one corpus
            with CmfFile(p) as f:
                h = f.header
            h["source"]["path"] = "fuzz-base"
            rewrite_header(p, h)
        out.append(Base(quant, path.read_bytes(), side.read_bytes()))
    return out


# ------------------------------------------------------------------ layout

@dataclass(frozen=True)
class Layout:
    hoff: int
    hlen: int
    doff: int
    diroff: int
    dirlen: int

    @classmethod
    def of(cls, data: bytes) -> "Layout":
        _, _, _, _, hoff, hlen, doff, diroff, dirlen, _ = struct.unpack(_FMT, data[:64])
        return cls(hoff, hlen, doff, diroff, dirlen)

    def is_header(self, i: int) -> bool:
        """Byte i is in the preamble, the header JSON or the directory JSON."""
        return i < 64 or self.hoff <= i < self.hoff + self.hlen or self.diroff <= i < self.diroff + self.dirlen


def _rebuild(data: bytes, header: bytes, entries_json: bytes | None = None, seal: bool = True) -> bytes:
    """A file with ``header`` (any bytes) and optionally a new directory, data shifted to
    keep 64-byte alignment, as a writer would lay it out."""
    lay = Layout.of(data)
    entries = json.loads(data[lay.diroff : lay.diroff + lay.dirlen])
    new_doff = max(lay.doff, -(-(64 + len(header) + 64) // 64) * 64)
    shift = new_doff - lay.doff
    if entries_json is None:
        for e in entries:
            e["offset"] += shift
        entries_json = json.dumps(entries).encode()
    blob = data[lay.doff : lay.diroff]
    pre = list(struct.unpack(_FMT, data[:64]))
    pre[5], pre[6], pre[7], pre[8] = len(header), new_doff, new_doff + len(blob), len(entries_json)
    out = bytearray(struct.pack(_FMT, *pre) + header + b" " * (new_doff - 64 - len(header)) + blob + entries_json)
    return bytes(reseal(out)) if seal else bytes(out)


# ------------------------------------------------------------------ mutations

@dataclass
class Case:
    id: str
    kind: str  # mutation family
    base: str  # q8 | q4 | f32
    target: str  # "main" or "sidecar": which file was changed
    main: bytes
    sidecar: bytes | None
    changed: bool  # the file's bytes differ from the original
    unsealed_header: bool  # header/directory/preamble changed without a new checksum
    sealed: bool  # a checksum was recomputed after the change
    note: str = ""


def hostile_values(rng: random.Random) -> Any:
    """A JSON value of a wrong type or out of range for about any field."""
    pool: list[Callable[[], Any]] = [
        lambda: None, lambda: True, lambda: False, lambda: 0, lambda: -1, lambda: 1, lambda: 3, lambda: 7,
        lambda: 2**31, lambda: 2**63, lambda: 10**30, lambda: -(10**30), lambda: 1.5, lambda: -0.0, lambda: 1e308,
        lambda: 1e-300, lambda: "", lambda: "x", lambda: "0", lambda: "silu", lambda: "/etc/passwd", lambda: "../x",
        lambda: [], lambda: [1], lambda: [-1, 2**40], lambda: ["full"] * 3, lambda: {}, lambda: {"a": 1},
        lambda: {"rope_type": "llama3", "factor": 0}, lambda: _nested(rng.choice([10, 70, 200])),
        lambda: rng.randint(-(2**20), 2**20), lambda: rng.random() * 10 ** rng.randint(-5, 30),
    ]
    return rng.choice(pool)()


def _nested(depth: int) -> Any:
    v: Any = 0
    for i in range(depth):
        v = [v] if i % 2 else {"a": v}
    return v


def key_paths(obj: Any, prefix: tuple = ()) -> list[tuple]:
    """Every key path into dicts (and short lists) of a header, the header itself included."""
    out = [prefix]
    if isinstance(obj, dict):
        for k, v in obj.items():
            out += key_paths(v, prefix + (k,))
    elif isinstance(obj, list) and len(obj) <= 8:
        for i, v in enumerate(obj):
            out += key_paths(v, prefix + (i,))
    return out


def _set(obj: Any, path: tuple, value: Any) -> Any:
    if not path:
        return value
    obj[path[0]] = _set(obj[path[0]], path[1:], value)
    return obj


def _delete(obj: Any, path: tuple) -> None:
    parent = obj
    for k in path[:-1]:
        parent = parent[k]
    del parent[path[-1]]


def _flip(rng: random.Random, data: bytes) -> tuple[bytes, bool]:
    lay = Layout.of(data)
    n = rng.choice([1, 1, 2, 4, 16])
    region = rng.choice(["any", "any", "header", "data"])
    if region == "header":
        pool = list(range(64)) + list(range(lay.hoff, lay.hoff + lay.hlen)) + list(range(lay.diroff, lay.diroff + lay.dirlen))
    elif region == "data":
        pool = range(lay.doff, lay.diroff)
    else:
        pool = range(len(data))
    pos = rng.sample(list(pool), min(n, len(pool)))
    out = bytearray(data)
    for p in pos:
        out[p] ^= rng.randint(1, 255)
    return bytes(out), any(lay.is_header(p) for p in pos)


def _edit_header(rng: random.Random, data: bytes, seal: bool, arch_only: bool = False) -> tuple[bytes, str]:
    lay = Layout.of(data)
    header = json.loads(data[lay.hoff : lay.hoff + lay.hlen])
    paths = [p for p in key_paths(header) if p and (not arch_only or p[0] == "arch")]
    path = rng.choice(paths)
    if rng.random() < 0.15 and len(path) >= 1:
        _delete(header, path)
        note = f"delete {'.'.join(map(str, path))}"
    else:
        value = hostile_values(rng)
        header = _set(header, path, value)
        note = f"{'.'.join(map(str, path))}={json.dumps(value)[:40]}"
    return _rebuild(data, json.dumps(header).encode(), seal=seal), note


def _edit_directory(rng: random.Random, data: bytes, seal: bool) -> tuple[bytes, str]:
    lay = Layout.of(data)
    entries = json.loads(data[lay.diroff : lay.diroff + lay.dirlen])
    e = rng.choice(entries)
    how = rng.choice(["field", "field", "swap", "drop", "dup", "shape"])
    if how == "field":
        key = rng.choice(["name", "dtype", "shape", "offset", "nbytes", "crc32"])
        e[key] = hostile_values(rng) if rng.random() < 0.7 else rng.choice(["f16", "bf16", "q8", "q4", "u8", "f32"]) if key == "dtype" else hostile_values(rng)
        note = f"dir {e.get('name')!s:.30}.{key}"
    elif how == "swap":  # swap two tensors' names (same data, wrong places)
        a, b = rng.sample(entries, 2)
        a["name"], b["name"] = b["name"], a["name"]
        note = "swap names"
    elif how == "drop":
        entries.remove(e)
        note = f"drop {e['name']}"
    elif how == "dup":
        entries.append(dict(e))
        note = f"dup {e['name']}"
    else:
        note = _shape_edit(rng, e)
    return _rebuild(data, data[lay.hoff : lay.hoff + lay.hlen], json.dumps(entries).encode(), seal=seal), note


def _shape_edit(rng: random.Random, e: dict[str, Any]) -> str:
    """A new shape for one entry, often with the same element count (so its byte count holds)."""
    shape = list(e["shape"])
    n = math.prod(shape) if shape else 1
    choice = rng.choice(["transpose", "refactor", "flatten", "overflow", "grow"])
    if choice == "transpose" and len(shape) >= 2:
        shape = shape[::-1]
    elif choice == "refactor" and len(shape) >= 2:
        f = rng.choice([2, 4, 8, 32])
        if shape[0] % f == 0:
            shape = [shape[0] // f, shape[1] * f] + shape[2:]
    elif choice == "flatten":
        shape = [n]
    elif choice == "overflow":  # element count wraps a 64-bit product back to the real one
        shape = shape + [2**64 // max(n, 1) + 1] if rng.random() < 0.5 else [2**32, 2**32, n]
    else:
        shape = [s + rng.choice([1, 32, 1000]) for s in shape]
    e["shape"] = shape
    return f"shape {e['name']} -> {shape}"[:80]


def _bomb(rng: random.Random, data: bytes) -> tuple[bytes, str]:
    kind = rng.choice(["deep-list", "deep-dict", "bigint", "infinity", "nan", "bigstring", "manykeys", "notjson", "notutf8"])
    if kind == "deep-list":
        d = rng.choice([100, 1000, 100000])
        hj = b'{"arch": ' + b"[" * d + b"]" * d + b"}"
    elif kind == "deep-dict":
        d = rng.choice([100, 1000, 50000])
        hj = b'{"a":' * d + b"1" + b"}" * d
    elif kind == "bigint":
        hj = b'{"arch": {"num_layers": 1' + b"7" * rng.choice([30, 5000]) + b"}}"
    elif kind == "infinity":
        hj = b'{"calibration": {"temperature": Infinity}, "x": 1e999}'
    elif kind == "nan":
        hj = b'{"calibration": {"temperature": NaN}}'
    elif kind == "bigstring":
        hj = b'{"notes": "' + b"x" * rng.choice([10**5, 2 * 10**6]) + b'"}'
    elif kind == "manykeys":
        hj = json.dumps({f"k{i}": i for i in range(rng.choice([1000, 50000]))}).encode()
    elif kind == "notjson":
        hj = b'{"arch": {'
    else:
        hj = b'{"role": "\xff\xfe"}'
    return _rebuild(data, hj, seal=True), kind


def _foreign(rng: random.Random, data: bytes) -> tuple[bytes, str]:
    kind = rng.choice(["empty", "random", "gguf", "safetensors", "magic-only", "zeros"])
    if kind == "empty":
        return b"", kind
    if kind == "random":
        return rng.randbytes(rng.choice([10, 64, 1000, 100000])), kind
    if kind == "gguf":
        return b"GGUF" + struct.pack("<IQQ", 3, 0, 0) + rng.randbytes(100), kind
    if kind == "safetensors":
        h = b'{"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}'
        return struct.pack("<Q", len(h)) + h + bytes(8), kind
    if kind == "magic-only":
        return b"CORTIQMF" + rng.randbytes(56), kind
    return bytes(len(data)), kind


def _arch_geometry(rng: random.Random, data: bytes) -> tuple[bytes, str]:
    """Resealed arch edits aimed at the kernels' assumptions (the issue's SIGSEGV cases)."""
    lay = Layout.of(data)
    header = json.loads(data[lay.hoff : lay.hoff + lay.hlen])
    a = header["arch"]
    hd = a["head_dim"]
    edits = [
        ("rotary_dim", rng.choice([hd + 2, hd * 2, hd * 8, 2**31, -2, hd - 1])),
        ("head_dim", rng.choice([hd // 2, hd * 2, 0, 1, 2**40])),
        ("num_heads", rng.choice([0, 1, a["num_heads"] * 2, 3, -4, 2**40])),
        ("num_kv_heads", rng.choice([0, 3, a["num_heads"] * 2, -1])),
        ("hidden_size", rng.choice([32, 128, 0, 2**40])),
        ("vocab_size", rng.choice([1, 255, 257, 2**40])),
        ("num_layers", rng.choice([0, 1, 3, 10**6])),
        ("intermediate_size", rng.choice([64, 256, 0])),
        ("rope_theta", rng.choice([0, -1, 1e-300, 1e308, "x"])),
        ("norm_eps", rng.choice([0, -1, 1e308])),
        ("sliding_window", rng.choice([-1, 0, 1, 2**40])),
        ("layer_types", rng.choice([["sliding"] * a["num_layers"], ["linear"] * a["num_layers"], ["full"], []])),
        ("max_position_embeddings", rng.choice([0, 1, 2, 2**40])),
        ("rope_scaling", rng.choice([{"rope_type": "linear", "factor": 0}, {"rope_type": "llama3", "factor": 8, "low_freq_factor": 1, "high_freq_factor": 1}, {"rope_type": "yarn"}])),
        ("tie_word_embeddings", rng.choice([True, "yes", 1])),
        ("v_head_dim", rng.choice([hd // 2, hd * 2, 0])),
        ("moe", {"num_experts": 4, "top_k": 9, "expert_intermediate_size": 8, "moe_layers": [0, 5]}),
        ("mtp", {"num_layers": 5, "style": "deepseek"}),
    ]
    done = {}
    for _ in range(rng.choice([1, 1, 2])):
        k, v = rng.choice(edits)
        a[k] = done[k] = v
    note = json.dumps(done)[:100]
    return _rebuild(data, json.dumps(header).encode(), seal=True), note


MUTATORS = ("flip", "truncate", "header", "header-sealed", "arch-sealed", "geometry", "directory", "directory-sealed",
            "bomb", "foreign")


def make_case(rng: random.Random, bases: list[Base], index: int) -> Case:
    base = rng.choice(bases)
    target = "sidecar" if rng.random() < 0.2 else "main"
    orig = base.sidecar if target == "sidecar" else base.main
    kind = rng.choice(MUTATORS)
    unsealed_header = sealed = False
    note = ""
    if kind == "flip":
        data, unsealed_header = _flip(rng, orig)
    elif kind == "truncate":
        data = orig[: rng.randrange(0, len(orig))]
        unsealed_header = True  # the directory, at the end, is cut
    elif kind in ("header", "header-sealed", "arch-sealed"):
        sealed = kind != "header"
        data, note = _edit_header(rng, orig, seal=sealed, arch_only=kind == "arch-sealed")
        unsealed_header = not sealed
    elif kind == "geometry":
        sealed = True
        data, note = _arch_geometry(rng, orig)
    elif kind in ("directory", "directory-sealed"):
        sealed = kind == "directory-sealed"
        data, note = _edit_directory(rng, orig, seal=sealed)
        unsealed_header = not sealed
    elif kind == "bomb":
        sealed = True
        data, note = _bomb(rng, orig)
    else:
        data, note = _foreign(rng, orig)
        unsealed_header = True  # not a CMF file at all
    changed = data != orig
    if not changed:
        unsealed_header = False
    main, side = (base.main, data) if target == "sidecar" else (data, base.sidecar)
    return Case(f"{index:05d}-{kind}-{base.name}-{target}", kind, base.name, target, main, side, changed, unsealed_header, sealed, note)


def corpus(seed: int, n: int, bases: list[Base]) -> list[Case]:
    rng = random.Random(seed)
    return [make_case(rng, bases, i) for i in range(n)]


# ------------------------------------------------------------------ judging

@dataclass
class Outcome:
    command: str
    status: str  # ok | clean | traceback | crash | hang
    detail: str = ""


def write_case(case: Case, folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for p in folder.iterdir():
        p.unlink()
    main = folder / "m.cmf"
    main.write_bytes(case.main)
    if case.sidecar is not None:
        (folder / "m.mtp.cmf").write_bytes(case.sidecar)
    (folder / "text.txt").write_text(PPL_TEXT)
    return main


def command_args(command: str, main: Path) -> list[str]:
    if command == "generate":
        return ["generate", str(main), "hello", "-n", "4", "--json", "--threads", "1"]
    if command == "ppl":
        return ["ppl", str(main), "--text", str(main.with_name("text.txt")), "--ctx", "32", "--json", "--threads", "1"]
    return [command, str(main)]


def violations(case: Case, outcomes: list[Outcome]) -> list[str]:
    """The properties of the module docstring this case's runs break."""
    bad = []
    for o in outcomes:
        if o.status in ("traceback", "crash", "hang"):
            bad.append(f"{case.id} {o.command}: {o.status} {o.detail}")
        if o.status == "ok" and o.command == "verify" and case.changed and not case.sealed:
            bad.append(f"{case.id} verify: exit 0 on a changed file")
        if o.status == "ok" and case.unsealed_header and not (case.target == "sidecar" and o.command == "ppl"):
            # (ppl never opens the sidecar: a changed sidecar is not its input)
            bad.append(f"{case.id} {o.command}: exit 0 on a file whose header/directory changed")
    return bad


@dataclass
class Table:
    rows: dict[str, dict[str, int]] = field(default_factory=dict)

    def add(self, o: Outcome) -> None:
        r = self.rows.setdefault(o.command, {"runs": 0, "ok": 0, "clean": 0, "traceback": 0, "crash": 0, "hang": 0})
        r["runs"] += 1
        r[o.status] += 1

    def markdown(self) -> str:
        lines = ["| command | runs | exit 0 | clean error | traceback | crash (signal) | hang |", "|---|---|---|---|---|---|---|"]
        for c in COMMANDS:
            r = self.rows.get(c)
            if r:
                lines.append(f"| {c} | {r['runs']} | {r['ok']} | {r['clean']} | {r['traceback']} | {r['crash']} | {r['hang']} |")
        return "\n".join(lines)


@functools.lru_cache(maxsize=1)
def _cli() -> Any:
    import typer

    from cortiq_cli.main import app

    return typer.main.get_command(app)


def _invoke(runner: Any, cli: Any, args: list[str]) -> tuple[int, BaseException | None]:
    """The command's exit code, or the exception that escaped it. (typer's CliRunner.invoke
    does the same but rebuilds the click command from the functions on every call.)"""
    with runner.isolation():
        try:
            cli.main(args=args, prog_name="cortiq")
        except SystemExit as e:
            return (e.code if isinstance(e.code, int) else 1), None
        except Exception as e:  # noqa: BLE001 - any escape is what the fuzz counts
            return 1, e
    return 0, None


def run_in_process(case: Case, folder: Path, runner: Any = None) -> list[Outcome]:
    """Run the commands on ``case`` through the CLI app in this process (typer's CliRunner)."""
    from typer.testing import CliRunner

    runner = runner or CliRunner()
    cli = _cli()
    main = write_case(case, folder)
    outcomes = []
    for command in COMMANDS:
        if command in ("generate", "ppl") and not (outcomes[0].status == "ok" or case.target == "sidecar"):
            continue  # the file does not open: generate and ppl stop where inspect did
        code, exc = _invoke(runner, cli, command_args(command, main))
        if exc is not None:
            outcomes.append(Outcome(command, "traceback", f"{type(exc).__name__}: {str(exc)[:120]}"))
        elif code == 0:
            outcomes.append(Outcome(command, "ok"))
        else:
            outcomes.append(Outcome(command, "clean"))
    return outcomes
