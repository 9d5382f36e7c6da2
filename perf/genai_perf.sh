#!/usr/bin/env bash
# genai-perf (0.0.16) against a running slora-serve's `ensemble`: text in, text streamed out, the vLLM backend's I/O
# (--backend vllm; the default endpoint type, kserve, is Triton's gRPC), one adapter for every request through
# --extra-inputs (sent as the adapter_id input tensor), exactly OUTPUT_TOKENS tokens each (min_tokens = max_tokens).
#
#   TOKENIZER=/path/to/model ADAPTER=name perf/genai_perf.sh
#
# Knobs (environment): TOKENIZER (required: a local tokenizer folder; nothing is downloaded), ADAPTER (empty: the base
# model), URL (gRPC, localhost:8001), CONCURRENCY (32), INPUT_TOKENS (128), OUTPUT_TOKENS (128), REQUEST_COUNT (256),
# WARMUP (16), INPUT_FILE (prompts as JSONL {"text": ...} lines instead of genai-perf's synthetic ones, which it cuts
# from English text: perf/word_prompts.py writes them for the random-weight models' word tokenizer), OUT
# (out/genai_perf: genai_perf.csv / .json / .txt), GENAI_WHEELS (.whl/genai).
# On a host without registry access, modules genai-perf needs that the host lacks are installed from GENAI_WHEELS
# (the offline bundle: perf/offline/README.md) into a folder of their own, and perf/genai_shim stands in for plotly
# (imported at start, used only for plots). genai-perf runs perf_analyzer, which needs glibc >= 2.38.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PY:-python3}
OUT=${OUT:-out/genai_perf}
GENAI_WHEELS=${GENAI_WHEELS:-.whl/genai}
: "${TOKENIZER:?TOKENIZER must name a local tokenizer folder}"
mkdir -p "$OUT"

missing=()
for module in genai_perf orjson soundfile; do "$PY" -c "import $module" 2>/dev/null || missing+=("$module"); done
if (( ${#missing[@]} )); then
  echo "genai_perf.sh: installing ${missing[*]} (and what they need) from $GENAI_WHEELS into /tmp/genai-site" >&2
  "$PY" -m pip install -q --no-index --no-deps --no-compile --target /tmp/genai-site "$GENAI_WHEELS"/*.whl
  export PYTHONPATH=/tmp/genai-site${PYTHONPATH:+:$PYTHONPATH}
fi
if ! "$PY" -c "import plotly" 2>/dev/null; then
  export PYTHONPATH=$PWD/perf/genai_shim${PYTHONPATH:+:$PYTHONPATH}
fi
[[ -n ${PERF_ANALYZER:-} ]] && export PATH=$(dirname "$PERF_ANALYZER"):$PATH

extra=()
[[ -n ${ADAPTER:-} ]] && extra=(--extra-inputs "adapter_id:$ADAPTER")
if [[ -n ${INPUT_FILE:-} ]]; then
  prompts=(--input-file "$INPUT_FILE")
else
  prompts=(--synthetic-input-tokens-mean "${INPUT_TOKENS:-128}" --synthetic-input-tokens-stddev 0)
fi
artifacts=$OUT/artifacts
HF_HUB_OFFLINE=1 "$PY" -c "from genai_perf.main import main; raise SystemExit(main())" profile -m ensemble \
  --backend vllm -u "${URL:-localhost:8001}" --streaming --tokenizer "$TOKENIZER" "${prompts[@]}" \
  --output-tokens-mean "${OUTPUT_TOKENS:-128}" --output-tokens-mean-deterministic \
  --concurrency "${CONCURRENCY:-32}" --request-count "${REQUEST_COUNT:-256}" \
  --warmup-request-count "${WARMUP:-16}" --random-seed 0 --artifact-dir "$artifacts" "${extra[@]}" \
  | tee "$OUT/genai_perf.txt"
for ext in csv json; do
  found=$(find "$artifacts" -name "profile_export_genai_perf.$ext" | head -1)
  [[ -n $found ]] && cp "$found" "$OUT/genai_perf.$ext"
done
