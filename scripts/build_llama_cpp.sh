#!/usr/bin/env bash
# Build the pinned llama.cpp tools once per machine into a cache keyed by version.
#
# Why from source: llama-quantize (K-quants, imatrix mixtures), llama-imatrix, llama-perplexity,
# llama-tokenize and llama-mtmd-cli (the projector check of a VLM) are what the GGUF exporter and
# its tests run as the real consumer of a GGUF file; no registry ships them as binaries. The source
# is the llama.cpp that the PyPI sdist llama-cpp-python==$VERSION vendors, fetched with pip like
# every other dependency.
# llama-quantize is built as it is: this version already converts and quantizes each tensor in
# row blocks of --max-buffer-size bytes (the service's MODELPREP_QUANTIZER_BUFFER), so no patch;
# tests/integration/exporters/gguf/test_quantize_blocks.py fails if a version changes a byte
# with the block.
#
# Usage: scripts/build_llama_cpp.sh [VERSION]   (default: the version service/shims/llama_cpp.py pins)
# Output: $MODELPREP_CACHE_HOME/llama.cpp/$VERSION/bin/llama-*  (MODELPREP_CACHE_HOME defaults to
#         ${XDG_CACHE_HOME:-~/.cache}/modelprep), and .../$VERSION/convert/{conversion,gguf-py}: the
#         same llama.cpp's HF->GGUF converter classes (and convert_lora_to_gguf.py, whose LoRA
#         tensor class the GGUF LoRA export uses), used as a library by
#         service/shims/llama_cpp_convert/, and the gguf-py they need (newer than PyPI's gguf
#         of the same version string), which scripts/install_gguf_py.sh makes the venv's `gguf`.
#         A second run with everything present does nothing.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
VERSION=${1:-$(sed -n 's/^LLAMA_CPP_PYTHON_VERSION = "\(.*\)"$/\1/p' "$here/service/shims/llama_cpp.py")}
[ -n "$VERSION" ] || { echo "build_llama_cpp: no version" >&2; exit 2; }
cache=${MODELPREP_CACHE_HOME:-${XDG_CACHE_HOME:-$HOME/.cache}/modelprep}
dest=$cache/llama.cpp/$VERSION
TOOLS=(llama-quantize llama-imatrix llama-perplexity llama-tokenize llama-simple llama-completion
       llama-embedding llama-gguf-split llama-mtmd-cli)

have_bins() { for t in "${TOOLS[@]}"; do [ -x "$dest/bin/$t" ] || return 1; done; }
have_convert() { [ -f "$dest/convert/conversion/__init__.py" ] && [ -f "$dest/convert/gguf-py/gguf/__init__.py" ] \
  && [ -f "$dest/convert/convert_lora_to_gguf.py" ]; }
have_all() { have_bins && have_convert; }
if have_all; then echo "llama.cpp $VERSION: cached in $dest"; exit 0; fi

mkdir -p "$cache/llama.cpp"
exec 9>"$cache/llama.cpp/.build-$VERSION.lock"
flock 9                                   # two CI runs or make targets never build at once
if have_all; then echo "llama.cpp $VERSION: built by another process in $dest/bin"; exit 0; fi

work=$(mktemp -d "$cache/llama.cpp/.work-$VERSION.XXXXXX")
trap 'rm -rf "$work"' EXIT
# the sdist (llama.cpp itself has no wheel); only it: `--no-binary :all:` would also compile
# every build dependency pip installs to read its metadata (ninja, cmake...) from source
python3 -m pip download --quiet --no-deps --no-binary llama-cpp-python "llama-cpp-python==$VERSION" -d "$work"
tar xzf "$work"/llama_cpp_python-"$VERSION".tar.gz -C "$work"
src=$work/llama_cpp_python-$VERSION/vendor/llama.cpp
mkdir -p "$work/convert"
cp -r "$src/conversion" "$src/gguf-py" "$src/convert_hf_to_gguf.py" "$src/convert_lora_to_gguf.py" \
  "$src/LICENSE" "$work/convert/"
if have_bins && [ -f "$dest/convert/conversion/__init__.py" ]; then
  # a cache from before the LoRA converter was kept: add that one file, renamed into place (the
  # converter classes beside it may be in use by a running job)
  cp "$work/convert/convert_lora_to_gguf.py" "$dest/convert/.convert_lora_to_gguf.py.tmp"
  mv "$dest/convert/.convert_lora_to_gguf.py.tmp" "$dest/convert/convert_lora_to_gguf.py"
  echo "llama.cpp $VERSION: LoRA converter added to $dest/convert"; exit 0
fi
if have_bins; then                        # a cache from before the converter was kept: add it
  rm -rf "$dest/convert" && mv "$work/convert" "$dest/convert"
  echo "llama.cpp $VERSION: converter classes added to $dest/convert"; exit 0
fi

flags=(-DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF
       -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF)
if [ "$(uname -m)" = x86_64 ]; then
  # x86-64-v3 rather than -march=native: the cache (and an image built here) runs on any AVX2 CPU.
  flags+=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON)
fi
echo "llama.cpp $VERSION: building ${TOOLS[*]} (several minutes, once per machine)"
cmake -S "$src" -B "$work/build" "${flags[@]}" > "$work/cmake.log" 2>&1 \
  || { tail -30 "$work/cmake.log" >&2; exit 1; }
nice -n 5 cmake --build "$work/build" -j "$(nproc)" --target "${TOOLS[@]}" > "$work/build.log" 2>&1 \
  || { tail -40 "$work/build.log" >&2; exit 1; }

mkdir -p "$work/out/bin"
for t in "${TOOLS[@]}"; do cp "$work/build/bin/$t" "$work/out/bin/"; done
cp "$src/LICENSE" "$work/out/LICENSE"
mv "$work/convert" "$work/out/convert"
echo "$VERSION" > "$work/out/VERSION"
rm -rf "$dest" && mv "$work/out" "$dest"     # the directory appears whole or not at all
echo "llama.cpp $VERSION: built into $dest/bin"
