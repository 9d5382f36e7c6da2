#!/usr/bin/env bash
# Prepare .whl/ for the GPU host: the shared bundle (Triton 2.51 server, tritonclient, perf_analyzer, gguf,
# gpu-env.sh) plus NumPy 1.26 for Python 3.12 in .whl/stub/. The host has NumPy 2, under which Triton 2.51's
# Python-backend stub corrupts input tensors (backend/stub_compat.py), while the host's SciPy and scikit-learn need
# NumPy 2: so NumPy 1.26 is for the stub alone. perf/run_gpu.sh installs it into /tmp/stub-site and names that
# folder in SLORA_STUB_PYTHONPATH (slora-serve puts it first on the stub's path); gpu-env.sh, which installs
# .whl/*.whl for every process, does not see it. genai-perf 0.0.16 and the modules it imports that the host lacks
# (orjson, soundfile, cffi, pycparser; checked there in session 12) go to .whl/genai/, installed by perf/genai_perf.sh.
#   bash perf/gpu_wheels.sh      (from the repository root; .whl/ is in .git/info/exclude)
set -euo pipefail
cd "$(dirname "$0")/.."
bash ../shared/tools/gpu-wheels.sh
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl/stub "numpy==1.26.4"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 --platform any \
  -d .whl/genai "genai-perf==0.0.16" "orjson" "soundfile" "cffi" "pycparser"
ls -la .whl .whl/stub .whl/genai
