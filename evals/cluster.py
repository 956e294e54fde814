"""Scoring a window plan on a Ray cluster, with the same figures as one process.

The driver (the ``cortiq`` process) plans the windows and tokenizes the text as it
does alone; each worker is a Ray actor that maps the model files once, checks them
against the driver's (``ModelFingerprint``) and scores the windows it is handed,
returning one ``WindowPartial`` per window: the per-token values the one-process
path collects. The driver reduces them in plan order with the same accumulator
(``PerplexityAccumulator.add_partial``), so every figure is bit-identical to a run
without a cluster, whichever worker scored which window and in whatever order the
results came back.

Faults: Ray restarts a worker whose process dies (``max_restarts``); the windows it
had in flight are handed out again by the driver, which keys results by window
index, so nothing is counted twice. Every result is journaled (``WindowJournal``)
as it arrives, so a driver that dies or is interrupted continues with ``resume``.

Ray is imported only here, and only when a cluster is asked for.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import socket
import struct
import sys
import time
import zlib
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from evals.kl import RefRows, RowStats
from evals.perplexity import PerplexityAccumulator, PerplexityResult, WindowPartial, build_reports, window_partial
from evals.scoring import iter_scored, scored_text_bytes
from evals.windows import Window
from formats.errors import CortiqError

INSTALL_HINT = "pip install 'cortiq[cluster]'"
MAX_RESTARTS = 4  # per worker process, by Ray
MAX_WINDOW_ATTEMPTS = 4  # a window that loses this many workers is a failure, not bad luck
IN_FLIGHT = 2  # windows queued per worker: the next one is there when the last one ends
WORKER_PROBE_S = 0.25  # a lost worker is first asked again after this, then less often (5 s at most)
WORKER_GIVE_UP_S = 300.0  # a worker that has not answered for this long gets no more windows
AHEAD_PER_WORKER = 8  # results per worker the driver holds while an earlier window is still out
JOURNAL_ENV = "CORTIQ_CLUSTER_CACHE"
HASH_BLOCK = 1 << 20  # tokens hashed per step of a run's key


def ray_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("ray") is not None


# ---------------------------------------------------------------------------- address


@dataclass(frozen=True)
class ClusterAddress:
    """``local:N`` (start N workers on this machine, stop them at the end), ``auto``
    (the cluster ``ray start`` runs here) or ``ray://host:port`` / ``host:port``."""

    address: str
    local_workers: int | None = None

    @classmethod
    def parse(cls, text: str) -> "ClusterAddress":
        t = text.strip()
        if t.startswith("local:"):
            n = t[len("local:") :]
            if not n.isdigit() or int(n) < 1:
                raise CortiqError(f"--cluster local:N needs a worker count N >= 1 (got {text[:40]!r})")
            return cls(t, int(n))
        if t == "auto" or t.startswith("ray://") or (":" in t and t.rsplit(":", 1)[1].isdigit()):
            return cls(t)
        raise CortiqError(f"--cluster {text[:60]!r}: give local:N, auto, ray://HOST:PORT or HOST:PORT")

    @property
    def is_local(self) -> bool:
        return self.local_workers is not None

    def check_reachable(self, timeout: float = 5.0) -> None:
        """A named head must answer on its port (Ray itself retries a dead address for minutes)."""
        if self.is_local or self.address == "auto":
            return
        host, port = self.address.removeprefix("ray://").rsplit(":", 1)
        try:
            socket.create_connection((host, int(port)), timeout=timeout).close()
        except (OSError, ValueError) as e:
            raise CortiqError(
                f"--cluster {self.address}: nothing answers at {host}:{port} ({e}); is `ray start --head` running there?"
            ) from None


# ---------------------------------------------------------------------------- model identity


@dataclass(frozen=True)
class ModelFingerprint:
    """A model file's size and a hash of its first bytes (the CMF preamble, whose checksum
    covers the header and the tensor directory, and the header itself): the worker's file
    must be the driver's."""

    size: int
    digest: str

    HEAD = 1 << 20  # the header of any CMF file we write is far smaller

    @classmethod
    def of(cls, path: Path) -> "ModelFingerprint":
        try:
            size = path.stat().st_size
            with open(path, "rb") as f:
                head = f.read(min(size, cls.HEAD))
        except OSError as e:
            raise CortiqError(f"{path}: cannot read the model file ({e.strerror or e})") from None
        return cls(size, hashlib.sha256(head).hexdigest()[:32])

    def check(self, path: Path, host: str) -> None:
        mine = ModelFingerprint.of(path)
        if mine != self:
            raise CortiqError(
                f"{path} on worker {host} is not the driver's file "
                f"(size {mine.size:,} vs {self.size:,}, header hash {mine.digest[:12]} vs {self.digest[:12]})"
            )


# ---------------------------------------------------------------------------- the journal


def journal_dir() -> Path:
    """``$CORTIQ_CLUSTER_CACHE``, else ``~/.cache/cortiq/cluster``."""
    env = os.environ.get(JOURNAL_ENV)
    return Path(env) if env else Path.home() / ".cache" / "cortiq" / "cluster"


def _partial_arrays(p: WindowPartial) -> dict[str, np.ndarray]:
    out = {"nll0": p.nll[0]}
    for m, st in enumerate(p.rows[1:], start=1):
        assert st is not None
        out.update({f"nll{m}": st.nll, f"kld{m}": st.kld, f"rkld{m}": st.rkld, f"dp{m}": st.dp, f"same{m}": st.same})
    return out


def _partial_of(window: int, d: dict[str, np.ndarray]) -> WindowPartial:
    n = 1 + sum(1 for k in d if k.startswith("kld"))
    rows: list[RowStats | None] = [None] + [
        RowStats(d[f"nll{m}"], d[f"kld{m}"], d[f"rkld{m}"], d[f"dp{m}"], d[f"same{m}"]) for m in range(1, n)
    ]
    return WindowPartial(window, [d["nll0"]] + [r.nll for r in rows[1:] if r is not None], rows)


def _features_arrays(f: Any) -> dict[str, np.ndarray]:
    return {"gap": f.gap, "correct": f.correct, "L": f.L, "D": f.D}


def _features_of(window: int, d: dict[str, np.ndarray]) -> Any:
    from evals.temperature import RowFeatures

    return RowFeatures(d["gap"], d["correct"], d["L"], d["D"])


def _imatrix_arrays(p: Any) -> dict[str, np.ndarray]:
    names = list(p.sums)
    out = {
        "names": np.array(names, dtype=str),
        "rows": np.array([p.rows[n] for n in names], np.int64),
        "tokens": np.int64(p.tokens),
    }
    out.update({f"s{i}": p.sums[n] for i, n in enumerate(names)})
    return out


def _imatrix_of(window: int, d: dict[str, np.ndarray]) -> Any:
    from cortiq_engine.imatrix import ImatrixPartial

    names = [str(n) for n in d["names"]]
    return ImatrixPartial(
        {n: d[f"s{i}"] for i, n in enumerate(names)}, {n: int(r) for n, r in zip(names, d["rows"])}, int(d["tokens"])
    )


_COUNTS = ("drafted", "accepted", "checked", "right", "accept_hist", "depth_hist")


def _probe_arrays(p: Any) -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    for i, c in enumerate(p.counts):
        out.update({f"{name}{i}": np.array(getattr(c, name), np.int64) for name in _COUNTS})
        out[f"plain{i}"], out[f"seconds{i}"] = np.int64(c.plain_steps), np.float64(c.draft_seconds)
    for i, t in enumerate(p.traces or []):
        out[f"tprobs{i}"], out[f"tright{i}"] = t.probs, t.right
    return out


def _probe_of(window: int, d: dict[str, np.ndarray]) -> Any:
    from cortiq_engine.acceptance import Acceptance
    from evals.mtp_probe import ProbeTrace, ProbeWindow

    counts = []
    for i in range(sum(1 for k in d if k.startswith("plain"))):
        lists = {name: [int(x) for x in d[f"{name}{i}"]] for name in _COUNTS}
        counts.append(
            Acceptance(
                len(lists["drafted"]), **lists, plain_steps=int(d[f"plain{i}"]), draft_seconds=float(d[f"seconds{i}"])
            )
        )
    traces = [ProbeTrace(d[f"tprobs{i}"], d[f"tright{i}"]) for i in range(len(counts))] if "tprobs0" in d else None
    return ProbeWindow(counts, traces)


@dataclass(frozen=True)
class WindowKind:
    """One kind of cluster run: its name (the journal's and the run key's), the
    ``WindowScorer`` method that scores a window, how a window's result becomes the
    journal's arrays and back, and what each worker loads (``WindowScorer``'s ``load``).
    With ``whole_text`` every window reads the whole text: it goes into Ray's object store
    once and each task names that one copy."""

    name: str
    method: str
    encode: Callable[[Any], dict[str, np.ndarray]]
    decode: Callable[[int, dict[str, np.ndarray]], Any]
    load: str = "engines"
    whole_text: bool = False


PPL = WindowKind("ppl", "score", _partial_arrays, _partial_of)
CALIBRATE = WindowKind("calibrate", "features", _features_arrays, _features_of)
IMATRIX = WindowKind("imatrix", "imatrix", _imatrix_arrays, _imatrix_of, load="imatrix")
MTP_PROBE = WindowKind("mtp-probe", "mtp_probe", _probe_arrays, _probe_of, load="mtp", whole_text=True)


class WindowJournal:
    """Finished windows of one run, appended as they arrive: a header line naming the run,
    then records of (u64 length, u32 CRC-32, an .npz of the window's arrays). A record cut
    short by a crash fails its length or CRC and is dropped with everything after it."""

    MAGIC = b"CORTIQ-WINDOWS 1 "
    _REC = struct.Struct("<QI")

    def __init__(self, path: Path, key: str):
        self.path = path
        self.key = key
        self._f: io.BufferedWriter | None = None
        self._valid = 0  # bytes of whole records that index read

    def index(self) -> dict[int, tuple[int, int]]:
        """Where each window a previous run of the same key finished is: (offset, length) of its
        record's body (empty without a journal). Only the records' heads are kept, not their arrays."""
        out: dict[int, tuple[int, int]] = {}
        self._valid = 0
        try:
            f = open(self.path, "rb")
        except OSError:
            return out
        with f:
            head = self.MAGIC + self.key.encode() + b"\n"
            if f.read(len(head)) != head:
                return out
            pos = len(head)
            while True:
                rec = f.read(self._REC.size)
                if len(rec) < self._REC.size:
                    break
                n, crc = self._REC.unpack(rec)
                body = f.read(n)
                if len(body) != n or zlib.crc32(body) != crc:
                    break
                out[self._window_of(body)] = (pos + self._REC.size, n)
                pos += self._REC.size + n
        self._valid = pos
        return out

    @staticmethod
    def _window_of(body: bytes) -> int:
        with np.load(io.BytesIO(body), allow_pickle=False) as z:
            return int(z["window"])

    def read(self, where: tuple[int, int]) -> dict[str, np.ndarray]:
        """One record's arrays, from its place in ``index``."""
        offset, n = where
        with open(self.path, "rb") as f:
            f.seek(offset)
            body = f.read(n)
        with np.load(io.BytesIO(body), allow_pickle=False) as z:
            arrays = {k: z[k] for k in z.files}
        arrays.pop("window")
        return arrays

    def load(self) -> dict[int, dict[str, np.ndarray]]:
        """Every finished window's arrays at once (for inspection; a run reads them one by one)."""
        return {i: self.read(where) for i, where in self.index().items()}

    def open(self, keep: bool) -> None:
        """Start writing: after the records ``index`` read (``keep``), or afresh."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if keep and self.path.exists() and self._valid:
            self._f = open(self.path, "r+b")
            self._f.seek(self._valid)
            self._f.truncate()
        else:
            self._f = open(self.path, "wb")
            self._f.write(self.MAGIC + self.key.encode() + b"\n")
            self._f.flush()

    def append(self, window: int, arrays: dict[str, np.ndarray]) -> None:
        assert self._f is not None
        buf = io.BytesIO()
        np.savez(buf, window=np.int64(window), **arrays)
        body = buf.getvalue()
        self._f.write(self._REC.pack(len(body), zlib.crc32(body)) + body)
        self._f.flush()

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None

    def remove(self) -> None:
        self.close()
        self.path.unlink(missing_ok=True)


def run_key(
    kind: str,
    fingerprints: Sequence[ModelFingerprint],
    tokens: np.ndarray,
    windows: Sequence[Window],
    extra: dict[str, Any],
) -> str:
    """What makes two runs the same run: models, text, plan and the scoring options."""
    h = hashlib.sha256()
    h.update(
        json.dumps(
            {"kind": kind, "models": [[f.size, f.digest] for f in fingerprints], **extra}, sort_keys=True
        ).encode()
    )
    tokens = np.asarray(tokens)
    for a in range(0, len(tokens), HASH_BLOCK):  # as int64, a block at a time: never a copy of the whole text
        h.update(np.ascontiguousarray(tokens[a : a + HASH_BLOCK], dtype=np.int64).tobytes())
    h.update(
        np.array(
            [[w.begin, w.end, w.row_from, w.row_to, -1 if w.bos is None else w.bos] for w in windows], np.int64
        ).tobytes()
    )
    return h.hexdigest()[:32]


# ---------------------------------------------------------------------------- the worker


class WindowScorer:
    """One worker: the models mapped once, windows scored on request (a Ray actor's body).
    ``load``: "engines" (an ``Engine`` per model: ppl, calibrate), "imatrix" (the one model
    on ``cortiq_engine.imatrix``'s recording kernels) or "mtp" (the model with its draft
    layers: inline, or the sidecar that is the second path)."""

    def __init__(
        self,
        paths: list[str],
        fingerprints: list[ModelFingerprint],
        threads: int,
        ctx: int,
        kv_cache: str,
        chunk: int,
        load: str = "engines",
    ):
        self.host = socket.gethostname()
        self.error: str | None = None
        self.chunk = chunk
        self.engines: list[Any] = []
        self.trunk: Any = None
        self._hidden: tuple[bytes, np.ndarray] | None = None  # mtp: the backbone rows of the last text probed
        try:
            for p, fp in zip(paths, fingerprints):
                fp.check(Path(p), self.host)
            if load == "imatrix":
                from cortiq_engine.imatrix import open_recording

                self.trunk = open_recording(Path(paths[0]), threads=threads)
            elif load == "mtp":
                from cortiq_engine import Engine

                self.engines = [
                    Engine.load(Path(paths[0]), threads=threads, mtp=Path(paths[1]) if len(paths) > 1 else True)
                ]
            else:
                from cortiq_engine import Engine

                self.engines = [Engine.load(Path(p), threads=threads, ctx=ctx, kv_cache=kv_cache) for p in paths]
        except CortiqError as e:
            self.error = str(e)
        except Exception as e:  # noqa: BLE001 - reported to the driver as one line
            self.error = f"worker on {self.host}: {type(e).__name__}: {e}"

    def info(self) -> dict[str, Any]:
        import ray

        node = ray.get_runtime_context().get_node_id()
        return {"host": self.host, "node": node, "pid": os.getpid(), "error": self.error}

    def _blocks(self, window: Window, ids: np.ndarray) -> list[Any]:
        if self.error:
            raise CortiqError(self.error)
        # The window's own tokens, re-based: the same ids, rows and targets as in the whole text.
        local = Window(0, window.end - window.begin, window.row_from, window.row_to, window.bos)
        return list(iter_scored(self.engines, ids, [local], chunk=self.chunk))

    def score(
        self, index: int, window: Window, ids: np.ndarray, ref: RefRows | None
    ) -> tuple[WindowPartial, int, float]:
        """``ppl``: the window's partial, its scored rows, and the seconds it took here (the
        rest of a task's time is the cluster's)."""
        t0 = time.perf_counter()
        blocks = self._blocks(window, ids)
        refs = None
        if ref is not None:
            refs, a = [], 0
            for b in blocks:
                refs.append(ref.slice(a, a + len(b.targets)))
                a += len(b.targets)
        part = window_partial(index, blocks, len(self.engines), refs)
        return part, part.tokens, time.perf_counter() - t0

    def features(self, index: int, window: Window, ids: np.ndarray, ref: None, grid: Any) -> tuple[Any, int, float]:
        """``calibrate``: the window's row features (``evals.temperature.row_features`` of each block)."""
        from evals.temperature import RowFeatures, row_features

        t0 = time.perf_counter()
        parts = [row_features(b.logits[0], b.targets, grid) for b in self._blocks(window, ids)]
        f = RowFeatures.concat(parts, grid)
        return f, len(f), time.perf_counter() - t0

    def imatrix(self, index: int, window: Window, ids: np.ndarray, ref: None) -> tuple[Any, int, float]:
        """``imatrix``: the window's ``ImatrixPartial`` (its f64 sums, not yet added to anything)."""
        from cortiq_engine.imatrix import window_partial

        if self.error:
            raise CortiqError(self.error)
        t0 = time.perf_counter()
        fed = np.array(ids, dtype=np.int64)
        if window.bos is not None:  # what ``Window.fed`` feeds: the first token replaced by BOS
            fed[0] = window.bos
        part = window_partial(self.trunk.model, fed)
        return part, part.tokens, time.perf_counter() - t0

    def mtp_probe(
        self, index: int, window: Window, ids: np.ndarray, ref: None, spec: dict[str, Any]
    ) -> tuple[Any, int, float]:
        """``mtp-probe``: rounds ``row_from``..``row_to``-1 over the whole text ``ids`` (a
        ``ProbeWindow``); the backbone's rows of the text are computed once per worker."""
        from evals.mtp_probe import Variant, backbone_hiddens, probe_window

        if self.error:
            raise CortiqError(self.error)
        t0 = time.perf_counter()
        eng = self.engines[0]
        key = hashlib.sha256(np.ascontiguousarray(ids, np.int64).tobytes()).digest()
        if self._hidden is None or self._hidden[0] != key:
            self._hidden = (key, backbone_hiddens(eng.model, np.asarray(ids, np.int64)))
        part = probe_window(
            eng.model,
            eng.drafts,
            ids,
            self._hidden[1],
            spec["depth"],
            [Variant(c, h) for c, h in spec["variants"]],
            window.row_from,
            window.row_to,
            head=eng.draft_head(spec["vocab"]),
            threshold=spec["threshold"],
            trace=spec["trace"],
        )
        return part, window.n_scored, time.perf_counter() - t0


# ---------------------------------------------------------------------------- the driver


@dataclass
class ClusterReport:
    address: str
    workers: int
    tasks: int = 0  # windows handed to workers, retries included
    retried: int = 0  # windows handed out again after their worker was lost
    resumed: int = 0  # windows read back from the journal
    tokens: int = 0  # tokens scored by the workers in this run
    seconds: float = 0.0  # from the first window handed out to the last result
    busy_s: float = 0.0  # the workers' own seconds scoring windows, summed
    startup_s: float = 0.0  # starting or joining the cluster and loading the models on every worker
    hosts: list[str] = field(default_factory=list)
    nodes: int = 0  # Ray nodes the workers run on (several may share a host)
    held_max: int = 0  # most results the driver held at once, waiting for an earlier window

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else float("nan")

    @property
    def busy(self) -> float:
        """The fraction of the workers' time spent scoring (the rest: waiting for the driver, transfers)."""
        return self.busy_s / (self.seconds * self.workers) if self.seconds > 0 and self.workers else float("nan")

    def to_json(self) -> dict[str, Any]:
        return {
            "address": self.address,
            "workers": self.workers,
            "tasks": self.tasks,
            "retried": self.retried,
            "resumed": self.resumed,
            "tokens_per_s": self.tokens_per_s,
            "startup_s": self.startup_s,
            "busy": self.busy,
            "hosts": sorted(set(self.hosts)),
            "nodes": self.nodes,
            "held_max": self.held_max,
        }


ClusterProgress = Callable[[int, int, int, int, float], None]  # (windows done, windows, tokens done, tokens, tokens/s)


@dataclass
class WindowTask:
    """What one window's worker needs: its tokens and, for a saved reference, its rows."""

    index: int
    window: Window
    ids: np.ndarray
    ref: RefRows | None


@dataclass
class _Down:
    """A lost worker: since when, when to ask it again, the question pending."""

    since: float
    next_probe: float
    wait: float = WORKER_PROBE_S
    probe: Any = None


@dataclass(frozen=True)
class Workers:
    """Where the workers run and what each one maps: the model files, engine threads per
    worker, and the engines' context, KV-cache type and tokens per forward block (the
    imatrix and mtp-probe workers use none of the three)."""

    where: ClusterAddress
    threads: int
    paths: list[Path]
    ctx: int = 0
    kv_cache: str = "f32"
    chunk: int = 0


class Cluster:
    """A started or joined Ray cluster with ``workers`` WindowScorer actors; a context manager
    that shuts down what it started."""

    def __init__(self, workers: Workers, load: str = "engines"):
        if not ray_available():
            raise CortiqError(f"--cluster needs Ray: {INSTALL_HINT}")
        self.where = workers.where
        self.threads = workers.threads
        self.paths = [Path(p).resolve() for p in workers.paths]
        self.fingerprints = [ModelFingerprint.of(p) for p in self.paths]
        self.ctx, self.kv_cache, self.chunk, self.load = workers.ctx, workers.kv_cache, workers.chunk, load
        self.actors: list[Any] = []
        self.hosts: list[str] = []
        self.nodes: list[str] = []
        self.startup_s = 0.0
        self._stack = contextlib.ExitStack()

    def __enter__(self) -> "Cluster":
        import logging

        import ray

        t0 = time.perf_counter()
        self.where.check_reachable()
        # Ray prints its raylet's notices (a worker died...) on stdout: stdout is the report's.
        self._stack.enter_context(contextlib.redirect_stdout(sys.stderr))
        quiet = dict(include_dashboard=False, log_to_driver=False, logging_level=logging.ERROR)
        try:
            if self.where.is_local:
                n = int(self.where.local_workers or 1)
                ray.init(address="local", num_cpus=n * self.threads, **quiet)
            else:
                ray.init(address=self.where.address, **{k: v for k, v in quiet.items() if k != "include_dashboard"})
        except ImportError as e:  # ray:// is Ray Client, whose gRPC modules come with ray[client]
            self._stack.close()
            raise CortiqError(
                f"--cluster {self.where.address} needs Ray Client ({e.name or e}): pip install 'ray[client]', "
                "or run on a node of the cluster with --cluster auto"
            ) from None
        except (ConnectionError, RuntimeError, ValueError) as e:
            self._stack.close()
            first = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
            raise CortiqError(
                f"--cluster {self.where.address}: cannot start or reach the Ray cluster ({first})"
            ) from None
        try:
            cpus = int(ray.cluster_resources().get("CPU", 0))
            n = int(self.where.local_workers) if self.where.is_local else max(1, cpus // self.threads)
            actor = ray.remote(WindowScorer).options(
                num_cpus=self.threads, max_restarts=MAX_RESTARTS, max_task_retries=0, scheduling_strategy="SPREAD"
            )
            args = (
                [str(p) for p in self.paths],
                self.fingerprints,
                self.threads,
                self.ctx,
                self.kv_cache,
                self.chunk,
                self.load,
            )
            self.actors = [actor.remote(*args) for _ in range(n)]
            infos = ray.get([a.info.remote() for a in self.actors])
        except BaseException:
            self.__exit__(None, None, None)
            raise
        for i in infos:
            if i["error"]:
                self.__exit__(None, None, None)
                raise CortiqError(i["error"])
        self.hosts = [i["host"] for i in infos]
        self.nodes = [i["node"] for i in infos]
        self.startup_s = time.perf_counter() - t0
        return self

    def __exit__(self, *exc: Any) -> None:
        import ray

        for a in self.actors:
            try:
                ray.kill(a, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass
        self.actors = []
        if ray.is_initialized():
            ray.shutdown()
        self._stack.close()

    def score(
        self,
        tasks: Iterator[WindowTask],
        report: ClusterReport,
        on_result: Callable[[int, Any], None],
        method: str = "score",
        args: tuple[Any, ...] = (),
        *,
        admit: Callable[[], bool] | None = None,
    ) -> None:
        """Hand the windows out, at most IN_FLIGHT per worker, and pass each result on as it
        arrives. A window whose worker dies goes to another worker; the lost worker gets no
        window until it answers again (Ray restarts it), asked every WORKER_PROBE_S at first,
        then less often, and is given up after WORKER_GIVE_UP_S. While ``admit`` says no, only
        windows handed out again go out (the driver holds enough results waiting for an
        earlier window); with nothing in flight a new one goes out regardless."""
        import ray
        from ray.exceptions import (
            GetTimeoutError,
            ObjectLostError,
            OwnerDiedError,
            RayActorError,
            RayTaskError,
            WorkerCrashedError,
        )

        lost = (RayActorError, WorkerCrashedError, ObjectLostError, OwnerDiedError, GetTimeoutError)
        todo: deque[WindowTask] = deque()
        source = iter(tasks)
        exhausted = False
        inflight: dict[Any, tuple[int, WindowTask]] = {}
        load = [0] * len(self.actors)
        attempts: dict[int, int] = {}
        down: dict[int, _Down] = {}  # workers lost, until they answer again
        probes: dict[Any, int] = {}  # a lost worker's pending ``info`` call
        t0 = time.perf_counter()

        def lose(a: int) -> None:
            d = down.get(a)
            if d is None:
                down[a] = _Down(since=time.monotonic(), next_probe=time.monotonic() + WORKER_PROBE_S)
            elif d.probe is None:
                d.wait = min(d.wait * 2, 5.0)
                d.next_probe = time.monotonic() + d.wait

        try:
            while True:
                now = time.monotonic()
                for a, d in down.items():
                    if d.probe is None and now >= d.next_probe:
                        if now - d.since > WORKER_GIVE_UP_S:
                            d.next_probe = float("inf")  # given up: it never gets a window again
                            continue
                        d.probe = self.actors[a].info.remote()
                        probes[d.probe] = a
                if len(down) == len(self.actors) and all(d.next_probe == float("inf") for d in down.values()):
                    raise CortiqError(f"every worker was lost for over {WORKER_GIVE_UP_S:.0f} s; is the cluster up?")
                for a in range(len(self.actors)):
                    if a in down:
                        continue
                    while load[a] < IN_FLIGHT:
                        if not todo and not exhausted and (admit is None or admit() or not inflight):
                            nxt = next(source, None)
                            if nxt is None:
                                exhausted = True
                            else:
                                todo.append(nxt)
                        if not todo:
                            break
                        t = todo.popleft()
                        ref = getattr(self.actors[a], method).remote(t.index, t.window, t.ids, t.ref, *args)
                        inflight[ref] = (a, t)
                        load[a] += 1
                        report.tasks += 1
                if not inflight and not todo and exhausted:
                    break
                waiting = list(inflight) + list(probes)
                if not waiting:  # every worker lost and none due to be asked yet
                    time.sleep(0.05)
                    continue
                ready, _ = ray.wait(waiting, num_returns=1, timeout=0.5)
                for r in ready:
                    if r in probes:
                        a = probes.pop(r)
                        down[a].probe = None
                        try:
                            info = ray.get(r, timeout=60)
                        except lost:
                            lose(a)
                            continue
                        if info["error"]:
                            raise CortiqError(info["error"])
                        del down[a]
                        continue
                    a, t = inflight.pop(r)
                    load[a] -= 1
                    try:
                        part, rows, busy = ray.get(r, timeout=60)
                    except RayTaskError as e:
                        cause = e.cause if isinstance(getattr(e, "cause", None), BaseException) else e
                        raise CortiqError(f"window {t.index}: {str(cause).splitlines()[0][:300]}") from None
                    except lost as e:
                        attempts[t.index] = attempts.get(t.index, 0) + 1
                        if attempts[t.index] >= MAX_WINDOW_ATTEMPTS:
                            raise CortiqError(
                                f"window {t.index} lost its worker {attempts[t.index]} times "
                                f"({type(e).__name__}); is the cluster out of memory?"
                            ) from None
                        report.retried += 1
                        todo.appendleft(t)
                        lose(a)
                        continue
                    report.tokens += rows
                    report.busy_s += busy
                    on_result(t.index, part)
        finally:  # on Ctrl-C the windows in flight are dropped: leaving the cluster kills its workers
            report.seconds += time.perf_counter() - t0


# ---------------------------------------------------------------------------- the commands


class PlanOrder:
    """Results of windows 0..n-1 that arrive in any order, handed to ``combine`` in plan
    order as soon as every window before them has been: a result that arrives ahead of an
    earlier window is held until then, and only such results are held. Windows journaled by
    an earlier run (``journaled``: window -> where its record is) are read with ``read``
    when their turn comes, one at a time."""

    def __init__(
        self,
        n: int,
        combine: Callable[[Any], None],
        journaled: dict[int, Any] | None = None,
        read: Callable[[int, Any], Any] | None = None,
    ):
        self.n = n
        self._combine = combine
        self._journaled = dict(journaled or {})
        self._read = read
        self._done = np.zeros(n, dtype=bool)  # journaled or arrived
        self._done[list(self._journaled)] = True
        self.n_finished = len(self._journaled)
        self._held: dict[int, Any] = {}
        self.combined = 0  # windows 0..combined-1 went to combine
        self.held_max = 0

    @property
    def held(self) -> int:
        return len(self._held)

    def finished(self, i: int) -> bool:
        return bool(self._done[i])

    def add(self, i: int, value: Any) -> None:
        """Window ``i``'s result (once: a duplicate is the caller's to drop)."""
        if self._done[i]:
            raise ValueError(f"window {i} is already finished")
        self._done[i] = True
        self.n_finished += 1
        self._held[i] = value
        self.held_max = max(self.held_max, len(self._held))
        self.advance()

    def advance(self) -> None:
        while self.combined < self.n:
            i = self.combined
            if i in self._held:
                value = self._held.pop(i)
            elif i in self._journaled:
                assert self._read is not None
                value = self._read(i, self._journaled.pop(i))
            else:
                return
            self._combine(value)
            self.combined += 1


def _run(
    kind: WindowKind,
    workers: Workers,
    tokens: np.ndarray,
    windows: list[Window],
    combine: Callable[[Any], None],
    key_extra: dict[str, Any],
    *,
    args: tuple[Any, ...] = (),
    refs: Iterator[RefRows] | None = None,
    resume: bool,
    progress: ClusterProgress | None,
) -> tuple[int, ClusterReport]:
    """Score ``windows`` on the cluster with ``kind``'s method, journaled under its name,
    and hand each window's result to ``combine`` in plan order, as soon as every window before
    it has been: the driver keeps only results that arrived ahead of an earlier window (at most
    AHEAD_PER_WORKER per worker beyond those in flight), never all of them. Returns (windows
    combined, the report). On Ctrl-C the windows combined are the first ones done in plan
    order; with none the interrupt goes on up.

    A task carries its window's tokens (a copy of the slice, freed when the task ends) and,
    with ``refs`` (one per window, read in plan order), its rows of a saved reference (a
    ``whole_text`` kind's tasks name one shared copy of the text instead)."""
    fps = [ModelFingerprint.of(Path(p).resolve()) for p in workers.paths]
    engines = {"ctx": workers.ctx, "kv_cache": workers.kv_cache, "chunk": workers.chunk}
    key = run_key(kind.name, fps, tokens, windows, {**engines, **key_extra})
    journal = WindowJournal(journal_dir() / f"{kind.name}-{key}.journal", key)
    n = len(windows)
    journaled = {i: at for i, at in journal.index().items() if i < n} if resume else {}
    report = ClusterReport(workers.where.address, 0, resumed=len(journaled))
    order = PlanOrder(n, combine, journaled, lambda i, at: kind.decode(i, journal.read(at)))
    ahead = AHEAD_PER_WORKER
    total_tokens = sum(w.n_scored for w in windows)
    done_tokens = sum(windows[i].n_scored for i in journaled)

    def tasks() -> Iterator[WindowTask]:
        shared = None
        for i, w in enumerate(windows):
            ref = next(refs) if refs is not None else None  # read for every window: the file is read in order
            if order.finished(i):
                continue
            if kind.whole_text:
                if shared is None:
                    import ray

                    shared = ray.put(tokens)
                ids: Any = shared
            else:
                ids = np.array(tokens[w.begin : w.end], dtype=np.int64)  # a copy of the window alone
            yield WindowTask(i, w, ids, ref)

    def on_result(i: int, value: Any) -> None:
        nonlocal done_tokens
        if order.finished(i):
            return  # a late duplicate of a retried window: counted once
        # First: a window counts once it is on disk (a Ctrl-C can cut the write short).
        journal.append(i, kind.encode(value))
        order.add(i, value)
        report.held_max = order.held_max
        done_tokens += windows[i].n_scored
        if progress:
            progress(
                order.n_finished,
                n,
                done_tokens,
                total_tokens,
                report.tokens / max(time.perf_counter() - t_start, 1e-9),
            )

    interrupted = False
    t_start = time.perf_counter()
    journal.open(keep=bool(journaled))
    try:
        order.advance()  # the journaled windows before the first one left
        if progress:
            progress(order.n_finished, n, done_tokens, total_tokens, float("nan"))
        if order.n_finished < n:
            with Cluster(workers, kind.load) as cl:
                report.workers = len(cl.actors)
                report.hosts = cl.hosts
                report.nodes = len(set(cl.nodes))
                report.startup_s = cl.startup_s
                ahead = AHEAD_PER_WORKER * max(report.workers, 1)
                t_start = time.perf_counter()
                try:
                    cl.score(tasks(), report, on_result, kind.method, args, admit=lambda: order.held < ahead)
                except KeyboardInterrupt:
                    interrupted = True
    except KeyboardInterrupt:
        interrupted = True
    finally:
        journal.close()

    if interrupted and not order.combined:
        raise KeyboardInterrupt
    if order.combined == n:
        journal.remove()
    return order.combined, report


def score_ppl(
    where: ClusterAddress,
    threads: int,
    paths: list[Path],
    ctx: int,
    kv_cache: str,
    chunk: int,
    names: list[str],
    tokens: np.ndarray,
    windows: list[Window],
    decoder: Any,
    *,
    saved: Any | None = None,
    resume: bool = False,
    progress: ClusterProgress | None = None,
) -> tuple[PerplexityResult, int, ClusterReport]:
    """``cortiq ppl``'s scoring on a cluster: (the figures, windows done in plan order, the
    cluster's report). On Ctrl-C the figures cover the first ``done`` windows, as in one
    process; the journal keeps every finished window for ``resume``."""
    tokens = np.asarray(tokens)  # as the driver holds them (int32 from the sharded tokenizer): no second copy
    # A saved reference's rows go out with their window, read in plan order as windows are handed out.
    refs = (saved.next_rows(w.n_scored) for w in windows) if saved is not None else None
    extra = {"ref": None if saved is None else [str(saved.path), ModelFingerprint.of(Path(saved.path)).digest]}
    acc = PerplexityAccumulator(len(paths), saved_ref=saved is not None)
    workers = Workers(where, threads, paths, ctx, kv_cache, chunk)
    done, report = _run(
        PPL, workers, tokens, windows, acc.add_partial, extra, refs=refs, resume=resume, progress=progress
    )
    form = saved.form if saved is not None else "full"
    reports, comps = build_reports(acc, names, scored_text_bytes(decoder, tokens, windows[:done]), form)
    return PerplexityResult(reports, comps), done, report


def collect_features(
    where: ClusterAddress,
    threads: int,
    path: Path,
    ctx: int,
    kv_cache: str,
    chunk: int,
    tokens: np.ndarray,
    windows: list[Window],
    grid: Any,
    *,
    resume: bool = False,
    progress: ClusterProgress | None = None,
) -> tuple[Any, int, ClusterReport]:
    """``cortiq calibrate``'s pass on a cluster: (the row features of the first ``done`` windows
    in plan order, as one process collects them; ``done``; the cluster's report)."""
    from evals.temperature import RowFeatures

    tokens = np.asarray(tokens)  # as the driver holds them (int32 from the sharded tokenizer): no second copy
    extra = {"temperatures": np.asarray(grid.temperatures, np.float64).tolist()}
    parts: list[Any] = []  # the fit needs every row, as in one process
    workers = Workers(where, threads, [path], ctx, kv_cache, chunk)
    done, report = _run(
        CALIBRATE, workers, tokens, windows, parts.append, extra, args=(grid,), resume=resume, progress=progress
    )
    return RowFeatures.concat(parts, grid), done, report


def collect_imatrix(
    where: ClusterAddress,
    threads: int,
    path: Path,
    tokens: np.ndarray,
    windows: list[Window],
    *,
    resume: bool = False,
    progress: ClusterProgress | None = None,
) -> tuple[Any, int, ClusterReport]:
    """``cortiq imatrix``'s pass on a cluster: (an ``ImatrixAccumulator`` holding the first
    ``done`` windows' partials added in plan order, as one process adds them; ``done``; the
    cluster's report). Each window's partial (an f64 sum per weight column) is journaled and
    added to the sum as soon as the windows before it are: the driver holds one running sum
    and the few partials that arrived early."""
    from cortiq_engine.imatrix import ImatrixAccumulator

    tokens = np.asarray(tokens)  # as the driver holds them (int32 from the sharded tokenizer): no second copy
    acc = ImatrixAccumulator()
    workers = Workers(where, threads, [path])
    done, report = _run(IMATRIX, workers, tokens, windows, acc.add, {}, resume=resume, progress=progress)
    return acc, done, report


def probe_mtp(
    where: ClusterAddress,
    threads: int,
    model: Path,
    sidecar: Path | None,
    ids: Sequence[int],
    depth: int,
    variants: Sequence[Any],
    *,
    vocab: str | None = None,
    threshold: float = 0.0,
    trace: bool = False,
    resume: bool = False,
    progress: ClusterProgress | None = None,
) -> tuple[list[tuple[Any, Any]], list[Any] | None, bool, ClusterReport]:
    """``cortiq mtp-probe`` on a cluster, in windows of rounds (``evals.mtp_probe.round_windows``):
    (per variant its ``Acceptance``, the windows' counts added in plan order; per variant its
    ``ProbeTrace`` when ``trace``; whether every window is done; the cluster's report). Every count
    and trace equals ``evals.mtp_probe.probe``'s; the draft seconds are the workers'."""
    from cortiq_engine.acceptance import Acceptance
    from evals.mtp_probe import ProbeTrace, round_windows

    tokens = np.asarray(ids, dtype=np.int64)
    if depth < 1:
        raise CortiqError(f"MTP depth must be >= 1, got {depth}")
    if len(tokens) < depth + 2:
        raise CortiqError(f"the text has {len(tokens)} tokens; probing depth {depth} needs at least {depth + 2}")
    # Every window feeds the whole text (the backbone rows must be those of one pass); its rows are its rounds.
    windows = [Window(0, len(tokens), a, b) for a, b in round_windows(len(tokens), depth)]
    spec = {
        "depth": depth,
        "variants": [(v.chain, v.hidden) for v in variants],
        "vocab": vocab,
        "threshold": threshold,
        "trace": trace,
    }
    counts = [Acceptance(depth) for _ in variants]
    got: list[list[Any]] = [[] for _ in variants]  # per variant, the windows' traces in round order

    def combine(p: Any) -> None:
        for i in range(len(variants)):
            counts[i].merge(p.counts[i])
            if trace:
                got[i].append(p.traces[i])

    workers = Workers(where, threads, [model] + ([sidecar] if sidecar is not None else []))
    done, report = _run(
        MTP_PROBE, workers, tokens, windows, combine, {"spec": spec}, args=(spec,), resume=resume, progress=progress
    )
    traces = None
    if trace:
        traces = [
            ProbeTrace(
                np.concatenate([t.probs for t in got[i]]).reshape(-1, depth),
                np.concatenate([t.right for t in got[i]]).reshape(-1, depth),
            )
            for i in range(len(variants))
        ]
    return list(zip(variants, counts)), traces, done == len(windows), report


__all__ = [
    "ClusterAddress",
    "ModelFingerprint",
    "WindowJournal",
    "WindowScorer",
    "Cluster",
    "ClusterReport",
    "PlanOrder",
    "WindowKind",
    "Workers",
    "score_ppl",
    "collect_features",
    "collect_imatrix",
    "probe_mtp",
    "journal_dir",
    "ray_available",
    "INSTALL_HINT",
    "run_key",
]
