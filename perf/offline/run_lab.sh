#!/usr/bin/env bash
# The benchmarks as suites for a lab GPU host without a package registry whose commands may last at most 10 minutes
# (the bundle of perf/offline/gpu_wheels.sh carried beside the tree), writing under $OUT. On your own GPU machine, run
# the commands of perf/README.md instead.
#
#   SLORA_COMMIT=$(git rev-parse HEAD) bash perf/offline/run_lab.sh [SUITE ...]        (default suite: all)
#
# Suites (each meant to fit one 10-minute call; in brackets a planning estimate for the H200, not a measurement:
# dominated by building 7B random weights once per engine/server process and by how fast the engine drains the
# traces; the budget check skips what no longer fits):
#   all         engine S1 n=5, n=2000, n=2000 base model; PEFT S1 n=5 (bounded); served `slora` S1 n=2000  [~8 min]
#   headline    engine S1 n=5, n=2000, n=2000 base model                                              [~4 min]
#   lora-vs-base  engine S1 n=2000 and n=2000 base model (the LoRA / base target alone)                 [~2 min]
#   engine-s1   engine S1 n=5, 100, 1000, 2000, n=2000 base model, n=2000 single adapter                [~6 min]
#   engine-s2   engine S2 n=5, 100, 1000, 2000, n=2000 base model                                       [~6 min]
#   s2-ratio    engine S2 n=5, n=2000, n=2000 base model (S2's two ratio targets alone)                 [~3 min]
#   engine-sall engine S-all (ranks 64/32/16/8 on all seven projections) n=5, n=N_SALL (250: what the host
#               budget holds), n=N_SALL base model; SALL_BIG=1 adds n=N_BIG (bound by disk reads)   [~4 min]
#   bmm         padded-BMM LoRA (kernel_backend=bmm) and triton side by side, S1 n=5 and n=2000, no graphs [~6 min]
#   serving-s1  engine S1 n=5, n=2000; served `slora` n=5, n=2000; served `ensemble` n=2000               [~8 min]
#   peft        engine S1 n=5, n=100; PEFT S1 n=5, n=100 (bounded prefixes)                               [~6 min]
#   peft-only   PEFT S1 n=5, n=100 alone (run after engine-s1 in the same call)                          [~3 min]
#   served-both engine S1 n=2000; served `slora` n=2000 and `ensemble` n=2000 (the served target, both paths), then
#               genai-perf against the ensemble (perf/genai_perf.sh, one S1 adapter, concurrency 32)  [~7 min]
#   served-apis served S1 n=N_BIG through `slora` (gRPC), the OpenAI endpoint (perf/bench_openai.py), the `ensemble`,
#               `slora` again: one server, one trace (issue 28's OpenAI / gRPC, issue 24's ensemble / slora) [~7 min]
#   ensemble-alias  served S1 n=N_BIG through `slora` with the ensemble's text I/O, then through the `ensemble` [~4 min]
#   defaults    served S1 n=N_BIG, base (DEFAULTS_BASE=0: not) and n=5 (DEFAULTS_N5=0: not) with every engine
#               option at its default, then n=N_BIG with ALT_OPTS
#               (issue 27's "no option within 3% of the best"; SHAPE=llama3-8b or qwen2.5-7b for today's shapes) [~8 min]
#   disk-tier   served S2 over N_BIG adapters, then the same trace over DISK_FIT (700), on one server with the
#               default host budget (DISK_BUDGET, auto): adapters beyond host memory against ones that fit  [~5 min]
#   unified-paging  in process, S2 n=N_BIG, long sequences (ABL_LENGTHS "256 1024", ABL_RATE 20 req/s), pool cut to
#               ABL_POOL (12GiB): the unified pool, then ABL_REGION (0.25) of it reserved for adapters  [~2 x RUN_LIMIT]
#   latency     served S1 n=N_BIG with bench_serving --sweep: the saturating run measures the capacity C (its finish
#               rate while requests arrive), then the same trace settings at 0.5 x C and 0.8 x C, TTFT p50/p99 of
#               each (issue 27's "TTFT at 50% and 80% of capacity"; DURATION=60: S-LoRA's trace length; RATE above
#               the capacity: 40 for llama2-7b, 60 for llama3-8b) [~5 min at DURATION=60: a start of 30-45 s, the
#               saturating run ~75 s to drain (llama3-8b at 60 req/s ~95 s), each load run ~65 s]
#   heavy-floor served S2 (HEAVY=S2) or S-all (HEAVY=Sall) over adapters that fit the host budget (DISK_FIT for S2,
#               N_SALL for S-all), the base model and n=5 from one server: issue 27's "S2 and S-all within 0.97 of the
#               bytes floor" (perf.report's bytes-floor target)  [~6 min at DURATION=60]
#   genai       served ensemble, genai-perf alone (perf/genai_perf.sh; one S1 adapter, concurrency 32)          [~3 min]
#   served      engine S1 n=2000 (and base model); served `slora` n=2000 (adapters preloaded at start); perf_analyzer slora  [~6 min]
#   s2-floor    perf.bench_decode_step on S2 adapters, batch 96 of 320-token prompts, no adapter / 5 / one per
#               request: step time, minimum bytes and bandwidth (the S2 LoRA / base ratio's bytes floor) [~3 min]
#               (FLOOR_COUNTS: the adapter counts, "0 5 -1"; FLOOR_PROFILE=1: profile each; FLOOR_TAG: file suffix;
#               FLOOR_SETTING: the adapters' setting, S2, S1 or Sall; FLOOR_BATCH: batch sizes, "96"; FLOOR_PROMPT:
#               prompt tokens, 320; FLOOR_GRAPHS_ONLY=1: the CUDA-graph engine alone)
#   projections perf.bench_lora_gemm --sweep (the Triton projection GEMM's configs against cuBLAS at 1-128 rows, and a
#               decoder layer's LoRA behind cuBLAS and behind the Triton GEMM), then perf.bench_decode_step at batch
#               1/8/16 with the Triton GEMM for small steps (triton_gemm=true) and with cuBLAS (false)  [~6 min]
#   pdl         the LoRA shrink launched with PDL behind the base projection (kernels/triton/pdl.py): a decoder layer's
#               LoRA (perf.bench_lora_gemm, no sweep), the decode LoRA kernels' kinds behind the projections
#               (perf.bench_lora_kinds --behind-gemm, 16 and 64 decodes), then perf.bench_decode_step at batch
#               1/16/32/64 (S1 adapters) with it (pdl), without it (shrink_pdl=false: no-pdl) and on cuBLAS
#               (triton_gemm=false)                                                                    [~5 min]
#   few         the rule that sends decodes of few adapters to the tensor-core LoRA tiles (few_adapters_*):
#               perf.bench_decode_step with CUDA graphs at batch FEW_BATCHES ("16 32 64"), S2 adapters (4, 24,
#               one per request) and S1 (5, one per request), under each of FEW_RULES (MIN_TOKENS,MAX_ADAPTERS:
#               "32,8 64,8": the rule and #68's)                                                      [~2 min a rule]
#   tenants     perf.bench_tenants_served (tenant isolation through Triton, issue 26): it starts one slora-serve per
#               configuration (the served suites' options, S1 adapters; free ports of its own, not PORT_BASE's),
#               20 tenants s1-0000..0019 and the noisy one s1-0020. TENANT_SUITE overload (default): TENANT_MODES
#               at TENANT_LOADS x the capacity, which a burst under fcfs measures first unless CAPACITY gives it;
#               noisy: the noisy neighbour under TENANT_POLICIES; all: both. The servers' logs go to
#               $WORK/tenant-servers, their last 300 lines each to server.log  [~5.5 min: fcfs and early-abort
#               at 2x, 35 s of arrivals, CAPACITY given; the burst adds ~0.5 min, a server ~1.3, a run ~1-1.5]
#   mixed-graphs  in process, S1 n=N_BIG: an engine with its defaults (steps with prompts as CUDA graphs), then one
#               with mixed_cuda_graphs=false; each the saturating trace and the same settings at LOW_RATE (30)
#               [~8 min for llama3-8b at DURATION=50]
#   checks      kernel and engine tests on the GPU, then perf.bench_decode_step (CUDA graphs, batch 1/8/64),
#               perf.bench_host_step (host time of a 256-sequence decode step) and perf.bench_host_forward
#               (host time of eager steps, kernels stubbed: this host's Python against the CPU machine's) [~8 min]
# Several suites in one call run one after the other under one time budget (BUDGET_S); later ones are skipped
# when the time is gone, and the results of every finished run are kept.
#
# Outputs (8 files at most come back): $OUT/results.json (every run), report.md (targets checked, runs
# table), run.log (everything the steps logged), server.log, metrics.txt (the engine's series on the metrics
# endpoint when each server stopped), profile.txt, throughput.png, scaling.png, latency.png. Model, adapters
# and traces go to $WORK (local disk), reused while the machine stays warm.
#
# Knobs (environment): BUDGET_S (570), RATE (40 req/s) and DURATION (12 s) of the traces, SEED (42),
# RUN_LIMIT (120 s per run), KERNEL (triton; the engine's kernel_backend), ENGINE_OPTS ("key=value ..." for
# EngineConfig), ALT_OPTS (the defaults suite's candidate options), PEFT_REQUESTS (100) and PEFT_LIMIT (60 s), PROFILE ("20 100 3": after each engine step's runs,
# an unmeasured pass profiles steps 20-22 (prefill-heavy, mixed) and 100-102 (decode) with torch.profiler and the
# 3 steps after each with cProfile; "" disables), PROFILE_REPLAY ("START COUNT", empty: off; e.g. "300 10": each
# engine process replays its last adapter run and its base run once more in real time, unmeasured, and profiles
# steps 300-309 under torch.profiler and 310-319 under cProfile: the trace's own decode and mixed steps; profile.txt
# also gets each window's per-step timeline, perf/trace_steps.py), PROFILE_TRACE (1: keep those windows' chrome
# traces as $OUT/trace-*.json.gz; read them with python -m perf.trace_steps), HOST_BUDGET (48GiB of host memory
# for adapters), SHAPE (llama2-7b | llama3-8b | qwen2.5-7b | tiny: perf/make_model.py's shapes), DEVICE (cuda | cpu), N_BIG (2000), N_SALL (250) and SALL_BIG (0) of
# engine-sall, LENGTHS ("8 512": input and output length range), CHECK_PATHS ("tests/kernels tests/engine") and
# CHECK_K ("not cpu": pytest -k) of the checks suite, DECODE_STEP (1; 0 skips its decode-step benchmark),
# HOST_FORWARD (1; 0 skips bench_host_forward), GPU_LOG (1: the GPU's clocks, power and temperature every 200 ms
# into gpu_log.csv), PY (python3), OUT, KEEP (empty: every output; else the names of the files of $OUT to keep at the
# end), WORK, PORT_BASE (8000), GPU_ENV (.whl/gpu-env.sh; "none" skips it);
# of the tenants suite: TENANT_SUITE (overload | noisy | all), TENANT_MODES ("fcfs early-abort"; or fair, priority:
# at TENANT_LOADS=1 the cost of each policy without overload),
# TENANT_LOADS ("2": units of the capacity), TENANT_POLICIES ("fcfs fair"; or priority), TENANT_REPEAT (empty; 1:
# each noisy neighbour's run without the noisy tenant again after the one with it), TENANT_DURATION (30 s of
# arrivals a run), TENANT_SLO (6 s: the SLO counted, and early abort's ttft_slo_s), CAPACITY (req/s, e.g. an earlier
# tenants-served-capacity run's; empty: measured by a burst of TENANT_BURST requests, the benchmark's 512 if empty),
# TENANT_SERVER_S (100 on CUDA, 30 on CPU: a server's start, warm-up and stop, for the plan that sets the per-run
# time limit, at most RUN_LIMIT), TENANT_CLIENTS (the benchmark's 3 client processes, the heavy tenants apart; 1:
# one process, as before 2026-12-05) and TENANT_STREAMS (its 0: one gRPC stream a tenant; 1: one for all);
# SERVE_CLIENTS (empty: bench_serving's one client process; N: N processes replay each served `slora` run).
# CPU rehearsal of the tenants suite (about 1.5 minutes on 2 cores; 8 batch slots, so that 2x the capacity queues
# as the GPU's pool makes it, and a 1 s SLO, so that early abort refuses within 5 s of arrivals):
#   GPU_ENV=none PY=python KERNEL=torch SHAPE=tiny DEVICE=cpu N_BIG=40 RATE=20 DURATION=1 LENGTHS="8 48" \
#   ENGINE_OPTS="max_num_seqs=8" TENANT_SLO=1 TENANT_DURATION=5 TENANT_BURST=64 OUT=/tmp/tenants-out \
#   WORK=/tmp/tenants-work bash perf/offline/run_lab.sh tenants
# CPU rehearsal of the whole script (about 1-2 minutes on 2 cores; the torch kernels, as Triton needs a GPU):
#   GPU_ENV=none PY=python KERNEL=torch SHAPE=tiny DEVICE=cpu N_BIG=40 RATE=20 DURATION=1 LENGTHS="8 48" \
#   PROFILE="5 2" PEFT_REQUESTS=10 PEFT_LIMIT=20 OUT=/tmp/perf-out WORK=/tmp/perf-work bash perf/offline/run_lab.sh all

cd "$(dirname "${BASH_SOURCE[0]}")/../.." || exit 1
GPU_ENV=${GPU_ENV:-.whl/gpu-env.sh}  # the GPU host's wheels and server bundle; GPU_ENV=none skips it
if [[ -f $GPU_ENV ]]; then
  # shellcheck disable=SC1090
  source "$GPU_ENV"
fi
set -uo pipefail  # no -e: one failed step must not lose the others' results
START=$(date +%s)
BUDGET_S=${BUDGET_S:-570}
OUT=${OUT:-$PWD/out/perf}
WORK=${WORK:-/tmp/slora-perf}
PY=${PY:-python3}
RATE=${RATE:-40}
LOW_RATE=${LOW_RATE:-30}  # the mixed-graphs suite's trace below capacity
DURATION=${DURATION:-12}
SEED=${SEED:-42}
RUN_LIMIT=${RUN_LIMIT:-120}
KERNEL=${KERNEL:-triton}
ENGINE_OPTS=${ENGINE_OPTS:-}
ALT_OPTS=${ALT_OPTS:-}
DEFAULTS_N5=${DEFAULTS_N5:-1}  # the defaults suite serves the n=5 trace after n=N_BIG and the base model
DEFAULTS_BASE=${DEFAULTS_BASE:-1}  # 0: the defaults suite serves no base run (an A/B of ALT_OPTS alone, shorter)
PEFT_REQUESTS=${PEFT_REQUESTS:-100}
PEFT_LIMIT=${PEFT_LIMIT:-60}
PROFILE=${PROFILE-20 100 3}
PROFILE_REPLAY=${PROFILE_REPLAY:-}
PROFILE_TRACE=${PROFILE_TRACE:-}
SHAPE=${SHAPE:-llama2-7b}
DEVICE=${DEVICE:-cuda}
N_BIG=${N_BIG:-2000}
N_SALL=${N_SALL:-250}  # S-all adapters that the default HOST_BUDGET holds (250 x 154 MiB = 38 GiB)
SALL_BIG=${SALL_BIG:-0}
LENGTHS=${LENGTHS:-8 512}
PORT_BASE=${PORT_BASE:-8000}
OPENAI_PORT=${OPENAI_PORT:-$((PORT_BASE + 3))}
HOST_BUDGET=${HOST_BUDGET:-48GiB}
CHECK_PATHS=${CHECK_PATHS:-tests/kernels tests/engine}
CHECK_K=${CHECK_K:-not cpu}
DECODE_STEP=${DECODE_STEP:-1}
FLOOR_COUNTS=${FLOOR_COUNTS:-0 5 -1}
FEW_RULES=${FEW_RULES:-32,8 64,8}
FEW_BATCHES=${FEW_BATCHES:-16 32 64}
FLOOR_PROFILE=${FLOOR_PROFILE:-}
FLOOR_TAG=${FLOOR_TAG:-}
FLOOR_SETTING=${FLOOR_SETTING:-S2}
FLOOR_BATCH=${FLOOR_BATCH:-96}
FLOOR_PROMPT=${FLOOR_PROMPT:-320}
FLOOR_GRAPHS_ONLY=${FLOOR_GRAPHS_ONLY:-}
HOST_FORWARD=${HOST_FORWARD:-1}
GPU_LOG=${GPU_LOG:-}
KEEP=${KEEP:-}
TENANT_SUITE=${TENANT_SUITE:-overload}
TENANT_MODES=${TENANT_MODES:-fcfs early-abort}
TENANT_LOADS=${TENANT_LOADS:-2}
TENANT_POLICIES=${TENANT_POLICIES:-fcfs fair}
TENANT_REPEAT=${TENANT_REPEAT:-}
TENANT_CLIENTS=${TENANT_CLIENTS:-}
SERVE_CLIENTS=${SERVE_CLIENTS:-}
TENANT_STREAMS=${TENANT_STREAMS:-}
TENANT_DURATION=${TENANT_DURATION:-30}
TENANT_SLO=${TENANT_SLO:-6}
TENANT_BURST=${TENANT_BURST:-}
CAPACITY=${CAPACITY:-}
DISK_FIT=${DISK_FIT:-700}
HEAVY=${HEAVY:-S2}  # heavy-floor's setting: S2 or Sall
DISK_BUDGET=${DISK_BUDGET:-auto}
ABL_LENGTHS=${ABL_LENGTHS:-256 1024}
ABL_RATE=${ABL_RATE:-20}
ABL_POOL=${ABL_POOL:-12GiB}
ABL_REGION=${ABL_REGION:-0.25}
GPU_LOG_PID=""
export SLORA_COMMIT=${SLORA_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}
export PYTHONUNBUFFERED=1
# On a CPU rehearsal, spinning intra-op threads of several processes make every timing erratic.
[[ $DEVICE == cpu ]] && export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
TENANT_SERVER_S=${TENANT_SERVER_S:-$([[ $DEVICE == cpu ]] && echo 30 || echo 100)}

MODEL=$WORK/model-$SHAPE  # per shape: a warm machine keeps the models of earlier calls
RESULTS=$OUT/results.json
LOG=$OUT/run.log
SERVER_PID=""
mkdir -p "$OUT" "$WORK/traces"

log() { echo "$(date +%T) run_lab: $*" | tee -a "$LOG" >&2; }
elapsed() { echo $(( $(date +%s) - START )); }
remaining() { echo $(( BUDGET_S - $(elapsed) )); }

# Run a Python step with what is left of the budget (less a margin for the report); logs go to run.log.
step() {
  local left=$(( $(remaining) - 25 ))
  if (( left < 30 )); then log "SKIPPED (budget spent): $*"; return 1; fi
  log "step: $* (up to ${left}s)"
  timeout --signal=INT --kill-after=15 "$left" "$PY" "$@" >>"$LOG" 2>&1
  local rc=$?
  (( rc )) && log "step exited with $rc: $1 $2"
  return "$rc"
}

run_limit() { local left=$(( $(remaining) - 40 )); echo $(( left < RUN_LIMIT ? left : RUN_LIMIT )); }

engine_args() {
  local args=(--model "$MODEL" --load-format dummy --device "$DEVICE" --host-budget "$HOST_BUDGET")
  for opt in $ENGINE_OPTS; do args+=(--engine-opt "$opt"); done
  echo "${args[@]}"
}

setup() {
  log "suites: $* | commit $SLORA_COMMIT | budget ${BUDGET_S}s | traces rate $RATE/s x ${DURATION}s, lengths [$LENGTHS)"
  if [[ $DEVICE == cuda* ]]; then
    nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv >>"$LOG" 2>&1
  fi
  "$PY" -c "import slora.backend.engine.llm_engine" 2>/dev/null \
    || "$PY" -m pip install -q --no-index --no-deps --no-build-isolation -e . >>"$LOG" 2>&1 \
    || log "pip install -e . failed"
  # Triton 2.51's stub needs NumPy 1 (backend/stub_compat.py): perf/offline/gpu_wheels.sh carries it in .whl/stub/, for the
  # stub alone (the host's SciPy needs its NumPy 2).
  if compgen -G ".whl/stub/*.whl" >/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/stub-site .whl/stub/*.whl \
      >>"$LOG" 2>&1 && export SLORA_STUB_PYTHONPATH=/tmp/stub-site
  fi
  [[ -f $MODEL/config.json ]] || step -m perf.make_model --shape "$SHAPE" --out "$MODEL"
}

vocab() { "$PY" -c "import json; print(json.load(open('$MODEL/config.json'))['vocab_size'])"; }

adapters() {  # adapters SETTING: n=N_BIG adapter directories, built once per warm machine
  local setting=$1 root=$WORK/adapters/$SHAPE-$1
  if ! grep -q "\"n\": $N_BIG," "$root/.weights/$setting.json" 2>/dev/null; then
    step -m perf.make_adapters --model "$MODEL" --setting "$setting" -n "$N_BIG" --out "$root"
  fi
  echo "$root"
}

pdl_settings() {  # pdl_settings TAG: the engine options of the pdl suite's decode-step run TAG
  case $1 in
    pdl) echo "--engine-option triton_gemm=true" ;;
    no-pdl) echo "--engine-option triton_gemm=true --engine-option shrink_pdl=false" ;;
    cublas) echo "--engine-option triton_gemm=false" ;;
  esac
}

trace() {  # trace PREFIX N: the trace file (same seed: same arrivals and lengths for every N and prefix)
  local n=$(( $2 < N_BIG ? $2 : N_BIG ))  # never more adapters than were made (small rehearsals)
  set -- "$1" "$n"
  # every setting in the folder (a warm machine keeps the traces of earlier calls, which may have had other ones);
  # the file's stem names the runs (perf.report matches them)
  local dir=$WORK/traces/$SHAPE/${RATE}rps-${DURATION}s-seed$SEED-len${LENGTHS// /-}
  local file=$dir/$1-n$2.jsonl
  mkdir -p "$dir"
  if [[ ! -f $file ]]; then
    # shellcheck disable=SC2086
    step -m perf.workload -n "$2" --prefix "$1-" --rate "$RATE" --duration "$DURATION" --seed "$SEED" \
      --vocab-size "$(vocab)" --input-range $LENGTHS --output-range $LENGTHS --out "$file" >/dev/null
  fi
  echo "$file"
}

engine() {  # engine BACKEND SETTING RUN...  (RUN = TRACE[@MODE]; one engine for all of them)
  local backend=$1 setting=$2; shift 2
  local root profile=()
  root=$(adapters "$setting")
  # shellcheck disable=SC2206
  [[ -n $PROFILE ]] && profile=(--profile $PROFILE --profile-file "$OUT/profile.txt")
  # shellcheck disable=SC2206
  [[ -n $PROFILE_REPLAY ]] && profile+=(--profile-replay $PROFILE_REPLAY --profile-file "$OUT/profile.txt")
  [[ -n $PROFILE_REPLAY && -n $PROFILE_TRACE ]] && profile+=(--profile-trace-dir "$OUT")
  # shellcheck disable=SC2046
  step -m perf.bench_engine $(engine_args) --adapter-root "$root" --kernel-backend "$backend" \
    --name-prefix "${ENGINE_PREFIX:-engine-$backend}" --time-limit "$(run_limit)" "${profile[@]}" --out "$RESULTS" "$@"
}

backend_available() {
  "$PY" -c "from slora.backend.config import EngineConfig; EngineConfig(kernel_backend='$1')" 2>>"$LOG"
}

serve_args() {  # serve_args SETTING: slora-serve's options of the served suites, but the ports (one a line)
  local root
  root=$(adapters "$1")
  printf '%s\n' --model "$MODEL" --adapter-dir "$root" --device "$DEVICE" --kernel-backend "$KERNEL"
  # Every adapter is read into host memory before the server reports ready (S-LoRA keeps them all in host memory).
  for opt in load_format=dummy host_budget_bytes=$HOST_BUDGET preload_adapters=true warmup=true $ENGINE_OPTS; do
    printf '%s\n' --engine-option "$opt"
  done
}

start_server() {  # start_server SETTING [OPTION...]: slora-serve in the background, its log in server.log
  local args
  mapfile -t args < <(serve_args "$1")
  shift
  log "starting slora-serve (${args[*]:0:4}) $*"
  "$PY" -m slora.backend.launcher.cli "${args[@]}" --http-port "$PORT_BASE" --grpc-port $((PORT_BASE + 1)) \
    --metrics-port $((PORT_BASE + 2)) "$@" >>"$OUT/server.log" 2>&1 &
  SERVER_PID=$!
  wait_server
}

wait_server() {  # wait_server [URL]: until URL (Triton's readiness) answers; gives up at once when slora-serve has
  # exited (its log says why)
  local url=${1:-"http://localhost:$PORT_BASE/v2/health/ready"} limit=$(( $(remaining) - 90 ))
  for (( t = 0; t < limit; t += 2 )); do
    if ! kill -0 "$SERVER_PID" 2>/dev/null; then
      log "slora-serve exited before it was ready: see server.log"; SERVER_PID=""; return 1
    fi
    "$PY" -c "import urllib.request as u; u.urlopen('$url', timeout=2)" 2>/dev/null && { log "ready: $url"; return 0; }
    sleep 2
  done
  log "server not ready after ${limit}s"; return 1
}

stop_server() {
  [[ -z $SERVER_PID ]] && return 0
  # the engine's series on Triton's metrics endpoint as the runs left them (docs/serving.md), one block a server
  { echo "# $(date +%T) slora-serve pid $SERVER_PID"
    "$PY" -c "import urllib.request as u; print(u.urlopen('http://localhost:$((PORT_BASE + 2))/metrics', timeout=5)
      .read().decode())" 2>>"$LOG" | grep '^slora_' ; } >>"$OUT/metrics.txt"
  log "stopping slora-serve (pid $SERVER_PID)"
  kill -INT "$SERVER_PID" 2>/dev/null
  for _ in $(seq 30); do kill -0 "$SERVER_PID" 2>/dev/null || break; sleep 1; done
  kill -KILL "$SERVER_PID" 2>/dev/null
  wait "$SERVER_PID" 2>/dev/null
  SERVER_PID=""
  stop_triton $((PORT_BASE + 1))
}

stop_triton() {  # stop_triton GRPC_PORT: the tritonserver of that port, if its slora-serve left it running
  # tritonserver runs in a session of its own (it would outlive this call on a warm machine and hold the GPU
  # and the ports); the launcher stops it, this is only in case it did not.
  local left
  left=$(pgrep -f -- "tritonserver.*--grpc-port=$1( |$)" || true)
  if [[ -n $left ]]; then
    log "tritonserver still running (pid $left): TERM"
    # shellcheck disable=SC2086
    kill -TERM $left 2>/dev/null
    sleep 5
  fi
}

openai_api() {  # openai_api RUN...  (the running server's OpenAI endpoint, started with OPENAI_PORT)
  step -m perf.bench_openai --url "http://localhost:$OPENAI_PORT/v1" --time-limit "$(run_limit)" --out "$RESULTS" "$@"
}

# The suites call bench_serving once the server is ready: a longer wait would only spend the budget on a dead one.
ready_timeout() { local left=$(( $(remaining) - 60 )); echo $(( left < 90 ? left : 90 )); }

serving() {  # serving TARGET RUN...  (against the running server)
  local target=$1; shift
  local extra=()
  [[ $target == ensemble ]] && extra=(--tokenizer "$MODEL")
  [[ $target == slora && -n $SERVE_CLIENTS ]] && extra=(--clients "$SERVE_CLIENTS")
  step -m perf.bench_serving --url "localhost:$((PORT_BASE + 1))" --target "$target" "${extra[@]}" \
    --server-kernel-backend "$KERNEL" --metrics-url "localhost:$((PORT_BASE + 2))" \
    --ready-timeout "$(ready_timeout)" --time-limit "$(run_limit)" --out "$RESULTS" "$@"
}

perf_analyzer() {  # perf_analyzer TARGET: streaming, one adapter id per request from an input-data file
  local left=$(( $(remaining) - 45 )) dir=$WORK/perf_analyzer
  if (( left < 60 )) || [[ -z ${PERF_ANALYZER:-} ]]; then log "SKIPPED perf_analyzer (time or binary missing)"; return 1; fi
  log "perf_analyzer $1 (up to ${left}s)"
  PY=$PY OUT=$dir CONCURRENCY=${PA_CONCURRENCY:-64} ROWS=512 PROMPT_TOKENS=128 MAX_TOKENS=128 REQUEST_COUNT=640 WARMUP=64 \
    timeout --kill-after=10 "$left" bash perf/perf_analyzer.sh "$1" >>"$LOG" 2>&1 || log "perf_analyzer exited with $?"
  [[ -f $dir/$1.csv ]] && cp "$dir/$1.csv" "$OUT/perf_analyzer_$1.csv"
  [[ -f $dir/$1.txt ]] && cp "$dir/$1.txt" "$OUT/perf_analyzer_$1.txt"
}

genai_perf() {  # genai_perf: genai-perf against the running server's ensemble, with the first S1 adapter
  local left=$(( $(remaining) - 45 )) dir=$WORK/genai_perf adapter
  if (( left < 60 )) || [[ -z ${PERF_ANALYZER:-} ]]; then log "SKIPPED genai-perf (time or perf_analyzer missing)"; return 1; fi
  adapter=$(find "$(adapters S1)" -mindepth 1 -maxdepth 1 -type d ! -name ".*" -printf "%f\n" | sort | head -1)
  log "genai-perf ensemble, adapter $adapter (up to ${left}s)"
  rm -rf "$dir"
  mkdir -p "$dir"
  # the model's word tokenizer reads genai-perf's English prompts as nothing: prompts in its own words instead
  "$PY" -m perf.word_prompts --vocab "$(vocab)" --count 256 --length 128 --out "$dir/prompts.jsonl"
  PY=$PY OUT=$dir TOKENIZER=$MODEL ADAPTER=$adapter CONCURRENCY=${GENAI_CONCURRENCY:-32} INPUT_FILE=$dir/prompts.jsonl \
    timeout --kill-after=10 "$left" bash perf/genai_perf.sh >>"$LOG" 2>&1 || log "genai-perf exited with $?"
  for f in genai_perf.csv genai_perf.json genai_perf.txt; do [[ -f $dir/$f ]] && cp "$dir/$f" "$OUT/$f"; done
  return 0
}

tenant_plan() {  # tenant_plan: "RUNS SERVERS" of the tenants suite's knobs, as perf/tenant_suites.py runs them
  local -A servers=()
  local runs=0 loads policy mode
  loads=$(wc -w <<<"$TENANT_LOADS")
  [[ -z $CAPACITY ]] && { runs=1; servers[fcfs]=1; }  # the burst, on the fcfs server
  if [[ $TENANT_SUITE != overload ]]; then
    for policy in $TENANT_POLICIES; do  # without and with, and without again
      runs=$(( runs + (${TENANT_REPEAT:-0} == 1 ? 3 : 2) )); servers[$policy]=1
    done
  fi
  if [[ $TENANT_SUITE != noisy ]]; then
    for mode in $TENANT_MODES; do runs=$(( runs + loads )); servers[$mode]=1; done
  fi
  echo "$runs ${#servers[@]}"
}

tenants() {  # the served tenant-isolation suites: bench_tenants_served starts each configuration's server itself
  local logs=$WORK/tenant-servers plan runs servers limit serve sizes=() rc
  mapfile -t serve < <(serve_args S1)
  read -r runs servers <<<"$(tenant_plan)"
  # Every run gets the same time limit: what is left after the servers' starts, shared out, at most RUN_LIMIT.
  limit=$(( ($(remaining) - 60 - servers * TENANT_SERVER_S) / (runs > 0 ? runs : 1) ))
  (( limit > RUN_LIMIT )) && limit=$RUN_LIMIT
  plan="$runs runs on $servers servers"
  if (( limit < TENANT_DURATION + 15 )); then  # too short for the arrivals and a drain: the budget cuts the last
    log "tenants: $plan leave ${limit}s a run, short of ${TENANT_DURATION}s of arrivals and a drain; the budget" \
      "will cut the last runs"
    limit=$(( TENANT_DURATION + 15 ))
  fi
  log "tenants: $TENANT_SUITE, $plan, ${limit}s a run"
  [[ -n $CAPACITY ]] && sizes+=(--capacity "$CAPACITY")
  [[ -n $TENANT_BURST ]] && sizes+=(--capacity-requests "$TENANT_BURST")
  [[ $TENANT_REPEAT == 1 ]] && sizes+=(--repeat-without)
  [[ -n $TENANT_CLIENTS ]] && sizes+=(--clients "$TENANT_CLIENTS")
  [[ -n $TENANT_STREAMS ]] && sizes+=(--streams "$TENANT_STREAMS")
  rm -rf "$logs"  # this call's servers only
  # shellcheck disable=SC2086
  step -m perf.bench_tenants_served --suite "$TENANT_SUITE" --modes $TENANT_MODES --loads $TENANT_LOADS \
    --policies $TENANT_POLICIES --duration "$TENANT_DURATION" --slo "$TENANT_SLO" "${sizes[@]}" \
    --adapter-prefix s1- --time-limit "$limit" --ready-timeout "$(( TENANT_SERVER_S * 3 ))" \
    --server-log-dir "$logs" --out "$RESULTS" -- "${serve[@]}"
  rc=$?
  tenant_logs "$logs"
  return "$rc"
}

tenant_logs() {  # tenant_logs DIR: each server's log tail into server.log, in the order they started; stops a
  # tritonserver that one left behind
  local f port
  find "$1" -maxdepth 1 -name "*.log" -printf "%T@ %p\n" 2>/dev/null | sort -n | cut -d' ' -f2- | while read -r f; do
    { echo "=== $(basename "$f") (last 300 lines; the whole log in $f)"; tail -n 300 "$f"; } >>"$OUT/server.log"
    port=$(grep -o -m1 -- '--grpc-port=[0-9]*' "$f" | cut -d= -f2)
    [[ -n $port ]] && stop_triton "$port"
  done
}

peft() {  # peft TRACE...
  local root
  root=$(adapters S1)
  step -m perf.baseline_peft --model "$MODEL" --adapter-root "$root" --device "$DEVICE" \
    --max-requests "$PEFT_REQUESTS" --time-limit "$PEFT_LIMIT" --out "$RESULTS" "$@"
}

suite() {
  local s1_5 s1_100 s1_1000 s1_big s2_5 s2_100 s2_1000 s2_big
  s1_5=$(trace s1 5); s1_big=$(trace s1 "$N_BIG")
  case $1 in
    all)
      engine "$KERNEL" S1 "$s1_5" "$s1_big" "$s1_big@base"
      peft "$s1_5"
      start_server S1 && serving slora "$s1_big"
      stop_server ;;
    headline)
      engine "$KERNEL" S1 "$s1_5" "$s1_big" "$s1_big@base" ;;
    lora-vs-base)
      engine "$KERNEL" S1 "$s1_big" "$s1_big@base" ;;
    mixed-graphs)  # steps with prompts replayed as CUDA graphs (mixed_cuda_graphs, the default) against eager ones,
      # in process: one engine each, the saturating trace, then the same settings at LOW_RATE (first tokens below
      # capacity: run names end in -low); results.json's step_kinds split the steps by kind
      local low
      low=$(RATE=$LOW_RATE trace s1 "$N_BIG")
      cp "$low" "${low%.jsonl}-low.jsonl"
      ENGINE_PREFIX=mixed-graphs engine "$KERNEL" S1 "$s1_big" "${low%.jsonl}-low.jsonl"
      ENGINE_PREFIX=eager-mixed ENGINE_OPTS="$ENGINE_OPTS mixed_cuda_graphs=false" \
        engine "$KERNEL" S1 "$s1_big" "${low%.jsonl}-low.jsonl" ;;
    engine-s1)
      s1_100=$(trace s1 100); s1_1000=$(trace s1 1000)
      engine "$KERNEL" S1 "$s1_5" "$s1_100" "$s1_1000" "$s1_big" "$s1_big@base" "$s1_big@single" ;;
    engine-s2)
      s2_5=$(trace s2 5); s2_100=$(trace s2 100); s2_1000=$(trace s2 1000); s2_big=$(trace s2 "$N_BIG")
      engine "$KERNEL" S2 "$s2_5" "$s2_100" "$s2_1000" "$s2_big" "$s2_big@base" ;;
    s2-ratio)
      s2_5=$(trace s2 5); s2_big=$(trace s2 "$N_BIG")
      engine "$KERNEL" S2 "$s2_5" "$s2_big" "$s2_big@base" ;;
    engine-sall)  # n = N_SALL: S-all adapters average 154 MiB, so 2000 of them (300 GiB) outgrow host memory (RESULTS
      local sa_5 sa_n runs  # session 12); SALL_BIG=1 adds the n = N_BIG run, bound by reading adapters from disk
      sa_5=$(trace sall 5); sa_n=$(trace sall "$N_SALL")
      runs=("$sa_5" "$sa_n" "$sa_n@base")
      (( SALL_BIG )) && runs+=("$(trace sall "$N_BIG")")
      engine "$KERNEL" Sall "${runs[@]}" ;;
    bmm)  # both backends under the same conditions: without CUDA graphs, which need the Triton backend
      local saved=$ENGINE_OPTS
      ENGINE_OPTS=$(tr ' ' '\n' <<<"$ENGINE_OPTS" | grep -v '^cuda_graphs=' | tr '\n' ' ')
      [[ $saved != "$ENGINE_OPTS" ]] && log "bmm suite: cuda_graphs dropped from ENGINE_OPTS for both backends"
      if backend_available bmm; then
        engine bmm S1 "$s1_5" "$s1_big"
      else
        log "SKIPPED bmm: this engine has no kernel_backend=bmm yet"
      fi
      engine "$KERNEL" S1 "$s1_5" "$s1_big"
      ENGINE_OPTS=$saved ;;
    serving-s1)
      engine "$KERNEL" S1 "$s1_5" "$s1_big"
      start_server S1 || { stop_server; return 1; }
      # The server keeps adapters resident between runs (it cannot be asked to evict), so the run paired with the
      # in-process headline goes first on the fresh server; later ones start warmer (adapters_on_gpu_at_start).
      serving slora "$s1_big" "$s1_5"
      serving ensemble "$s1_big"
      stop_server ;;
    served)  # the in-process headline and base run, then the same trace served (adapters preloaded), then PA
      engine "$KERNEL" S1 "$s1_big" "$s1_big@base"
      if start_server S1; then
        serving slora --no-preload "$s1_big"
        perf_analyzer slora
      fi
      stop_server ;;
    served-both)  # the in-process headline run, then the same trace served through `slora` and the `ensemble`
      engine "$KERNEL" S1 "$s1_big"
      if start_server S1; then
        serving slora "$s1_big"
        serving ensemble "$s1_big"
        genai_perf
      fi
      stop_server ;;
    served-apis)  # one server, one trace through `slora` (gRPC), the OpenAI endpoint and the `ensemble`, then
      # `slora` again: the first run starts with no adapter resident, the last with the earlier runs' residents
      # slora-serve stops Triton when its OpenAI server fails to start, which may come after Triton is ready
      if start_server S1 --openai-port "$OPENAI_PORT" && wait_server "http://localhost:$OPENAI_PORT/v1/models"; then
        serving slora "$s1_big"
        openai_api "$s1_big"
        serving ensemble "$s1_big"
        serving slora --name-prefix served-again "$s1_big"
      fi
      stop_server ;;
    ensemble-alias)  # the `ensemble` alias against `slora` with the same text I/O (vLLM-backend inputs), one server:
      # the alias's own cost, apart from the text path's
      if start_server S1; then
        serving ensemble --model-name slora --name-prefix slora-text "$s1_big"
        serving ensemble "$s1_big"
      fi
      stop_server ;;
    defaults)  # issue 27's fast defaults: S1 n=N_BIG and the base model served with every option at its default,
      # then n=N_BIG on a server started with ALT_OPTS ("key=value ...") as well: the defaults against a candidate
      # and n=5 last (DEFAULTS_N5=1): issue 27's n2000 / n5 from the same server
      local runs=("$s1_big")
      (( DEFAULTS_BASE )) && runs+=("$s1_big@base")
      (( DEFAULTS_N5 )) && runs+=("$s1_5")
      if start_server S1; then
        serving slora "${runs[@]}"
      fi
      stop_server
      if [[ -n $ALT_OPTS ]]; then
        if ENGINE_OPTS="$ENGINE_OPTS $ALT_OPTS" start_server S1; then
          serving slora --name-prefix "alt-${ALT_OPTS// /-}" "$s1_big"
        fi
        stop_server
      fi ;;
    disk-tier)  # issue 27's adapters beyond host memory, served: one server with HOST_BUDGET (the machine's
      # default unless DISK_BUDGET says otherwise), S2 over N_BIG adapters, then the same arrivals and lengths over
      # DISK_FIT adapters, which fit in that budget (the goal: >= 0.9 of the second's throughput). make_adapters
      # hard-links the adapters to a few weight files (the GPU host's disk holds 64 GiB): what is beyond host memory
      # is read back from the page cache, the tier below host memory that the disk tier counts on
      local s2_big s2_fit
      s2_big=$(trace s2 "$N_BIG"); s2_fit=$(trace s2 "$DISK_FIT")
      if HOST_BUDGET=$DISK_BUDGET start_server S2; then
        serving slora "$s2_big" "$s2_fit"
      fi
      stop_server ;;
    unified-paging)  # issue 27's ablation (S-LoRA's Fig. 5), in process: S2 over N_BIG adapters, long sequences
      # (ABL_LENGTHS) at ABL_RATE, the pool cut to ABL_POOL so that KV and adapters compete; the unified pool, then
      # the same engine with ABL_REGION of the pool's pages reserved for adapters (adapter_region_fraction)
      local long pool="pool_bytes=$ABL_POOL"
      long=$(LENGTHS=$ABL_LENGTHS RATE=$ABL_RATE trace s2 "$N_BIG")
      ENGINE_PREFIX=unified ENGINE_OPTS="$ENGINE_OPTS $pool" engine "$KERNEL" S2 "$long"
      ENGINE_PREFIX=region-$ABL_REGION ENGINE_OPTS="$ENGINE_OPTS $pool adapter_region_fraction=$ABL_REGION" \
        engine "$KERNEL" S2 "$long" ;;
    heavy-floor)  # issue 27's S2 / S-all target: LoRA runs over adapters the host budget holds (so the disk
      # tier does not decide the figure), against their base run (perf.report's bytes floor) and n=5
      local prefix=s2 n=$DISK_FIT heavy five
      [[ $HEAVY == Sall ]] && prefix=sall n=$N_SALL
      heavy=$(trace "$prefix" "$n"); five=$(trace "$prefix" 5)
      if start_server "$HEAVY"; then
        serving slora "$heavy" "$heavy@base" "$five"
      fi
      stop_server ;;
    latency)  # issue 27's TTFT at fractions of capacity: one call, the capacity run then its 0.5x and 0.8x runs,
      # whose traces (s1-nN-at50.jsonl, -at80) go beside the one they come from
      (( DURATION < 60 )) && log "latency: ${DURATION}s traces are short of S-LoRA's 60 s (the report flags them)"
      if start_server S1; then
        serving slora --sweep --trace-dir "$(dirname "$s1_big")" "$s1_big"
      fi
      stop_server ;;
    genai)  # genai-perf alone against the served ensemble (S1 adapters preloaded)
      start_server S1 && genai_perf
      stop_server ;;
    checks)  # correctness on the GPU, then issue 4's decode-step target (graphs on/off, adapters on/off)
      local root
      root=$(adapters S1)
      # shellcheck disable=SC2086
      SLORA_ALLOW_NO_DEFAULT_MODEL=1 step -m pytest -q -p no:cacheprovider $CHECK_PATHS -k "$CHECK_K"
      if (( DECODE_STEP )); then
        step -m perf.bench_decode_step --model "$MODEL" --load-format dummy --adapter-root "$root" \
          --batch 1 8 64 --out "$OUT/decode_step.json"
        step -m perf.bench_host_step --model "$MODEL" --adapter-root "$root" --device "$DEVICE" --seqs 256 \
          --prompt-len 300 --out "$OUT/host_step.json"
      fi
      if (( HOST_FORWARD )); then  # this host's Python: the same measurement as on the CPU machine, to compare
        [[ -f $WORK/deep/config.json ]] || step -m perf.make_model --shape tiny-deep --out "$WORK/deep"
        [[ -d $WORK/deep-adapters ]] || step -m perf.make_adapters --model "$WORK/deep" --setting S1 -n 128 \
          --out "$WORK/deep-adapters"
        step -m perf.bench_host_forward --model "$WORK/deep" --adapter-root "$WORK/deep-adapters" --seqs 128 \
          --out "$OUT/host_forward.json"
      fi ;;
    projections)  # the projection GEMM against cuBLAS, then decode steps with it (triton_gemm=true) and without
      local s1_root gemm_option
      s1_root=$(adapters S1)
      step -m perf.bench_lora_gemm --sweep --out "$OUT/lora_gemm.json"
      for gemm in 1 0; do
        gemm_option=$([[ $gemm == 1 ]] && echo true || echo false)
        step -m perf.bench_decode_step --engine-option "triton_gemm=$gemm_option" --model "$MODEL" \
          --load-format dummy --adapter-root "$s1_root" --batch 1 8 16 --steps 30 \
          --out "$OUT/decode_step_gemm$gemm.json"
      done ;;
    pdl)  # the shrink launched with PDL: one layer's LoRA, then whole decode steps with it, without it, on cuBLAS
      local s1_root tag
      s1_root=$(adapters S1)
      step -m perf.bench_lora_gemm --out "$OUT/lora_layer.json"
      step -m perf.bench_lora_kinds --tokens 16 64 --behind-gemm --out "$OUT/lora_kinds_gemm.json"
      for tag in pdl no-pdl cublas; do
        # shellcheck disable=SC2046
        step -m perf.bench_decode_step $(pdl_settings "$tag") --model "$MODEL" --load-format dummy \
          --adapter-root "$s1_root" --batch 1 16 32 64 --steps 30 --out "$OUT/decode_step_$tag.json"
      done ;;
    few)  # the few-adapters rule (EngineConfig.few_adapters_*): decode steps of few adapters under it and under #68's
      local s1_root s2_root rule
      s1_root=$(adapters S1)
      s2_root=$(adapters S2)
      for rule in $FEW_RULES; do
        # shellcheck disable=SC2086
        (few=(--engine-option "few_adapters_min_tokens=${rule%,*}" --engine-option "few_adapters_max=${rule#*,}")
          step -m perf.bench_decode_step "${few[@]}" --model "$MODEL" --load-format dummy --adapter-root "$s2_root" \
            --batch $FEW_BATCHES --adapter-counts 4 24 -1 --graphs-only --steps 30 --out "$OUT/few_s2_${rule/,/-}.json"
          step -m perf.bench_decode_step "${few[@]}" --model "$MODEL" --load-format dummy --adapter-root "$s1_root" \
            --batch $FEW_BATCHES --adapter-counts 5 -1 --graphs-only --steps 30 --out "$OUT/few_s1_${rule/,/-}.json")
      done ;;
    s2-floor)  # whole decode steps at the S2 runs' batch: does a LoRA step pay more than its adapters' bytes?
      # shellcheck disable=SC2086
      step -m perf.bench_decode_step --model "$MODEL" --load-format dummy \
        --adapter-root "$(adapters "$FLOOR_SETTING")" --batch $FLOOR_BATCH --prompt-len "$FLOOR_PROMPT" \
        --adapter-counts $FLOOR_COUNTS --out "$OUT/s2_floor${FLOOR_TAG}.json" ${FLOOR_GRAPHS_ONLY:+--graphs-only} \
        ${FLOOR_PROFILE:+--profile "$OUT/s2_profile${FLOOR_TAG}.txt"} ;;
    peft)
      s1_100=$(trace s1 100)
      engine "$KERNEL" S1 "$s1_5" "$s1_100"
      peft "$s1_5" "$s1_100" ;;
    peft-only)  # after engine-s1 in the same call, which has the engine runs on the same n = 5 and 100 traces
      s1_100=$(trace s1 100)
      peft "$s1_5" "$s1_100" ;;
    tenants)
      tenants ;;
    *)
      log "unknown suite $1 (all, headline, lora-vs-base, engine-s1, engine-s2, s2-ratio, engine-sall, bmm, serving-s1, served, served-both, served-apis, ensemble-alias, defaults, heavy-floor, latency, genai, s2-floor, projections, pdl, few, checks, peft, peft-only, tenants)"; return 2 ;;
  esac
}

# GPU_LOG=1: the GPU's clocks, power and temperature every 200 ms while the suites run, in gpu_log.csv (engine
# runs keep the GPU at full load, where clocks may be lower than in the short kernel benchmarks).
start_gpu_log() {
  [[ -n $GPU_LOG && $DEVICE == cuda* ]] || return 0
  nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,utilization.gpu \
    --format=csv -lms 200 >"$OUT/gpu_log.csv" 2>>"$LOG" &
  GPU_LOG_PID=$!
}

finish() {
  [[ -n $GPU_LOG_PID ]] && kill "$GPU_LOG_PID" 2>/dev/null
  stop_server
  if [[ -f $RESULTS ]]; then
    "$PY" -m perf.report "$RESULTS" --out "$OUT/report.md" >>"$LOG" 2>&1 || log "report failed"
    "$PY" -m perf.plot "$RESULTS" --out-dir "$OUT" >>"$LOG" 2>&1 || log "plots failed (matplotlib?)"
  fi
  keep_only
  log "done in $(elapsed)s; outputs in $OUT: $(find "$OUT" -maxdepth 1 -type f -printf "%f " )"
}

# KEEP="report.md run.log results.json": remove the other files of $OUT at the end, so that two or three suites
# in one call (each with its own OUT under the call's) stay within the files a call brings back.
keep_only() {
  [[ -n $KEEP ]] || return 0
  local file
  while IFS= read -r -d '' file; do
    [[ " $KEEP " == *" ${file##*/} "* ]] || rm -f "$file"
  done < <(find "$OUT" -maxdepth 1 -type f -print0)
}
trap finish EXIT

SUITES=("$@")
(( ${#SUITES[@]} )) || SUITES=(all)
setup "${SUITES[@]}"
start_gpu_log
for s in "${SUITES[@]}"; do
  log "=== suite $s ($(remaining)s left)"
  suite "$s"
done
