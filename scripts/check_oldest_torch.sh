#!/usr/bin/env bash
# The oldest supported torch (2.11, what the borrowed GPU machines ship), on CPU, in its own venv:
#   bash scripts/check_oldest_torch.sh [VERSION]     # default 2.11.0; ~10 min download, ~5 min tests
# Not part of CI (the registry's 2.11 wheel is the CUDA build: it pulls ~3 GB of nvidia-* libraries
# to import). tile_pass is installed without dependency resolution, as on the GPU machines.
set -euo pipefail
cd "$(dirname "$0")/.."
version="${1:-2.11.0}"
venv="${VENV:-/tmp/venv-torch-$version}"
[ -x "$venv/bin/python" ] || python -m venv "$venv"
"$venv/bin/pip" install --quiet "torch==$version" pytest hypothesis "transformers==5.17.*" sympy numpy "setuptools>=77,<82"
"$venv/bin/pip" install --quiet --no-deps --no-build-isolation -e .
"$venv/bin/python" -c "import torch, tile_pass; print('torch', torch.__version__, '| tile_pass', tile_pass.__file__)"
shift $(( $# > 0 ? 1 : 0 ))
"$venv/bin/python" -m pytest -q -p no:cacheprovider "$@"
