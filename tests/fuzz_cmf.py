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
# Commands of the resealed corpus beyond COMMANDS: the model's chat template, a chat session file.
CHAT_COMMANDS = ("chat-template", "chat-load")
ALL_COMMANDS = COMMANDS + CHAT_COMMANDS
STATUSES = ("ok", "clean", "traceback", "crash", "hang", "memory")
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
    session: bytes | None = None  # a chat session file for ``chat --load``
    commands: tuple[str, ...] = ()  # the commands to run (empty: COMMANDS)


def hostile_values(rng: random.Random) -> Any:
    """A JSON value of a wrong type or out of range for about any field."""
    pool: list[Callable[[], Any]] = [
        lambda: None,
        lambda: True,
        lambda: False,
        lambda: 0,
        lambda: -1,
        lambda: 1,
        lambda: 3,
        lambda: 7,
        lambda: 2**31,
        lambda: 2**63,
        lambda: 10**30,
        lambda: -(10**30),
        lambda: 1.5,
        lambda: -0.0,
        lambda: 1e308,
        lambda: 1e-300,
        lambda: "",
        lambda: "x",
        lambda: "0",
        lambda: "silu",
        lambda: "/etc/passwd",
        lambda: "../x",
        lambda: [],
        lambda: [1],
        lambda: [-1, 2**40],
        lambda: ["full"] * 3,
        lambda: {},
        lambda: {"a": 1},
        lambda: {"rope_type": "llama3", "factor": 0},
        lambda: _nested(rng.choice([10, 70, 200])),
        lambda: rng.randint(-(2**20), 2**20),
        lambda: rng.random() * 10 ** rng.randint(-5, 30),
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
        pool = (
            list(range(64))
            + list(range(lay.hoff, lay.hoff + lay.hlen))
            + list(range(lay.diroff, lay.diroff + lay.dirlen))
        )
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
        e[key] = (
            hostile_values(rng)
            if rng.random() < 0.7
            else rng.choice(["f16", "bf16", "q8", "q4", "u8", "f32"])
            if key == "dtype"
            else hostile_values(rng)
        )
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
    kind = rng.choice(
        ["deep-list", "deep-dict", "bigint", "infinity", "nan", "bigstring", "manykeys", "notjson", "notutf8"]
    )
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
    """Resealed arch edits aimed at the kernels' assumptions (the known SIGSEGV cases)."""
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
        (
            "rope_scaling",
            rng.choice(
                [
                    {"rope_type": "linear", "factor": 0},
                    {"rope_type": "llama3", "factor": 8, "low_freq_factor": 1, "high_freq_factor": 1},
                    {"rope_type": "yarn"},
                ]
            ),
        ),
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


MUTATORS = (
    "flip",
    "truncate",
    "header",
    "header-sealed",
    "arch-sealed",
    "geometry",
    "directory",
    "directory-sealed",
    "bomb",
    "foreign",
)


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
    return Case(
        f"{index:05d}-{kind}-{base.name}-{target}",
        kind,
        base.name,
        target,
        main,
        side,
        changed,
        unsealed_header,
        sealed,
        note,
    )


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
    if case.session is not None:
        (folder / "session.json").write_bytes(case.session)
    return main


def command_args(command: str, main: Path) -> list[str]:
    if command == "generate":
        return ["generate", str(main), "hello", "-n", "4", "--json", "--threads", "1"]
    if command == "ppl":
        return ["ppl", str(main), "--text", str(main.with_name("text.txt")), "--ctx", "32", "--json", "--threads", "1"]
    if command == "chat-template":
        return ["generate", str(main), "hello", "--chat", "-n", "2", "--json", "--threads", "1"]
    if command == "chat-load":
        return ["chat", str(main), "--load", str(main.with_name("session.json")), "-n", "2", "--json", "--threads", "1"]
    return [command, str(main)]


def command_input(command: str) -> str | None:
    """What the command reads on stdin (``chat`` takes one turn)."""
    return "hi\n" if command == "chat-load" else None


def case_commands(case: Case) -> tuple[str, ...]:
    return case.commands or COMMANDS


def needs_open(command: str) -> bool:
    """Commands that stop where ``inspect`` did when the main file does not open."""
    return command not in ("inspect", "verify")


def violations(case: Case, outcomes: list[Outcome]) -> list[str]:
    """The properties of the module docstring this case's runs break."""
    bad = []
    for o in outcomes:
        if o.status in ("traceback", "crash", "hang", "memory"):
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
        r = self.rows.setdefault(o.command, {"runs": 0, **{k: 0 for k in STATUSES}})
        r["runs"] += 1
        r[o.status] = r.get(o.status, 0) + 1

    def total(self, status: str) -> int:
        return sum(r.get(status, 0) for r in self.rows.values())

    def markdown(self) -> str:
        lines = [
            "| command | runs | exit 0 | clean error | traceback | crash (signal) | hang | memory |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for c in ALL_COMMANDS:
            r = self.rows.get(c)
            if r:
                lines.append(
                    f"| {c} | {r['runs']} | {r['ok']} | {r['clean']} | {r['traceback']} | {r['crash']} | "
                    f"{r['hang']} | {r.get('memory', 0)} |"
                )
        return "\n".join(lines)


@functools.lru_cache(maxsize=1)
def _cli() -> Any:
    import typer

    from cortiq_cli.main import app

    return typer.main.get_command(app)


def _invoke(runner: Any, cli: Any, args: list[str], input: str | None = None) -> tuple[int, BaseException | None]:
    """The command's exit code, or the exception that escaped it. (typer's CliRunner.invoke
    does the same but rebuilds the click command from the functions on every call.)"""
    with runner.isolation(input=input):
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
    for command in case_commands(case):
        if needs_open(command) and not (outcomes[0].status == "ok" or case.target == "sidecar"):
            continue  # the file does not open: the others stop where inspect did
        code, exc = _invoke(runner, cli, command_args(command, main), command_input(command))
        if exc is not None:
            status = "memory" if isinstance(exc, MemoryError) else "traceback"
            outcomes.append(Outcome(command, status, f"{type(exc).__name__}: {str(exc)[:120]}"))
        elif code == 0:
            outcomes.append(Outcome(command, "ok"))
        else:
            outcomes.append(Outcome(command, "clean"))
    return outcomes


# ------------------------------------------------------------------ resealed corpus

# An attacker who recomputes every checksum: the preamble CRC, and each tensor's CRC in the
# directory after its blob changed. Every mutant below is such a valid-checksum file; the
# properties are the same (no traceback, signal, hang or memory blow-up).
RESEALED_MUTATORS = ("retype", "tokenizer", "template", "blob", "session", "header-sealed", "geometry")
TOKENIZER_TENSOR = "__tokenizer__/tokenizer.json"
BENIGN_TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"


def _entries(data: bytes) -> list[dict[str, Any]]:
    lay = Layout.of(data)
    return json.loads(data[lay.diroff : lay.diroff + lay.dirlen])


def _header_of(data: bytes) -> dict[str, Any]:
    lay = Layout.of(data)
    return json.loads(data[lay.hoff : lay.hoff + lay.hlen])


def rewrite_blobs(data: bytes, replace: dict[str, bytes]) -> bytes:
    """The file with the blobs of ``replace`` (u8 tensors) swapped for new bytes: blobs laid
    out again 64-byte aligned, each changed tensor's shape, size and CRC-32 recomputed, the
    preamble resealed."""
    import zlib

    lay = Layout.of(data)
    entries = sorted(_entries(data), key=lambda e: e["offset"])
    blobs, pos = bytearray(), lay.doff
    for e in entries:
        raw = replace.get(e["name"])
        if raw is None:
            raw = data[e["offset"] : e["offset"] + e["nbytes"]]
        else:
            e.update(shape=[len(raw)], nbytes=len(raw), crc32=zlib.crc32(raw), dtype="u8")
        e["offset"] = pos
        blobs += raw + bytes(-len(raw) % 64)
        pos += len(raw) + (-len(raw) % 64)
    dir_json = json.dumps(entries).encode()
    pre = list(struct.unpack(_FMT, data[:64]))
    pre[7], pre[8] = lay.doff + len(blobs), len(dir_json)
    out = bytearray(struct.pack(_FMT, *pre) + data[64 : lay.doff] + bytes(blobs) + dir_json)
    return bytes(reseal(out))


def _with_header(data: bytes, header: dict[str, Any]) -> bytes:
    return _rebuild(data, json.dumps(header).encode(), seal=True)


def _retyped(rng: random.Random, v: Any) -> Any:
    """``v`` as another JSON type: the same information in the wrong shape."""
    if isinstance(v, bool):
        return rng.choice([int(v), str(v).lower(), [v]])
    if isinstance(v, int):
        return rng.choice([str(v), float(v), [v], {"value": v}, v > 0])
    if isinstance(v, float):
        return rng.choice([str(v), int(v) if math.isfinite(v) else 0, [v]])
    if isinstance(v, str):
        return rng.choice([[v], {"text": v}, len(v), None, v.encode().hex()[:64], v * rng.choice([2, 1000])])
    if isinstance(v, list):
        return rng.choice([{str(i): x for i, x in enumerate(v)}, json.dumps(v), len(v), v[:1] * 3 if v else [None]])
    if isinstance(v, dict):
        return rng.choice([list(v.values()), list(v), json.dumps(v)[:200], len(v)])
    return rng.choice([{}, [], "", 0])


def _retype(rng: random.Random, data: bytes) -> tuple[bytes, str]:
    header = _header_of(data)
    paths = [p for p in key_paths(header) if p]
    path = rng.choice(paths)
    v = header
    for k in path:
        v = v[k]
    new = _retyped(rng, v)
    _set(header, path, new)
    return _with_header(data, header), f"retype {'.'.join(map(str, path))}: {json.dumps(new)[:50]}"


_HUGE_REGEX = "(a|aa)+$" * 600
_COMPONENTS: dict[str, list[Any]] = {
    "normalizer": [
        {"type": "Replace", "pattern": {"String": ""}, "content": "x" * 100000},
        {"type": "Replace", "pattern": {"Regex": _HUGE_REGEX}, "content": ""},
        {"type": "Precompiled", "precompiled_charsmap": "AAAAAAAA"},
        {"type": "Prepend", "prepend": "\u2581" * 10},
        {"type": "Sequence", "normalizers": [{"type": "NFKC"}] * 100},
        {"type": "Strip", "strip_left": "yes"},
        {"type": "Lowercase"},
        {"type": "NFC"},
        {"type": "Hypothetical"},
        [],
        "NFC",
    ],
    "pre_tokenizer": [
        {"type": "Split", "pattern": {"Regex": _HUGE_REGEX}, "behavior": "Isolated", "invert": False},
        {"type": "Split", "pattern": {"Regex": "("}, "behavior": "Isolated", "invert": False},
        {"type": "Split", "pattern": {"String": " "}, "behavior": "Sideways", "invert": False},
        {"type": "Metaspace", "replacement": "", "prepend_scheme": "always", "split": True},
        {"type": "CharDelimiterSplit", "delimiter": ""},
        {"type": "FixedLength", "length": 0},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
        {"type": "Sequence", "pretokenizers": [{"type": "Whitespace"}, {"type": "Digits", "individual_digits": True}]},
        {"type": "Whitespace"},
    ],
    "decoder": [
        {"type": "Strip", "content": " ", "start": 2**62, "stop": 2**62},
        {"type": "Replace", "pattern": {"String": "a"}, "content": "b" * 100000},
        {"type": "Sequence", "decoders": [{"type": "ByteFallback"}, {"type": "Fuse"}, {"type": "Unknown"}]},
        {"type": "CTC", "pad_token": "", "word_delimiter_token": "", "cleanup": True},
        {"type": "WordPiece", "prefix": "##", "cleanup": 3},
        {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        {"type": "Fuse"},
    ],
    "post_processor": [
        {
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": "[X]", "type_id": 0}}],
            "pair": [],
            "special_tokens": {},
        },
        {
            "type": "TemplateProcessing",
            "single": [{"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [],
            "special_tokens": {"[X]": {"id": "[X]", "ids": [2**40], "tokens": ["x"]}},
        },
        {"type": "BertProcessing", "sep": ["[SEP]", 10**12], "cls": ["[CLS]", 0]},
        {"type": "RobertaProcessing", "sep": ["a", 0], "cls": ["b", 1], "trim_offsets": True, "add_prefix_space": True},
        {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": False, "use_regex": True},
    ],
    "padding": [
        {
            "strategy": {"Fixed": 10**12},
            "direction": "Right",
            "pad_to_multiple_of": None,
            "pad_id": 0,
            "pad_type_id": 0,
            "pad_token": "x",
        },
        {
            "strategy": "BatchLongest",
            "direction": "Left",
            "pad_to_multiple_of": 2**40,
            "pad_id": 0,
            "pad_type_id": 0,
            "pad_token": "x",
        },
        {
            "strategy": {"Fixed": 8},
            "direction": "Right",
            "pad_to_multiple_of": None,
            "pad_id": 0,
            "pad_type_id": 0,
            "pad_token": "x",
        },
    ],
    "truncation": [
        {"direction": "Right", "max_length": 0, "strategy": "LongestFirst", "stride": 5},
        {"direction": "Right", "max_length": 2**62, "strategy": "LongestFirst", "stride": 0},
        {"direction": "Left", "max_length": 4, "strategy": "OnlyFirst", "stride": 0},
    ],
}


def _mutate_tokenizer(rng: random.Random, tok: dict[str, Any]) -> str:
    how = rng.choice(["component", "component", "model", "model", "added", "path", "path"])
    if how == "component":
        key = rng.choice(list(_COMPONENTS))
        tok[key] = rng.choice(_COMPONENTS[key])
        return f"{key}={json.dumps(tok[key])[:60]}"
    model = tok["model"]
    if how == "model":
        edit = rng.choice(
            ["type", "vocab-id", "vocab-list", "merges", "merges-missing", "unk", "dropout", "vocab-empty"]
        )
        if edit == "type":
            model["type"] = rng.choice(["Unigram", "WordPiece", "WordLevel", "Hypothetical", 5, None])
        elif edit == "vocab-id":
            k = rng.choice(list(model["vocab"]))
            model["vocab"][k] = rng.choice([-1, 2**40, "3", 1.5, None, 0])
        elif edit == "vocab-list":
            model["vocab"] = [[k, rng.choice([0.0, -1e308, 1e308, "x"])] for k in model["vocab"]]
        elif edit == "merges":
            model["merges"] = rng.choice([[["a", "b"]] * 3, ["a b c"], [[1, 2]], "merges", [["\u0120", "t"]] * 1000])
        elif edit == "merges-missing":
            model["merges"] = [["zz", "qq"]]
        elif edit == "unk":
            model["unk_token"] = rng.choice(["<unk>", "", 5, "x" * 100000])
        elif edit == "dropout":
            model["dropout"] = rng.choice([5.0, -1, "0.1", float("1e308")])
        else:
            model["vocab"] = {}
        return f"model {edit}"
    if how == "added":
        tok["added_tokens"] = rng.choice(
            [
                [
                    {
                        "id": 2**40,
                        "content": "x",
                        "single_word": False,
                        "lstrip": False,
                        "rstrip": False,
                        "normalized": False,
                        "special": True,
                    }
                ],
                [{"id": 3, "content": "", "special": True}],
                [{"id": i, "content": "<s>", "special": True} for i in range(3)],
                "tokens",
                [None],
                [
                    {
                        "id": 300,
                        "content": "<|im_start|>",
                        "single_word": False,
                        "lstrip": True,
                        "rstrip": True,
                        "normalized": True,
                        "special": False,
                    }
                ],
            ]
        )
        return f"added_tokens={json.dumps(tok['added_tokens'])[:60]}"
    paths = [p for p in key_paths({k: v for k, v in tok.items() if k != "model"}) if p]
    paths += [("model",) + p for p in key_paths({k: v for k, v in model.items() if k not in ("vocab", "merges")})]
    path = rng.choice(paths)
    if rng.random() < 0.3:
        _delete(tok, path)
        return f"tokenizer delete {'.'.join(map(str, path))}"
    v = tok
    for k in path:
        v = v[k]
    value = _retyped(rng, v) if rng.random() < 0.5 else hostile_values(rng)
    _set(tok, path, value)
    return f"tokenizer {'.'.join(map(str, path))}={json.dumps(value)[:40]}"


def _tokenizer_case(rng: random.Random, data: bytes) -> tuple[bytes, str]:
    lay = Layout.of(data)
    entry = next(e for e in _entries(data) if e["name"] == TOKENIZER_TENSOR)
    raw = data[entry["offset"] : entry["offset"] + entry["nbytes"]]
    kind = rng.choice(["json"] * 8 + ["bytes"])
    header = _header_of(data)
    if kind == "bytes":
        new = rng.choice(
            [
                raw[: rng.randrange(len(raw))],
                raw + b"\xff",
                b"[" * 100000,
                b"",
                b'{"model": null}',
                raw.replace(b'"vocab"', b'"vocab" ', 1),
            ]
        )
        note = f"tokenizer bytes ({len(new)})"
    else:
        tok = json.loads(raw)
        note = _mutate_tokenizer(rng, tok)
        new = json.dumps(tok).encode()
        if rng.random() < 0.5:  # keep the header's count in step, so the checks behind it are reached
            try:
                from formats.tokenizer_check import vocab_size_of

                header["tokenizer"]["vocab_size"] = vocab_size_of(tok)
            except Exception:  # noqa: BLE001 - a mutant the counter cannot read keeps the old count
                pass
    header.setdefault("tokenizer", {})["chat_template"] = BENIGN_TEMPLATE
    out = rewrite_blobs(data, {TOKENIZER_TENSOR: new})
    del lay
    return _with_header(out, header), note


TEMPLATES = [
    "{{ lipsum(10**6) }}",
    '{{ "x"|center(10**9) }}',
    '{{ "%*s"|format(10**9, "") }}',
    '{{ "ab" * 10**9 }}',
    "{% for i in range(10**9) %}{% endfor %}",
    '{{ "x".rjust(10**9) }}',
    '{{ "{:>999999999}".format(1) }}',
    '{{ "%.999999999f" % 1.0 }}',
    '{{ ("x" * 2**20).replace("x", "yy") }}',
    "{{ [1]|batch(10**9, 0)|list }}",
    '{% set a = "x" * 2**20 %}{{ a ~ a ~ a }}',
    '{% set a = "x" * 2**20 %}{% for c in a %}{% for d in a %}{% endfor %}{% endfor %}',
    '{% set a = ["x" * 2**19] %}{% set b = [a, a, a, a] %}{% set c = [b, b, b, b] %}{{ [c, c, c, c] }}',
    "{% set ns = namespace(t=('a',)) %}{% for i in range(40) %}{% set ns.t = (ns.t, ns.t) %}{% endfor %}{{ {ns.t: 1} }}",
    "{{ (2**64)**64 }}",
    '{{ ("<!--" * 200000)|striptags }}',
    "{{ 1 // 0 }}",
    "{% for %}",
    "{{ raise_exception('x') }}",
    "{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(0) }}",
    "{{ ''.__class__.__mro__ }}",
    "{{ cycler.__init__.__globals__ }}",
    "{{ messages[0]['content'] * 10**6 }}",
    "{{ messages|tojson(indent=10**9) }}",
    "{% include 'x' %}",
    "{% extends 'y' %}",
    "{{ strftime_now('%Y' * 10**5) }}",
    "{{ range(10**6)|list|join('x' * 10**6) }}",
    "{{ '\ud800' }}",
    "{{ x.y.z }}",
    "{% for m in messages recursive %}{{ loop(messages) }}{% endfor %}",
    "{{ '%s' % messages }}",
    BENIGN_TEMPLATE,
    "(" * 1000 + ")" * 1000,
    "{{ " + "(" * 100 + "1" + ")" * 100 + " }}",
    "{% raw %}",
    "x" * 2_000_000,
]


def _template_case(rng: random.Random, data: bytes) -> tuple[bytes, str]:
    header = _header_of(data)
    t = rng.choice(TEMPLATES)
    if rng.random() < 0.3:  # two pieces joined: a bound hit after a benign start
        t = rng.choice(TEMPLATES) + rng.choice(TEMPLATES)
    header.setdefault("tokenizer", {})["chat_template"] = t
    return _with_header(data, header), f"template {t[:60]!r}"


def _blob_case(rng: random.Random, data: bytes) -> tuple[bytes, str]:
    """Bytes of one tensor changed and its directory CRC-32 recomputed (NaN and Inf
    weights, wild scales, other draft-vocabulary ids)."""
    import zlib

    entries = _entries(data)
    e = rng.choice([x for x in entries if x["nbytes"]])
    out = bytearray(data)
    n = rng.choice([1, 4, 64, e["nbytes"]])
    how = rng.choice(["random", "nan", "inf", "ff"])
    for _ in range(min(n, 256)):
        p = e["offset"] + rng.randrange(e["nbytes"])
        if how == "random":
            out[p] = rng.randrange(256)
        elif how == "ff":
            out[p] = 0xFF
        else:
            q = p - (p - e["offset"]) % 4
            if q + 4 <= e["offset"] + e["nbytes"]:
                out[q : q + 4] = struct.pack("<f", float("nan") if how == "nan" else float("inf"))
    e["crc32"] = zlib.crc32(bytes(out[e["offset"] : e["offset"] + e["nbytes"]]))
    lay = Layout.of(data)
    return _rebuild(
        bytes(out), data[lay.hoff : lay.hoff + lay.hlen], json.dumps(entries).encode()
    ), f"blob {e['name'][:40]} {how} x{n}"


def _session(rng: random.Random) -> tuple[bytes, str]:
    good = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
    ]
    how = rng.choice(["retype", "deep", "huge", "many", "surrogate", "bytes", "roles", "good"])
    if how == "retype":
        doc: Any = json.loads(json.dumps(good))
        path = rng.choice([p for p in key_paths(doc) if p])
        v = doc
        for k in path:
            v = v[k]
        _set(doc, path, _retyped(rng, v) if rng.random() < 0.5 else hostile_values(rng))
        return json.dumps(doc).encode(), f"session retype {path}"
    if how == "deep":
        return b"[" * rng.choice([100, 10000, 100000]) + b"]" * 10, "session deep"
    if how == "huge":
        return json.dumps([{"role": "user", "content": "x" * rng.choice([10**5, 10**6])}]).encode(), "session huge"
    if how == "many":
        return json.dumps([{"role": "user", "content": "hi"}] * rng.choice([10**3, 10**5])).encode(), "session many"
    if how == "surrogate":
        return b'[{"role": "user", "content": "caf\\udce9 \\ud800"}]', "session surrogate"
    if how == "bytes":
        return rng.choice(
            [b"\xff\xfe", b"", b"null", b'[{"role": "user", "content": "\xe9"}]', rng.randbytes(200)]
        ), "session bytes"
    if how == "roles":
        return json.dumps(
            [{"role": r, "content": "x"} for r in ("tool", "", "\u0000", "x" * 1000)]
        ).encode(), "session roles"
    return json.dumps(good).encode(), "session good"


def make_resealed_case(rng: random.Random, bases: list[Base], index: int) -> Case:
    base = rng.choice(bases)
    kind = rng.choice(RESEALED_MUTATORS)
    target = "sidecar" if kind in ("retype", "blob", "header-sealed") and rng.random() < 0.2 else "main"
    orig = base.sidecar if target == "sidecar" else base.main
    session, commands = None, COMMANDS
    if kind == "retype":
        data, note = _retype(rng, orig)
    elif kind == "tokenizer":
        data, note = _tokenizer_case(rng, orig)
        commands = ("inspect", "generate", "chat-template")
    elif kind == "template":
        data, note = _template_case(rng, orig)
        commands = ("inspect", "chat-template")
    elif kind == "blob":
        data, note = _blob_case(rng, orig)
    elif kind == "session":
        header = _header_of(orig)
        header["tokenizer"]["chat_template"] = BENIGN_TEMPLATE
        data = _with_header(orig, header)
        session, note = _session(rng)
        commands = ("inspect", "chat-load")
    elif kind == "header-sealed":
        data, note = _edit_header(rng, orig, seal=True)
    else:
        data, note = _arch_geometry(rng, orig)
    main, side = (base.main, data) if target == "sidecar" else (data, base.sidecar)
    return Case(
        f"{index:05d}-{kind}-{base.name}-{target}",
        kind,
        base.name,
        target,
        main,
        side,
        data != orig,
        False,
        True,
        note,
        session,
        commands,
    )


def resealed_corpus(seed: int, n: int, bases: list[Base]):
    """``n`` resealed mutants, made one at a time (a mutant can be megabytes)."""
    rng = random.Random(seed)
    for i in range(n):
        yield make_resealed_case(rng, bases, i)
