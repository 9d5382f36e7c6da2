# Source on the GPU host, from the repository root, after carrying the bundle there:   source .whl/gpu-env.sh
# (perf/offline/bundle.py copies this file into the bundle; perf/offline/README.md.) It installs the bundle's wheels
# and its Triton server under $SLORA_OFFLINE_DIR (default /tmp; once per machine: later calls reuse them) and exports
#   PYTHONPATH             the carried packages, then the interpreter's site-packages (the Python stub needs both)
#   TRITONSERVER_ROOT      the folder of bin/tritonserver and backends/ (slora-serve finds the server there)
#   LD_LIBRARY_PATH        the interpreter's libpython (the Python backend stub links it)
#   PERF_ANALYZER          the perf_analyzer binary (perf/perf_analyzer.sh, genai-perf)
#   SLORA_STUB_PYTHONPATH  NumPy 1 for the Python-backend stub alone, when the bundle has stub/ (backend/stub_compat.py)
# Knobs: SLORA_OFFLINE_DIR, PY (the interpreter, python3). Sourced: it sets no shell options and exits nothing.
_slora_whl="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
_slora_dir=${SLORA_OFFLINE_DIR:-/tmp}
_slora_py=${PY:-python3}
_slora_ver=$("$_slora_py" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
if compgen -G "$_slora_whl/*.whl" >/dev/null; then
  "$_slora_py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$_slora_dir/site" "$_slora_whl"/*.whl >/dev/null 2>&1 || echo "gpu-env: wheel install failed" >&2
fi
_slora_archive=$(compgen -G "$_slora_whl/tritonserver-py*.tar.xz" | head -1)
export TRITONSERVER_ROOT=$_slora_dir/triton/pytriton/tritonserver
if [[ -n $_slora_archive && ! -x $TRITONSERVER_ROOT/bin/tritonserver ]]; then
  mkdir -p "$_slora_dir/triton" && tar -xJf "$_slora_archive" -C "$_slora_dir/triton"
fi
_slora_stub=$TRITONSERVER_ROOT/python_backend_stubs/$_slora_ver/triton_python_backend_stub
if [[ -f $_slora_stub ]]; then
  chmod +x "$TRITONSERVER_ROOT/bin/tritonserver" "$_slora_stub"
  cp -f "$_slora_stub" "$TRITONSERVER_ROOT/backends/python/"
else
  echo "gpu-env: the bundle has no Triton Python stub for Python $_slora_ver" \
    "(make it with: python3 perf/offline/bundle.py --python $_slora_ver)" >&2
fi
export PYTHONPATH="$_slora_dir/site:$("$_slora_py" -c 'import site; print(site.getsitepackages()[0])')${PYTHONPATH:+:$PYTHONPATH}"
export LD_LIBRARY_PATH="$("$_slora_py" -c 'import sysconfig; print(sysconfig.get_config_var("LIBDIR"))')${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export PERF_ANALYZER=$_slora_dir/site/perf_analyzer/bin/perf_analyzer
chmod +x "$PERF_ANALYZER" 2>/dev/null || true
if compgen -G "$_slora_whl/stub/*.whl" >/dev/null; then
  "$_slora_py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$_slora_dir/stub-site" "$_slora_whl"/stub/*.whl >/dev/null 2>&1 \
    && export SLORA_STUB_PYTHONPATH=$_slora_dir/stub-site || echo "gpu-env: stub NumPy install failed" >&2
fi
unset _slora_whl _slora_dir _slora_py _slora_ver _slora_archive _slora_stub
