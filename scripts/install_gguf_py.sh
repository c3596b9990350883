#!/usr/bin/env bash
# Install the pinned llama.cpp's gguf-py as the one `gguf` package of a virtual environment.
#
# Why: llama.cpp's converter classes (service/shims/llama_cpp_convert/) need the gguf-py of
# the same llama.cpp, which is newer than PyPI's `gguf` of the same version string; the service's
# other users of `gguf` (the GGUF writer and reader, offload/quant.py's GGML blocks) work with it
# too. So the venv holds exactly that one `gguf` (tests/integration/test_one_gguf.py checks it) and no
# code swaps modules at run time.
#
# Usage: scripts/install_gguf_py.sh PIP [GGUF_PY_DIR [PIP_OPTION...]]
#   PIP          the environment's pip (.venv/bin/pip)
#   GGUF_PY_DIR  default (or ""): the gguf-py scripts/build_llama_cpp.sh keeps beside the tools
#   PIP_OPTION   passed to pip install (a mirror, a CA bundle: building gguf-py fetches poetry-core)
# A second run with the same files installed does nothing.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
pip=${1:?usage: scripts/install_gguf_py.sh PIP [GGUF_PY_DIR [PIP_OPTION...]]}
version=$(sed -n 's/^LLAMA_CPP_PYTHON_VERSION = "\(.*\)"$/\1/p' "$here/service/shims/llama_cpp.py")
cache=${MODELPREP_CACHE_HOME:-${XDG_CACHE_HOME:-$HOME/.cache}/modelprep}
src=${2:-$cache/llama.cpp/$version/convert/gguf-py}
shift $(( $# < 2 ? $# : 2 ))
[ -f "$src/gguf/__init__.py" ] || {
  echo "install_gguf_py: no gguf-py at $src; run scripts/build_llama_cpp.sh first" >&2; exit 2; }

python=$(dirname "$pip")/python
installed=$("$python" -c 'import os, gguf; print(os.path.dirname(gguf.__file__))' 2>/dev/null || true)
if [ -n "$installed" ] && diff -rq -x __pycache__ "$src/gguf" "$installed" >/dev/null 2>&1; then
  echo "gguf: llama.cpp $version's gguf-py is installed"; exit 0
fi
# --no-deps: its dependencies (numpy, tqdm, pyyaml, requests) come pinned with the service's own
"$pip" install --quiet --no-deps --force-reinstall "$@" "$src"
echo "gguf: installed llama.cpp $version's gguf-py from $src"
