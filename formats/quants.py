"""Tensor dtypes of CMF and their byte layouts.

Every dtype knows three things: how many bytes a tensor of a shape takes, how to
encode a float array into those bytes, and how to view the bytes in place (numpy
arrays over the memory map, no copy). Quantized dtypes are *planar*: each part of
a block (scales, mins, quants) is stored as its own contiguous array, each part
starting on a 64-byte boundary, so numpy and numba read them without unpacking.

Layouts (rows = product of all dims but the last, cols = the last dim, nb = cols / 32;
for a 2-D weight [out, in] that is rows = out, cols = in). Full spec: docs/cmf.md.

- ``f32``, ``f16``: IEEE little-endian, row-major.
- ``bf16``: the upper 16 bits of an f32 (round to nearest even), little-endian uint16, row-major.
- ``q8`` (llama.cpp Q8_0 semantics): ``d`` f16[rows, nb], then ``qs`` int8[rows, cols];
  value = d * q; per block of 32 the encoder picks d = f16(max|x| / k), k from
  ``Q8_DIVISORS``, with the least squared error, q = clip(round-half-away(x / d), +-127).
- ``q4`` (llama.cpp Q4_1 semantics): ``d`` f16[rows, nb], ``m`` f16[rows, nb], then
  ``qs`` uint8[rows, cols/2]; within a block of 32, byte j holds element j in its low
  nibble and element j+16 in its high nibble; value = d * q + m, q in 0..15.
- ``q5`` (llama.cpp Q5_0): ``d`` f16[rows, nb], ``qh`` uint32[rows, nb], ``qs`` uint8[rows, cols/2];
  value = d * (q - 16), q = nibble | fifth bit << 4.
- ``q5_1`` (llama.cpp Q5_1): ``d``, ``m`` f16[rows, nb], ``qh``, ``qs`` as q5; value = d * q + m.
- ``q4_0`` (llama.cpp Q4_0): ``d`` f16[rows, nb], ``qs`` uint8[rows, cols/2] (nibbles as q4);
  value = d * (q - 8); the encoder searches the scale.
- ``q6k``, ``q5k``, ``q4k`` (llama.cpp Q6_K, Q5_K, Q4_K): super-blocks of 256, the
  fields of ggml's block structs as planar parts (see the classes below).
- ``q3k`` (llama.cpp Q3_K, ``formats/q3_k.py``) and ``iq4_xs`` (llama.cpp IQ4_XS,
  ``formats/iq4_xs.py``): the same, each in its own module.
- ``u8``: raw bytes (embedded files such as tokenizer.json).

Each dtype is one ``DType`` subclass registered in ``DTYPES`` by its ``name``: it owns
its parts, encoder, decoder, the parts its kernels take (``kernel_parts``), the GGML
type whose blocks it can copy (``ggml_type``, ``dtype_for_ggml``), its other spellings
(``aliases``), whether its encoder takes an imatrix (``takes_imatrix``) and its row of
the dtype table (``table_row``). The engine's kernel module attaches its compiled
kernels (``register_kernels``), so code asks ``dt.has_int8_kernels`` and this module
imports no engine code. Nothing compares dtype names.

The q4 quantizer reproduces ggml's ``quantize_row_q4_1_ref`` (as mirrored by
``gguf.quants``) bit for bit; ``quantize_q8_ggml`` does the same for Q8_0, and the
default q8 encoder searches the scale (see ``Q8_DIVISORS``). Either q8 encoding
decodes with ggml's Q8_0 formula.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, ClassVar

import numpy as np

from formats.errors import CortiqError

ALIGN = 64
QBLOCK = 32


def align_up(n: int, a: int = ALIGN) -> int:
    return (n + a - 1) // a * a


def rows_cols(shape: tuple[int, ...]) -> tuple[int, int]:
    """(rows, cols) of a tensor seen as a matrix whose rows are its last dimension."""
    if len(shape) == 0:
        return 1, 1
    cols = int(shape[-1])
    rows = int(np.prod(shape[:-1])) if len(shape) > 1 else 1
    return rows, cols


# ---------------------------------------------------------------- bf16 helpers


def bf16_to_f32(u16: np.ndarray) -> np.ndarray:
    return (u16.astype(np.uint32) << 16).view(np.float32)


def f32_to_bf16(x: np.ndarray) -> np.ndarray:
    """Round-to-nearest-even, as torch does; NaN stays NaN."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounding = ((u >> 16) & 1) + np.uint32(0x7FFF)
    out = ((u + rounding) >> 16).astype(np.uint16)
    nan = np.isnan(x)
    if nan.any():
        out[nan] = 0x7FC0
    return out


# ---------------------------------------------------------------- quantizers


def _round_half_away(v: np.ndarray) -> np.ndarray:
    """C ``roundf`` in f32: exact (no ``trunc(v + 0.5)`` double rounding)."""
    a = np.abs(v)
    fl = np.floor(a)
    a -= fl  # exact: the fractional part
    a *= 2
    np.floor(a, out=a)
    a += fl
    return np.copysign(a, v, out=a)


def _inverse(d: np.ndarray) -> np.ndarray:
    return np.divide(np.float32(1), d, out=np.zeros_like(d), where=d != 0)


# The q8 encoder tries the integer divisors 127, 126, ..., 112 of max|x| per block and
# keeps the f16 scale whose encoding has the least squared error (in f32: value j of a
# block adds to partial sum j % 4 in order, the sums add as (s0 + s1) + (s2 + s3); a
# tie keeps the earlier divisor, 127 being ggml's choice). An integer divisor
# puts the largest value on a level, and weights that came from bf16 (few mantissa
# bits) then often land on levels exactly. Measured against ggml's single divisor 127:
# squared error x0.80 on N(0, 1) (RMS relative error 0.535% -> 0.478%) and x0.43 on
# SmolLM2's weights. Same bytes layout, same decoding: only the scale differs.
Q8_DIVISORS = np.arange(127, 111, -1).astype(np.float32)


def quantize_q8(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x: f32[rows, cols] -> (d f16[rows, nb], qs int8[rows, cols]); the searched scale."""
    rows, cols = x.shape
    b = np.asarray(x, dtype=np.float32).reshape(rows, cols // QBLOCK, QBLOCK)
    a = np.abs(b)
    amax = a.max(axis=2)
    best = np.zeros_like(amax)
    best_err = np.full(amax.shape, np.inf, np.float32)
    for div in Q8_DIVISORS:
        dd = (amax / div).astype(np.float16).astype(np.float32)  # the scale as stored
        q = np.minimum(np.floor(a * _inverse(dd)[:, :, None] + np.float32(0.49999997)), np.float32(127))
        e = a - q * dd[:, :, None]  # f32, as the compiled kernel computes it
        sums = np.zeros((4, *amax.shape), np.float32)
        for j in range(QBLOCK):  # the compiled kernel's order of f32 adds
            sums[j % 4] += e[:, :, j] * e[:, :, j]
        err = (sums[0] + sums[1]) + (sums[2] + sums[3])
        better = (err < best_err) & (dd != 0)
        best = np.where(better, dd, best)
        best_err = np.where(better, err, best_err)
    q = np.clip(_round_half_away(b * _inverse(best)[:, :, None]), -127, 127)
    return best.astype(np.float16), q.astype(np.int8).reshape(rows, cols)


def quantize_q8_ggml(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """ggml's ``quantize_row_q8_0_ref`` bit for bit: d = max|x| / 127."""
    rows, cols = x.shape
    b = np.asarray(x, dtype=np.float32).reshape(rows, cols // QBLOCK, QBLOCK)
    d = np.abs(b).max(axis=2) / np.float32(127)
    q = _round_half_away(b * _inverse(d)[:, :, None])
    return d.astype(np.float16), q.astype(np.int8).reshape(rows, cols)


def dequantize_q8(d: np.ndarray, qs: np.ndarray) -> np.ndarray:
    rows, cols = qs.shape
    b = qs.reshape(rows, cols // QBLOCK, QBLOCK).astype(np.float32)
    return (b * d.astype(np.float32)[:, :, None]).reshape(rows, cols)


def _ggml_affine(x: np.ndarray, nmax: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """ggml's Q4_1 (nmax = 15) and Q5_1 (31) reference levels: d = (max - min) / nmax and
    m = min, f32[rows, nb]; q = trunc((x - min) / d + 0.5) uint8[rows, nb, 32] (C's
    (uint8_t) cast: at most nmax + 0.5 -> nmax)."""
    rows, cols = x.shape
    b = np.asarray(x, dtype=np.float32).reshape(rows, cols // QBLOCK, QBLOCK)
    lo = b.min(axis=2)
    d = (b.max(axis=2) - lo) / np.float32(nmax)
    v = b - lo[:, :, None]
    v *= _inverse(d)[:, :, None]
    v += np.float32(0.5)
    return d, lo, np.trunc(v).astype(np.uint8)


def quantize_q4(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """x: f32[rows, cols] -> (d f16[rows, nb], m f16[rows, nb], qs uint8[rows, cols/2])."""
    rows, cols = x.shape
    d, lo, q = _ggml_affine(x, 15)
    q = q.clip(0, 15)
    packed = q[:, :, :16] | (q[:, :, 16:] << np.uint8(4))
    return d.astype(np.float16), lo.astype(np.float16), packed.reshape(rows, cols // 2)


def dequantize_q4(d: np.ndarray, m: np.ndarray, qs: np.ndarray) -> np.ndarray:
    rows = qs.shape[0]
    nb = d.shape[1]
    p = qs.reshape(rows, nb, 16)
    q = np.concatenate([p & 0x0F, p >> 4], axis=2).astype(np.float32)
    out = q * d.astype(np.float32)[:, :, None] + m.astype(np.float32)[:, :, None]
    return out.reshape(rows, nb * QBLOCK)


# ---------------------------------------------------------------- dtype registry


@dataclass(frozen=True)
class Part:
    """One planar array inside a tensor blob."""

    name: str
    dtype: np.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape)) * self.dtype.itemsize


DTYPES: dict[str, "DType"] = {}


class DType:
    """One CMF dtype: its planar byte layout, encoder, decoder and the arrays its kernels take.

    Each dtype is a subclass that names itself (``name = "q8"``) and so registers one
    instance in ``DTYPES`` (gguf-py's ``quants.py`` shape): code asks the dtype, it
    never compares dtype names.
    """

    name: ClassVar[str]
    quantized: ClassVar[bool] = False
    # Elements per block along the last dim (a quantized tensor's last dim is a multiple).
    block: ClassVar[int] = 1
    # Stored as f32: kernels multiply by the stored array in place, nothing to decode.
    native: ClassVar[bool] = False
    # Can be a weight matrix of the engine (u8 blobs cannot).
    matrix: ClassVar[bool] = True
    # The parts a kernel takes, in its argument order.
    kernel_parts: ClassVar[tuple[str, ...]] = ("data",)
    # Bits per weight, scales included (docs/cmf.md; the policy presets quote them).
    bits: ClassVar[float] = 32.0
    # The GGML block type holding exactly these bytes (interleaved), for block copies.
    ggml_type: ClassVar[str | None] = None
    # The dtype a tensor gets when its shape does not fit this one (llama.cpp's choice).
    fallback: ClassVar[str] = "f16"
    # Other spellings a user may type (llama.cpp's lower-case GGML type name).
    aliases: ClassVar[tuple[str, ...]] = ()
    # The encoder weights its error by an imatrix entry (``encode``'s ``importance``).
    takes_imatrix: ClassVar[bool] = False
    # One line for the dtype tables (``table_row``, docs/cmf.md).
    summary: ClassVar[str] = ""

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        if "name" in cls.__dict__:
            DTYPES[cls.name] = cls()

    def __init__(self) -> None:
        self._kernels: object | None = None

    def __repr__(self) -> str:
        return f"DType({self.name!r})"

    # ------------------------------------------------------------ kernels
    def register_kernels(self, ops: object) -> None:
        """Attach the engine's compiled operations of this dtype (its ``DtypeOps``
        record: matmul, dequantize and the integer kernels' capabilities); the kernel
        module calls this once, when it registers the record."""
        self._kernels = ops

    @property
    def kernels(self) -> object | None:
        """The engine's kernel record of this dtype, or None before the engine loaded it."""
        return self._kernels

    @property
    def has_int8_kernels(self) -> bool:
        """Decode and verify multiply on integer activations (qdot.py) for this dtype."""
        return bool(getattr(self._kernels, "int_widths", ()))

    @property
    def has_tile_kernels(self) -> bool:
        """Prefill multiplies on integer tile products (amx.py) for this dtype."""
        return bool(getattr(self._kernels, "tiles", False))

    def table_row(self) -> tuple[str, str, str, str, str]:
        """(name, GGML type, bits per weight, imatrix, summary): the dtype tables' row."""
        return (
            self.name,
            self.ggml_type or "",
            f"{self.bits:g}",
            "yes" if self.takes_imatrix else "",
            self.summary or (self.__doc__ or "").strip().splitlines()[0],
        )

    # ------------------------------------------------------------ layout
    def parts(self, shape: tuple[int, ...]) -> list[Part]:
        raise NotImplementedError

    def nbytes(self, shape: tuple[int, ...]) -> int:
        """Blob size: parts laid end to end, each padded to ALIGN except the last."""
        parts = self.parts(shape)
        total = 0
        for i, p in enumerate(parts):
            total += p.nbytes if i == len(parts) - 1 else align_up(p.nbytes)
        return total

    def supports(self, shape: tuple[int, ...]) -> bool:
        return True

    @property
    def requirement(self) -> str:
        """What ``supports`` asks of a shape, for error messages."""
        return "any shape"

    def named(self, parts: list[np.ndarray], shape: tuple[int, ...]) -> dict[str, np.ndarray]:
        """The encoder's ordered parts as the name -> array dict ``decode`` takes."""
        return {p.name: a.reshape(p.shape) for p, a in zip(self.parts(shape), parts)}

    def view(self, buf: memoryview | np.ndarray, offset: int, shape: tuple[int, ...]) -> dict[str, np.ndarray]:
        """Zero-copy planar arrays over ``buf`` (a uint8 array) starting at ``offset``."""
        out = {}
        pos = offset
        for p in self.parts(shape):
            count = int(np.prod(p.shape))
            out[p.name] = np.frombuffer(buf, dtype=p.dtype, count=count, offset=pos).reshape(p.shape)
            pos += align_up(p.nbytes)
        return out

    def matrix_parts(self, rows: int, cols: int) -> dict[str, tuple[int, ...]]:
        """Part name -> shape of a [rows, cols] matrix (what ``Weight`` checks)."""
        return {p.name: p.shape for p in self.parts((rows, cols))}

    def _typed(self, parts: dict[str, np.ndarray], shape: tuple[int, ...]) -> dict[str, np.ndarray]:
        """Parts as their declared numpy dtypes (the engine keeps f16 as uint16 bits)."""
        want = {p.name: p.dtype for p in self.parts(shape)}
        return {k: v.view(want[k]) if v.dtype != want[k] else v for k, v in parts.items()}

    # ------------------------------------------------------------ numbers
    def encode(self, x: np.ndarray, importance: np.ndarray | None = None) -> list[np.ndarray]:
        """Float array -> the planar arrays to write, in order.

        Rows are independent, so encoding a tensor's rows in slices and
        concatenating each part gives the same bytes (the converter streams so).
        ``importance`` (f32 [cols], an imatrix entry) weights the error the
        encoder minimizes, where its dtype searches (the K-quants); others ignore it.
        """
        shape = tuple(x.shape)
        # Values beyond f16's range become inf here; the converter checks and names them.
        with np.errstate(over="ignore"):
            return self._encode(np.ascontiguousarray(x, dtype=np.float32), shape, importance)

    def _encode(self, x32: np.ndarray, shape: tuple[int, ...], importance: np.ndarray | None) -> list[np.ndarray]:
        raise NotImplementedError

    def decode(self, parts: dict[str, np.ndarray], shape: tuple[int, ...]) -> np.ndarray:
        """Planar arrays -> f32 array of ``shape`` (a copy)."""
        return self._decode(self._typed(parts, shape), shape)

    def _decode(self, parts: dict[str, np.ndarray], shape: tuple[int, ...]) -> np.ndarray:
        raise NotImplementedError

    # Whether ``encode_measured`` takes NaN and infinities (they show as a sum of squared
    # values that is not finite), so that a caller need not check ``x`` first.
    measures_nonfinite: ClassVar[bool] = False

    def encode_measured(
        self, x: np.ndarray, importance: np.ndarray | None = None, into: list[np.ndarray] | None = None
    ) -> tuple[list[np.ndarray], float, float]:
        """``encode`` and ``error`` together: (the parts, sum of squared errors, sum of
        squared values). With ``into`` (arrays of the parts' shapes for ``x``: a row slice
        of a tensor's parts) the parts are written there and ``into`` is returned."""
        parts = self.encode(x, importance)
        e, ref = self.error(x, parts)
        if into is None:
            return parts, e, ref
        for buf, part in zip(into, parts):
            buf[...] = part.reshape(buf.shape)
        return into, e, ref

    def error(self, x: np.ndarray, parts: list[np.ndarray]) -> tuple[float, float]:
        """(sum of squared errors, sum of squared values), in f64, of ``x`` encoded as ``parts``.

        Either sum is inf or NaN when ``x`` or its decoding is not finite.
        """
        shape = tuple(x.shape)
        x32 = np.ascontiguousarray(x, dtype=np.float32)
        with np.errstate(over="ignore", invalid="ignore"):
            e = (self.decode(self.named(parts, shape), shape) - x32).astype(np.float64).ravel()
            ref = x32.astype(np.float64).ravel()
            return float(e @ e), float(ref @ ref)


class _Dense(DType):
    """One array of the tensor's shape, row-major."""

    store: ClassVar[np.dtype]

    def parts(self, shape: tuple[int, ...]) -> list[Part]:
        return [Part("data", self.store, tuple(int(s) for s in shape))]


class F32(_Dense):
    """IEEE single, little-endian."""

    name = "f32"
    store = np.dtype("<f4")
    native = True

    def _encode(self, x32, shape, importance):
        return [x32.reshape(-1)]

    def _decode(self, parts, shape):
        return np.array(parts["data"], dtype=np.float32).reshape(shape)


class F16(_Dense):
    """IEEE half, little-endian."""

    name = "f16"
    store = np.dtype("<f2")
    bits = 16.0

    def _encode(self, x32, shape, importance):
        return [x32.astype(np.float16).reshape(-1)]

    def _decode(self, parts, shape):
        return parts["data"].astype(np.float32).reshape(shape)


class BF16(_Dense):
    """The upper 16 bits of an f32 (round to nearest even), little-endian uint16."""

    name = "bf16"
    store = np.dtype("<u2")
    bits = 16.0

    def _encode(self, x32, shape, importance):
        return [f32_to_bf16(x32).reshape(-1)]

    def _decode(self, parts, shape):
        return bf16_to_f32(parts["data"]).reshape(shape)


class _Raw(_Dense):
    """Values stored as they are, read back as they are: data, not a weight matrix."""

    matrix = False

    def _decode(self, parts, shape):
        return np.array(parts["data"]).reshape(shape)


class U8(_Raw):
    """Raw bytes (embedded files such as tokenizer.json)."""

    name = "u8"
    store = np.dtype("u1")
    bits = 8.0

    def encode(self, x: np.ndarray, importance: np.ndarray | None = None) -> list[np.ndarray]:
        return [np.ascontiguousarray(x, dtype=np.uint8).reshape(-1)]


class I32(_Raw):
    """Signed 32-bit integers, little-endian (id tables such as an MTP draft vocabulary)."""

    name = "i32"
    store = np.dtype("<i4")
    bits = 32.0

    def encode(self, x: np.ndarray, importance: np.ndarray | None = None) -> list[np.ndarray]:
        a = np.asarray(x)
        if a.dtype.kind not in "iu":
            raise CortiqError(f"i32 holds integers, got {a.dtype}")
        if a.size and (int(a.min()) < -(2**31) or int(a.max()) >= 2**31):
            raise CortiqError("i32 value out of the 32-bit range")
        return [np.ascontiguousarray(a, dtype="<i4").reshape(-1)]


class Blocked(DType):
    """A quantized dtype: blocks of ``block`` elements along the last dim, stored
    planar: each field of a block (scale, min, quants...) is its own array
    [rows, blocks * per-block count], in the order of ``fields``."""

    quantized = True
    block = QBLOCK
    # (part name, numpy dtype, values per block), in the GGML block's own order so a
    # GGML block splits into the parts at fixed byte offsets (``from_ggml``).
    fields: ClassVar[tuple[tuple[str, str, int], ...]]

    def parts(self, shape: tuple[int, ...]) -> list[Part]:
        rows, cols = rows_cols(shape)
        nb = cols // self.block
        return [Part(n, np.dtype(dt), (rows, nb * k)) for n, dt, k in self.fields]

    @property
    def block_bytes(self) -> int:
        return sum(np.dtype(dt).itemsize * k for _, dt, k in self.fields)

    def supports(self, shape: tuple[int, ...]) -> bool:
        return len(shape) >= 2 and int(shape[-1]) % self.block == 0

    @property
    def requirement(self) -> str:
        return f"2 or more dims, the last divisible by {self.block}"

    def encode(self, x: np.ndarray, importance: np.ndarray | None = None) -> list[np.ndarray]:
        shape = tuple(x.shape)
        if not self.supports(shape):
            raise CortiqError(
                f"{self.name} needs a tensor of 2 or more dims whose last dim is divisible by {self.block}, got shape {list(shape)}"
            )
        return super().encode(x, importance)

    def __init_subclass__(cls, **kwargs) -> None:
        # llama.cpp's lower-case type name is another spelling of the dtype (q8_0 -> q8).
        ggml = cls.__dict__.get("ggml_type")
        if ggml and ggml.lower() != cls.__dict__.get("name") and "aliases" not in cls.__dict__:
            cls.aliases = (ggml.lower(),)
        super().__init_subclass__(**kwargs)

    @property
    def kernel_parts(self) -> tuple[str, ...]:  # type: ignore[override]
        """Every part, in ``fields`` order: the kernels take a block's fields as they are."""
        return tuple(n for n, _, _ in self.fields)

    def _encode(self, x32, shape, importance):
        return list(self.encode_rows(x32.reshape(rows_cols(shape)), importance))

    def encode_rows(self, x2: np.ndarray, importance: np.ndarray | None = None) -> tuple[np.ndarray, ...]:
        """f32[rows, cols] -> the parts, in order; ``importance`` (f32[cols], per input
        column) weights the encoder's error where the dtype's search uses weights.

        The compiled encoder (``compiled_encoder``) fills the parts, which it takes by
        their field names; f16 parts are computed in f32 and rounded once here."""
        kernel, consts = self.compiled_encoder()
        x2 = np.ascontiguousarray(x2, dtype=np.float32)
        use = importance is not None
        imp = np.ascontiguousarray(importance, dtype=np.float32).reshape(-1) if use else np.zeros(1, np.float32)
        rows, cols = x2.shape
        nb = cols // self.block
        parts = {n: np.empty((rows, k * nb), np.float32 if dt == "<f2" else dt) for n, dt, k in self.fields}
        kernel(x2, imp, use, *consts, **parts)
        return tuple(a.astype(np.float16) if dt == "<f2" else a for a, (_, dt, _) in zip(parts.values(), self.fields))

    def compiled_encoder(self) -> tuple[Callable[..., None], tuple]:
        """(kernel, the constants it takes after x, importance and its flag)."""
        raise NotImplementedError

    def error(self, x, parts):
        """The compiled error meter ``formats.quant_kernels.NAME_error`` where the dtype has
        one (one pass, no decoded copy), else the decoding's."""
        meter = getattr(_kernels(), f"{self.name}_error", None)
        if meter is None:
            return super().error(x, parts)
        named = self.named(parts, tuple(x.shape))
        x2 = np.ascontiguousarray(x, np.float32).reshape(rows_cols(x.shape))
        return meter(x2, *(named[n] for n in self.kernel_parts))

    def _decode(self, parts, shape):
        return self.dequantize(*(parts[n] for n, _, _ in self.fields)).reshape(shape)

    def from_ggml(self, blocks: np.ndarray) -> list[np.ndarray]:
        """GGML blocks uint8[rows, nb, block_bytes] -> our parts, byte for byte."""
        rows, nb, size = blocks.shape
        assert size == self.block_bytes
        out = []
        pos = 0
        for _, dt, k in self.fields:
            n = np.dtype(dt).itemsize * k
            out.append(np.ascontiguousarray(blocks[:, :, pos : pos + n]).view(dt).reshape(rows, nb * k))
            pos += n
        return out

    def to_ggml(self, parts: dict[str, np.ndarray]) -> np.ndarray:
        """Our parts -> GGML blocks uint8[rows, nb, block_bytes] (tests; gguf-py decodes them)."""
        first = parts[self.fields[0][0]]
        rows = first.shape[0]
        nb = first.shape[1] // self.fields[0][2]
        return np.concatenate(
            [np.ascontiguousarray(parts[n]).view(np.uint8).reshape(rows, nb, -1) for n, _, _ in self.fields], axis=2
        )


class _OnePass(Blocked):
    """q8 and q4: the compiled encoder (``formats.quant_kernels.quantize_NAME``), the
    numpy reference where numba is missing."""

    measures_nonfinite = True

    def encode_rows(self, x2, importance=None):
        return getattr(_kernels() or _reference, f"quantize_{self.name}")(x2)

    def encode_measured(self, x, importance=None, into=None):
        """The compiled encoder measures as it encodes: one pass over ``x``."""
        kernels = _kernels()
        shape = tuple(x.shape)
        if kernels is None or not self.supports(shape):
            return super().encode_measured(x, importance, into)
        x2 = np.ascontiguousarray(x, dtype=np.float32).reshape(rows_cols(shape))
        with np.errstate(over="ignore"):  # a scale beyond f16's range: the converter names it
            return getattr(kernels, f"quantize_{self.name}_measured")(x2, into)


class Q8(_OnePass):
    """llama.cpp Q8_0 semantics: ``d`` f16[rows, nb], ``qs`` int8[rows, cols]; value = d * q;
    per block of 32 the encoder picks d = f16(max|x| / k), k from ``Q8_DIVISORS``, with
    the least squared error, q = clip(round-half-away(x / d), +-127)."""

    name = "q8"
    fields = (("d", "<f2", 1), ("qs", "i1", QBLOCK))
    bits = 8.5
    ggml_type = "Q8_0"
    dequantize = staticmethod(dequantize_q8)


class Q4(_OnePass):
    """llama.cpp Q4_1 semantics: ``d``, ``m`` f16[rows, nb], ``qs`` uint8[rows, cols/2];
    within a block of 32, byte j holds element j in its low nibble and element j+16
    in its high nibble; value = d * q + m, q in 0..15."""

    name = "q4"
    fields = (("d", "<f2", 1), ("m", "<f2", 1), ("qs", "u1", QBLOCK // 2))
    bits = 5.0
    ggml_type = "Q4_1"
    dequantize = staticmethod(dequantize_q4)


def _ggml_symmetric(x: np.ndarray, half: int) -> tuple[np.ndarray, np.ndarray]:
    """ggml's Q4_0 (half = 8) and Q5_0 (16) reference levels: d = (the signed max-|x|
    value) / -half f32[rows, nb], q = min(2 half - 1, trunc(x / d + half + 0.5))
    uint8[rows, nb, 32]."""
    rows, cols = x.shape
    b = np.asarray(x, dtype=np.float32).reshape(rows, cols // QBLOCK, QBLOCK)
    idx = np.abs(b).argmax(axis=2)[:, :, None]  # the first largest |x|, as ggml's strict <
    mx = np.take_along_axis(b, idx, axis=2)[:, :, 0]
    d = mx / np.float32(-half)
    v = b * _inverse(d)[:, :, None]
    v += np.float32(half + 0.5)
    q = np.minimum(np.trunc(v).astype(np.int8), 2 * half - 1).astype(np.uint8)  # C's (int8_t) cast truncates
    return d, q


def quantize_q5(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """ggml's ``quantize_row_q5_0_ref`` bit for bit: x f32[rows, cols] -> (d f16[rows, nb],
    qh uint32[rows, nb], qs uint8[rows, cols/2]); d = -(the signed max-|x| value) / 16."""
    rows, cols = x.shape
    d, q = _ggml_symmetric(x, 16)
    packed = (q[:, :, :16] & 0x0F) | ((q[:, :, 16:] & 0x0F) << np.uint8(4))
    bits = ((q >> np.uint8(4)) & 1).astype(np.uint32) << np.arange(32, dtype=np.uint32)
    return d.astype(np.float16), bits.sum(axis=2, dtype=np.uint32), packed.reshape(rows, cols // 2)


def dequantize_q5(d: np.ndarray, qh: np.ndarray, qs: np.ndarray) -> np.ndarray:
    """value = d * (q - 16), q = nibble | bit << 4 (element j: low nibble of byte j and bit
    j of qh; element j + 16: high nibble of byte j and bit j + 16)."""
    rows = qs.shape[0]
    nb = d.shape[1]
    p = qs.reshape(rows, nb, 16)
    lo = np.concatenate([p & 0x0F, p >> 4], axis=2)
    hi = ((qh.reshape(rows, nb, 1) >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8) << np.uint8(4)
    q = (lo | hi).astype(np.int8) - np.int8(16)
    return (d.astype(np.float32)[:, :, None] * q.astype(np.float32)).reshape(rows, nb * QBLOCK)


class _Searched32(Blocked):
    """A block of 32 whose scale (and min) the compiled encoder searches
    (``formats.kquant_kernels.rows32``): ``levels`` is the range of its stored levels."""

    takes_imatrix = True
    levels: ClassVar[tuple[int, int]]

    def compiled_encoder(self):
        from formats.kquant_kernels import rows32, sym_divisors

        return rows32, (sym_divisors(*self.levels), *self.levels)


class Q5(_Searched32):
    """llama.cpp Q5_0 semantics: ``d`` f16[rows, nb], ``qh`` uint32[rows, nb] (the fifth
    bits), ``qs`` uint8[rows, cols/2] (nibbles as q4); value = d * (q - 16), q in 0..31:
    22 bytes per 32 values = 5.5 bits/weight. The K-quants fall back to it (as
    llama.cpp's do) where a row is not a multiple of 256. Without an imatrix the bytes
    are ggml's reference encoder's; with one, the scale is searched as q4_0's."""

    name = "q5"
    fields = (("d", "<f2", 1), ("qh", "<u4", 1), ("qs", "u1", QBLOCK // 2))
    bits = 5.5
    ggml_type = "Q5_0"
    levels = (-16, 15)
    dequantize = staticmethod(dequantize_q5)

    def encode_rows(self, x2, importance=None):
        return quantize_q5(x2) if importance is None else super().encode_rows(x2, importance)


def quantize_q5_1_ggml(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """ggml's ``quantize_row_q5_1_ref`` bit for bit: x f32[rows, cols] -> (d f16[rows, nb],
    m f16[rows, nb], qh uint32[rows, nb], qs uint8[rows, cols/2]); d = (max - min) / 31,
    m = min, q = trunc((x - min) / d + 0.5)."""
    rows, cols = x.shape
    d, lo, q = _ggml_affine(x, 31)
    packed = (q[:, :, :16] & 0x0F) | ((q[:, :, 16:] & 0x0F) << np.uint8(4))
    bits = ((q >> np.uint8(4)) & 1).astype(np.uint32) << np.arange(32, dtype=np.uint32)
    return (
        d.astype(np.float16),
        lo.astype(np.float16),
        bits.sum(axis=2, dtype=np.uint32),
        packed.reshape(rows, cols // 2),
    )


def dequantize_q5_1(d: np.ndarray, m: np.ndarray, qh: np.ndarray, qs: np.ndarray) -> np.ndarray:
    """value = d * q + m, q = nibble | bit << 4 (bits and nibbles placed as q5's)."""
    rows = qs.shape[0]
    nb = d.shape[1]
    p = qs.reshape(rows, nb, 16)
    lo = np.concatenate([p & 0x0F, p >> 4], axis=2)
    hi = ((qh.reshape(rows, nb, 1) >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8) << np.uint8(4)
    q = (lo | hi).astype(np.float32)
    out = d.astype(np.float32)[:, :, None] * q + m.astype(np.float32)[:, :, None]
    return out.reshape(rows, nb * QBLOCK)


class Q5_1(_Searched32):
    """llama.cpp Q5_1 semantics: ``d``, ``m`` f16[rows, nb], ``qh`` uint32[rows, nb] (the
    fifth bits), ``qs`` uint8[rows, cols/2] (nibbles as q4); value = d * q + m, q in
    0..31: 24 bytes per 32 values = 6.0 bits/weight. q5k falls back to it (as
    llama.cpp's Q5_K does) where a row is not a multiple of 256. The encoder searches
    scale and min (``formats.kquant_kernels.rows32``), ggml's reference choice
    among the candidates, by squared error or, with an imatrix, importance-weighted
    error; ``quantize_q5_1_ggml`` is ggml's reference encoder bit for bit."""

    name = "q5_1"
    fields = (("d", "<f2", 1), ("m", "<f2", 1), ("qh", "<u4", 1), ("qs", "u1", QBLOCK // 2))
    bits = 6.0
    ggml_type = "Q5_1"
    levels = (0, 31)
    dequantize = staticmethod(dequantize_q5_1)


def quantize_q4_0_ggml(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """ggml's ``quantize_row_q4_0_ref`` bit for bit: x f32[rows, cols] -> (d f16[rows, nb],
    qs uint8[rows, cols/2]); d = -(the signed max-|x| value) / 8, q = min(15, trunc(x / d + 8.5))."""
    rows, cols = x.shape
    d, q = _ggml_symmetric(x, 8)
    packed = q[:, :, :16] | (q[:, :, 16:] << np.uint8(4))
    return d.astype(np.float16), packed.reshape(rows, cols // 2)


def dequantize_q4_0(d: np.ndarray, qs: np.ndarray) -> np.ndarray:
    """value = d * (q - 8); element j of a block in the low nibble of byte j, j + 16 in its high nibble."""
    rows = qs.shape[0]
    nb = d.shape[1]
    p = qs.reshape(rows, nb, 16)
    q = np.concatenate([p & 0x0F, p >> 4], axis=2).astype(np.int8) - np.int8(8)
    return (d.astype(np.float32)[:, :, None] * q.astype(np.float32)).reshape(rows, nb * QBLOCK)


class Q4_0(_Searched32):
    """llama.cpp Q4_0 semantics: ``d`` f16[rows, nb], ``qs`` uint8[rows, cols/2] (nibbles as
    q4); value = d * (q - 8), q in 0..15: 18 bytes per 32 values = 4.5 bits/weight, for
    rows no K-quant fits. The encoder searches the scale (``formats.kquant_kernels``):
    ggml's choice and scalings of it, least weighted squared error, ``--imatrix`` aware."""

    name = "q4_0"
    fields = (("d", "<f2", 1), ("qs", "u1", QBLOCK // 2))
    bits = 4.5
    ggml_type = "Q4_0"
    levels = (-8, 7)
    dequantize = staticmethod(dequantize_q4_0)


# ---------------------------------------------------------------- K-quants
# ggml's super-block types, byte for byte (QK_K = 256 values per super-block); the
# planar parts are the fields of ggml's block_q{4,5,6}_K in struct order. Decoding
# follows gguf-py's numpy (the same f32 operations), so it matches it bit for bit.

QK_K = 256


class SuperBlocked(Blocked):
    """A super-block type (256 values): every one searches its scales, imatrix-aware."""

    block = QK_K
    takes_imatrix = True


def _k4_scale_min(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """12 packed bytes per super-block -> the eight 6-bit scales and mins, f32 [n, 8]."""
    s = scales.reshape(-1, 3, 4)
    d, m, md = s[:, 0], s[:, 1], s[:, 2]
    sc = np.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc.astype(np.float32), mn.astype(np.float32)


def _k4_nibbles(qs: np.ndarray, n: int) -> np.ndarray:
    """The low nibbles, u8 [n, 8, 32]: sub-block 2k in the low nibbles of bytes 32k..32k+31, 2k+1 in the high."""
    q = qs.reshape(n, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
    return (q & np.uint8(0x0F)).reshape(n, 8, 32)


def _k4_values(d, dmin, scales, q: np.ndarray, rows: int) -> np.ndarray:
    """value = (d * sc) * q - dmin * m for the quants ``q`` [n, 8, 32] of Q4_K / Q5_K."""
    n = d.size
    sc, mn = _k4_scale_min(scales)
    dl = (d.reshape(n, 1).astype(np.float32) * sc).reshape(n, 8, 1)
    ml = (dmin.reshape(n, 1).astype(np.float32) * mn).reshape(n, 8, 1)
    return (dl * q.astype(np.float32) - ml).reshape(rows, -1)


def dequantize_q4k(d, dmin, scales, qs) -> np.ndarray:
    return _k4_values(d, dmin, scales, _k4_nibbles(qs, d.size), qs.shape[0])


def dequantize_q5k(d, dmin, scales, qh, qs) -> np.ndarray:
    """Q4_K's scales and low nibbles, plus a fifth bit per value: bit 2k (sub-block 2k) and
    2k+1 (sub-block 2k+1) of qh[l] belong to element l of those sub-blocks."""
    hi = qh.reshape(d.size, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)
    q = _k4_nibbles(qs, d.size) | ((hi & np.uint8(1)) << np.uint8(4))
    return _k4_values(d, dmin, scales, q, qs.shape[0])


def dequantize_q6k(ql, qh, scales, d) -> np.ndarray:
    """value = (d * scale) * (q - 32), a signed 8-bit scale per 16 values; per 128-value
    half, ql holds the low nibbles of elements l, l+32 (low) and l+64, l+96 (high),
    qh[l] their top two bits at shifts 0, 2, 4, 6."""
    rows = ql.shape[0]
    n = d.size
    dl = (d.reshape(n, 1).astype(np.float32) * scales.reshape(n, 16).astype(np.float32)).reshape(n, 16, 1)
    lo = ql.reshape(n, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
    lo = (lo & np.uint8(0x0F)).reshape(n, 2, 4, 32)
    hi = qh.reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)
    hi = (hi & np.uint8(0x03)).reshape(n, 2, 4, 32)
    q = (lo | (hi << np.uint8(4))).astype(np.int8) - np.int8(32)
    return (dl * q.reshape(n, 16, 16).astype(np.float32)).reshape(rows, -1)


class Q6K(SuperBlocked):
    """ggml Q6_K: 6-bit values in 16 groups of 16, an 8-bit scale per group, one f16
    super-scale: 210 bytes per 256 values = 6.5625 bits/weight."""

    name = "q6k"
    fields = (("ql", "u1", 128), ("qh", "u1", 64), ("scales", "i1", 16), ("d", "<f2", 1))
    bits = 6.5625
    ggml_type = "Q6_K"
    fallback = "q8"
    dequantize = staticmethod(dequantize_q6k)

    def compiled_encoder(self):
        from formats.kquant_kernels import q6k_rows

        return q6k_rows, ()


class _Qkx(SuperBlocked):
    """Q5_K and Q4_K: ggml's scale-and-min search (``formats.kquant_kernels.qkx_rows``),
    with ``search`` = (largest level, first step, step size, steps)."""

    search: ClassVar[tuple[int, np.float32, np.float32, int]]

    def compiled_encoder(self):
        from formats.kquant_kernels import qkx_rows

        return qkx_rows, self.search


class Q5K(_Qkx):
    """ggml Q5_K: 5-bit values in 8 groups of 32, 6-bit scale and min per group, f16
    super-scale and super-min: 176 bytes per 256 values = 5.5 bits/weight."""

    name = "q5k"
    fields = (("d", "<f2", 1), ("dmin", "<f2", 1), ("scales", "u1", 12), ("qh", "u1", 32), ("qs", "u1", 128))
    bits = 5.5
    ggml_type = "Q5_K"
    fallback = "q5_1"
    dequantize = staticmethod(dequantize_q5k)
    search = (31, np.float32(-0.5), np.float32(0.1), 15)


class Q4K(_Qkx):
    """ggml Q4_K: 4-bit values in 8 groups of 32, 6-bit scale and min per group, f16
    super-scale and super-min: 144 bytes per 256 values = 4.5 bits/weight."""

    name = "q4k"
    fields = (("d", "<f2", 1), ("dmin", "<f2", 1), ("scales", "u1", 12), ("qs", "u1", 128))
    bits = 4.5
    ggml_type = "Q4_K"
    fallback = "q5"
    dequantize = staticmethod(dequantize_q4k)
    search = (15, np.float32(-1.0), np.float32(0.1), 20)


class _Reference:
    quantize_q8 = staticmethod(quantize_q8)
    quantize_q4 = staticmethod(quantize_q4)


_reference = _Reference()


def _kernels():
    """The compiled quantizers (formats.quant_kernels), or None without numba."""
    try:
        from formats import quant_kernels
    except ImportError:  # pragma: no cover - numba is a dependency
        return None
    return quant_kernels


def dtype_for_ggml(ggml_type: str) -> DType | None:
    """The dtype whose parts are exactly the blocks of GGML type ``ggml_type`` (a block
    copy keeps them bit for bit), or None."""
    for dt in DTYPES.values():
        if dt.ggml_type == ggml_type:
            return dt
    return None


def resolve_dtype(name: str) -> DType:
    """A dtype as a user spells it: its name or an alias (llama.cpp's ``q8_0``, ``q6_k``)."""
    key = name.strip().lower()
    for dt in DTYPES.values():
        if key == dt.name or key in dt.aliases:
            return dt
    return get_dtype(key)


def get_dtype(name: str) -> DType:
    try:
        return DTYPES[name]
    except KeyError:
        raise CortiqError(f"unknown dtype {name!r}; known: {', '.join(DTYPES)}") from None


# Dtypes in their own modules register on import (they subclass ``Blocked`` above).
from formats import iq4_xs as _iq4_xs, q3_k as _q3_k  # noqa: E402,F401
