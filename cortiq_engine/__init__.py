"""The mmap CPU engine: numbers in, numbers out.

    from cortiq_engine import Engine, SamplingConfig
    eng = Engine.load("model.cmf", threads=2)
    res = eng.generate(eng.tokenizer.encode("Hello"), SamplingConfig(temperature=0.0), max_tokens=32)

Layers: ``kernels/`` (numeric operations, numba and numpy), ``weights`` (views
into the map), ``layers`` (shared blocks), ``models/`` (one file per family),
``model`` (Model, State, forward), ``generate`` (the one decode loop, plain and
speculative), ``mtp`` (draft layers), ``engine`` (the API, speculation included).
"""

from cortiq_engine.engine import Engine, SpeculativeConfig
from cortiq_engine.generate import GenerationResult, TokenEvent
from cortiq_engine.model import Model, State, forward
from cortiq_engine.sampling import SamplingConfig

__all__ = [
    "Engine",
    "GenerationResult",
    "Model",
    "SamplingConfig",
    "SpeculativeConfig",
    "State",
    "TokenEvent",
    "forward",
]
