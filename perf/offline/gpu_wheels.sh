#!/usr/bin/env bash
# Make the offline bundle (.whl/) for a GPU host without a package registry: perf/offline/bundle.py does the work,
# perf/offline/README.md says how to carry and use it.
#   bash perf/offline/gpu_wheels.sh               (from anywhere; the bundle goes to .whl/ at the repository root)
#   bash perf/offline/gpu_wheels.sh --dry-run     (the plan, nothing fetched)
#   bash perf/offline/gpu_wheels.sh --python 3.11 (a host with another Python)
set -euo pipefail
cd "$(dirname "$0")/../.."
exec "${PY:-python3}" perf/offline/bundle.py "$@"
