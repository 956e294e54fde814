"""Which CMF dtype each tensor gets when a checkpoint is converted: ``--quant`` presets."""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Callable
from dataclasses import dataclass, field

from formats.errors import CortiqError
from formats.imatrix import Imatrix
from formats.quants import DTYPES, get_dtype

EMBED_NAMES = ("model.embed_tokens.weight", "lm_head.weight")
# Routers decide discrete choices from tiny matrices: keep them exact. So are the
# Gated DeltaNet depthwise conv kernels (a few values per channel).
_EXACT_SUFFIXES = (".mlp.gate.weight", ".shared_expert_gate.weight", ".linear_attn.conv1d.weight")
# The matrices whose errors cost the most (llama.cpp's Q4_K_M / Q5_K_M give them more bits).
_MORE_SUFFIXES = {".self_attn.v_proj.weight": "v", ".mlp.down_proj.weight": "down"}
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
FALLBACK_DTYPE = "f16"
MATRIX_DTYPES = tuple(n for n, d in DTYPES.items() if d.matrix)


@dataclass(frozen=True)
class Site:
    """Where an attention V or FFN down matrix sits, as llama.cpp's type rules read it."""

    kind: str  # "v" or "down"
    layer: int | None  # None: not under model.layers.N
    layers: int  # the model's layer count (0: unknown)
    gqa: int  # query heads per KV head (0: unknown)
    imatrix: bool  # the encoders have importance weights


@dataclass(frozen=True)
class MoreRule:
    """Which V / FFN down matrices a mixed preset gives its ``more`` dtype."""

    text: str  # as ``--quant``'s help says it
    test: Callable[[Site], bool]


def use_more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's choice of layers for the extra bits of its _M mixes."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


# llama.cpp's Q4_K_M / Q5_K_M: V and down of the first and last eighth of the layers and
# every third in between (every layer when the count is unknown).
K_M_LAYERS = MoreRule(
    "V/down of 1/3+ of layers",
    lambda s: s.layer is None or s.layers <= 0 or use_more_bits(s.layer, s.layers),
)
# llama.cpp's IQ4_XS / IQ4_NL: V where four or more query heads share a KV head (its
# rows serve them all), down of the first eighth of the layers when no imatrix guides
# the encoder.
IQ4_SITES = MoreRule(
    "V where 4+ heads share a KV head, down of the first 1/8 of layers without --imatrix",
    lambda s: s.gqa >= 4 if s.kind == "v" else not s.imatrix and s.layer is not None and s.layer < s.layers // 8,
)


@dataclass(frozen=True)
class Recipe:
    """A ``--quant`` preset: the dtype of most matrices, of the embeddings and lm_head,
    and (mixed presets) of the attention V and FFN down matrices its ``where`` rule
    picks, as llama.cpp's file type of the same name does."""

    name: str
    base: str
    embed: str
    more: str | None = None
    where: MoreRule = K_M_LAYERS

    def describe(self) -> str:
        parts = [f"{self.base} ({get_dtype(self.base).bits:g} b/w)"]
        if self.embed != self.base:
            parts.append(f"embeddings/lm_head {self.embed}")
        if self.more:
            parts.append(f"{self.where.text} {self.more}")
        return ", ".join(parts)


RECIPES: dict[str, Recipe] = {
    r.name: r
    for r in (
        Recipe("q8", "q8", "q8"),
        Recipe("q6k", "q6k", "q6k"),
        Recipe("q5km", "q5k", "q6k", more="q6k"),
        Recipe("q5k", "q5k", "q6k"),
        Recipe("q5", "q5", "q8"),
        Recipe("q4", "q4", "q8"),
        Recipe("q4km", "q4k", "q6k", more="q6k"),
        Recipe("q4k", "q4k", "q6k"),
        # llama.cpp's Q4_0 file: Q4_0 everywhere, the output / tied embeddings Q6_K (Q8_0
        # where a row is not a multiple of 256, the q6k fallback)
        Recipe("q4_0", "q4_0", "q6k"),
        # llama.cpp's IQ4_XS / IQ4_NL files: the type everywhere but Q5_K at its IQ4 sites,
        # the output / tied embeddings Q6_K
        Recipe("iq4_xs", "iq4_xs", "q6k", more="q5k", where=IQ4_SITES),
        Recipe("iq4_nl", "iq4_nl", "q6k", more="q5k", where=IQ4_SITES),
        # llama.cpp's Q3_K_S file: the type everywhere, the output / tied embeddings Q6_K
        Recipe("q3k", "q3k", "q6k"),
        Recipe("f16", "f16", "f16"),
        Recipe("bf16", "bf16", "bf16"),
        Recipe("f32", "f32", "f32"),
    )
}
QUANT_CHOICES = tuple(RECIPES)
# A single-dtype preset also answers to its dtype's aliases (q3_k -> q3k).
QUANT_ALIASES = {
    a: r.name for r in RECIPES.values() if r.name == r.base for a in get_dtype(r.base).aliases if a not in RECIPES
}


def quant_help() -> str:
    """The ``--quant`` help: every preset with its bit costs (docs/cmf.md has the table)."""
    return "; ".join(f"{r.name} = {r.describe()}" for r in RECIPES.values())


def _alias(name: str) -> str:
    """The dtype ``name`` is an alias of, else ``name`` (the check then names it)."""
    return next((n for n, d in DTYPES.items() if name.lower() in d.aliases), name)


@dataclass
class QuantPolicy:
    """The dtype rules, in order:

    1. tensors with fewer than 2 dims (norms, biases, sinks) stay f32;
    2. the first ``keep`` pattern (fnmatch on the CMF name) that matches decides;
    3. otherwise routers stay f32, the embeddings and lm_head get the recipe's
       ``embed`` dtype (as llama.cpp keeps its output tensor at higher precision),
       the attention V and FFN down matrices its ``where`` rule picks its ``more``
       dtype, everything else its ``base``;
    4. a quantized dtype that does not fit the shape falls back along the dtypes'
       ``fallback`` (q6k -> q8, q5k -> q5_1, q4k -> q5, iq4_xs -> iq4_nl, q3k -> q4_0
       where a row is not a multiple of 256; the 32-blocks -> f16 where it is not a
       multiple of 32).
    """

    quant: str
    keep: list[tuple[str, str]] = field(default_factory=list)
    layers: int = 0  # the model's layer count, for the mixed presets (the converter sets it)
    gqa: int = 0  # query heads per KV head, for the IQ4 presets (the converter sets it)
    imatrix: Imatrix | None = None  # importance weights for the encoders (``--imatrix``)

    def __post_init__(self) -> None:
        self.quant = QUANT_ALIASES.get(self.quant, self.quant)
        if self.quant not in RECIPES:
            raise CortiqError(f"unknown --quant {self.quant!r}; choose one of {', '.join(QUANT_CHOICES)}")
        # a dtype as llama.cpp spells it (q6_k) is the dtype it names
        self.keep = [(pat, DTYPES[dt].name if dt in DTYPES else _alias(dt)) for pat, dt in self.keep]
        for pat, dt in self.keep:
            if dt not in MATRIX_DTYPES:
                raise CortiqError(f"--keep {pat}={dt}: unknown dtype {dt!r}; choose one of {', '.join(MATRIX_DTYPES)}")

    @property
    def recipe(self) -> Recipe:
        return RECIPES[self.quant]

    @staticmethod
    def parse_keep(specs: list[str]) -> list[tuple[str, str]]:
        out = []
        for s in specs:
            pat, sep, dt = s.rpartition("=")
            if not sep or not pat.strip() or not dt.strip():
                raise CortiqError(f"--keep {s!r}: expected PATTERN=DTYPE, e.g. 'lm_head.weight=q8'")
            out.append((pat.strip(), dt.strip()))
        return out

    def matching_keep(self, name: str) -> tuple[str, str] | None:
        for pat, dt in self.keep:
            if fnmatch.fnmatchcase(name, pat):
                return pat, dt
        return None

    def _more(self, name: str) -> bool:
        kind = next((k for suffix, k in _MORE_SUFFIXES.items() if name.endswith(suffix)), None)
        if kind is None:
            return False
        m = _LAYER.match(name)
        layer = None if m is None else int(m.group(1))
        return self.recipe.where.test(Site(kind, layer, self.layers, self.gqa, self.imatrix is not None))

    def choose(self, name: str, shape: tuple[int, ...]) -> tuple[str, bool]:
        """(dtype, True if a quantized choice fell back because of the shape)."""
        if len(shape) < 2:
            return "f32", False
        r = self.recipe
        kept = self.matching_keep(name)
        if kept is not None:
            chosen = kept[1]
        elif name.endswith(_EXACT_SUFFIXES):
            chosen = "f32"
        elif name in EMBED_NAMES:
            chosen = r.embed
        elif r.more and self._more(name):
            chosen = r.more
        else:
            chosen = r.base
        want = chosen
        while not get_dtype(chosen).supports(shape):
            chosen = get_dtype(chosen).fallback
        # Reported: a quantized choice that ended unquantized (a K-quant that became q5/q5_1/q8 is by design).
        return chosen, chosen != want and not get_dtype(chosen).quantized

    def importance(self, name: str, cols: int):
        """The imatrix entry weighting ``name``'s encoding error, or None."""
        return None if self.imatrix is None else self.imatrix.for_tensor(name, cols)

    def dtype_for(self, name: str, shape: tuple[int, ...]) -> str:
        return self.choose(name, shape)[0]
