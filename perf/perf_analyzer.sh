#!/usr/bin/env bash
# perf_analyzer in streaming mode against a running slora-serve, a different adapter per request (the adapter_id
# input tensor, from an --input-data file built from the server's own adapter list).
#
#   PERF_ANALYZER=/path/to/perf_analyzer perf/perf_analyzer.sh [slora|ensemble]
#
# Knobs (environment): URL (gRPC, localhost:8001), HTTP_URL (localhost:8000), CONCURRENCY (8:64:8),
# PROMPT_TOKENS (128), MAX_TOKENS (128), ROWS (256), VOCAB (32000), OUT (out/perf_analyzer), PA_ARGS (extra),
# REQUEST_COUNT (unset: windows until perf_analyzer finds the throughput stable; N: measure exactly N requests per
# concurrency, no stability check: LLM requests last seconds, so windows of a few dozen rarely agree within 25%),
# WARMUP (requests before the measurement; with a single CONCURRENCY only).
# perf_analyzer needs glibc >= 2.38 (it runs in the tritonserver SDK container or on the GPU host).
set -euo pipefail
cd "$(dirname "$0")/.."

TARGET=${1:-slora}
PA=${PERF_ANALYZER:-perf_analyzer}
PY=${PY:-python}
URL=${URL:-localhost:8001}
HTTP_URL=${HTTP_URL:-localhost:8000}
CONCURRENCY=${CONCURRENCY:-8:64:8}
OUT=${OUT:-out/perf_analyzer}
mkdir -p "$OUT"

input="$OUT/$TARGET-input.json"
"$PY" -m slora.client.perf_input --target "$TARGET" --http-url "$HTTP_URL" --rows "${ROWS:-256}" \
  --prompt-tokens "${PROMPT_TOKENS:-128}" --max-tokens "${MAX_TOKENS:-128}" --vocab "${VOCAB:-32000}" --out "$input"

if [[ -n ${REQUEST_COUNT:-} ]]; then
  measure=(--request-count "$REQUEST_COUNT")
else
  measure=(--measurement-mode count_windows --measurement-request-count 64 --stability-percentage 25 --max-trials 6)
fi
[[ -n ${WARMUP:-} ]] && measure+=(--warmup-request-count "$WARMUP")

# Decoupled model: --streaming (gRPC bidirectional stream); a request's latency ends at its FINAL response.
# shellcheck disable=SC2086
"$PA" -m "$TARGET" -u "$URL" -i grpc --streaming --input-data "$input" --concurrency-range "$CONCURRENCY" \
  "${measure[@]}" -f "$OUT/$TARGET.csv" --profile-export-file "$OUT/$TARGET-profile.json" ${PA_ARGS:-} \
  | tee "$OUT/$TARGET.txt"
