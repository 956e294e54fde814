"""Machine code for the host CPU from the kernels' LLVM IR, with an on-disk object cache.

``qdot.py`` (integer dot products) and ``attn_ir.py`` (attention loops) write their
kernels as LLVM IR. Compiling a module takes 0.1-0.5 s and, the first time in a
process, pages in about 25 MiB of LLVM's optimizer and code generator (SmolLM2 q8:
RSS after load 331 MiB with a 137 MiB file). So the object code is cached on disk,
as numba's ``cache=True`` caches its own: a later process parses the IR and loads the
object, without running LLVM's passes.

The cache lives under ``$CORTIQ_KERNEL_CACHE`` (default ``~/.cache/cortiq/kernels``;
an empty value turns it off). An entry's name is the sha256 of the IR, the CPU's name
and features and llvmlite's version, so another CPU or another kernel never reads it;
its content starts with the sha256 of the object code, so a truncated or altered
entry is rebuilt, not loaded. A directory that cannot be written only costs the
compile.
"""

from __future__ import annotations

import hashlib
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

from cortiq_engine.kernels import interrupts

CACHE_ENV = "CORTIQ_KERNEL_CACHE"
MAGIC = b"CORTIQ-OBJ1\n"
# One compile at a time: llvmlite's initialization and the target machine are process-wide.
_LOCK = threading.Lock()
# Modules compiled in this process, by key. Machine code is never freed (numba keeps its
# own the same way): an address handed to a kernel can never outlive its code, and a
# second kernel set (every Engine.load) reuses the first one's instead of compiling again.
_COMPILED: dict[str, "Compiled"] = {}


@dataclass(frozen=True)
class Compiled:
    """A compiled module: its entries' addresses; the machine code lives as long as ``engine``."""

    engine: object
    addrs: dict[str, int]
    from_cache: bool


def default_cache_dir(environ: Mapping[str, str] = os.environ) -> Path | None:
    """``$CORTIQ_KERNEL_CACHE``, else ``$XDG_CACHE_HOME/cortiq/kernels`` (``~/.cache``); None when set empty."""
    env = environ.get(CACHE_ENV)
    if env is not None:
        return Path(env).expanduser() if env.strip() else None
    base = environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "cortiq" / "kernels"


def _key(ir_text: str, cpu: str, features: str) -> str:
    import llvmlite

    h = hashlib.sha256()
    for part in (ir_text, cpu, features, llvmlite.__version__):
        h.update(part.encode() + b"\0")
    return h.hexdigest()


def _read(path: Path) -> bytes | None:
    """The cached object code, or None when absent or not intact."""
    try:
        data = path.read_bytes()
    except OSError:
        return None
    head = len(MAGIC) + 32
    if len(data) <= head or not data.startswith(MAGIC):
        return None
    obj = data[head:]
    return obj if hashlib.sha256(obj).digest() == data[len(MAGIC) : head] else None


def _write(path: Path, obj: bytes) -> None:
    """Store ``obj`` atomically (a killed process leaves a temporary file, never a partial entry)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        tmp.write_bytes(MAGIC + hashlib.sha256(obj).digest() + obj)
        os.replace(tmp, path)
    except OSError:
        try:
            tmp.unlink()
        except OSError:
            pass


def compile_ir(ir_text: str, names: Sequence[str], cache_dir: Path | None = None, *, reuse: bool = True) -> Compiled:
    """Compile ``ir_text`` for this CPU (opt level 3) and return the addresses of ``names``;
    ``cache_dir`` holds the object cache (None: none on disk). ``reuse``: return this
    process's earlier compile of the same IR (False: the tests of the disk cache)."""
    import llvmlite.binding as llvm

    with _LOCK:
        llvm.initialize_native_target()
        llvm.initialize_native_asmprinter()
        llvm.initialize_native_asmparser()  # inline assembly (qdot's vpdpwssd)
        cpu, features = llvm.get_host_cpu_name(), llvm.get_host_cpu_features().flatten()
        key = _key(ir_text, cpu, features)
        done = _COMPILED.get(key) if reuse else None
        if done is not None and all(n in done.addrs for n in names):
            return done
        path = cache_dir / f"{key}.o" if cache_dir is not None else None
        cached = _read(path) if path is not None else None
        mod = llvm.parse_assembly(ir_text)
        if cached is None:
            mod.verify()
        tm = llvm.Target.from_default_triple().create_target_machine(cpu=cpu, features=features, opt=3)
        engine = llvm.create_mcjit_compiler(mod, tm)
        produced: list[bytes] = []
        engine.set_object_cache(lambda _m, buf: produced.append(bytes(buf)), lambda _m: cached)
        with interrupts.held():  # LLVM calls the object cache through ctypes (interrupts.py)
            engine.finalize_object()
        if cached is None and produced and path is not None:
            _write(path, produced[0])
        addrs = {n: int(engine.get_function_address(n)) for n in names}
        if not all(addrs.values()):
            raise RuntimeError(f"compiled kernels lack {[n for n, a in addrs.items() if not a]}")
        compiled = Compiled(engine, addrs, cached is not None)
        _COMPILED.setdefault(key, compiled)  # kept: its addresses may be in use (see _COMPILED)
        return compiled


def call_by_address(arg_types: list) -> object:
    """Codegen for a numba ``@intrinsic`` whose first argument is a compiled entry's
    address (``Compiled.addrs``) and the rest its arguments (``arg_types``: their LLVM
    types), returning nothing: numba code calls the entry directly, without ctypes and
    without taking the GIL."""
    from llvmlite import ir

    def codegen(context, builder, signature, args):
        fnty = ir.FunctionType(ir.VoidType(), arg_types)
        builder.call(builder.inttoptr(args[0], fnty.as_pointer()), args[1:])
        return context.get_dummy_value()

    return codegen
