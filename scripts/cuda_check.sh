#!/usr/bin/env bash
# Every CUDA check in one command, for a machine with a GPU, sized to finish in under 8 minutes:
#   bash scripts/cuda_check.sh        # CUDA tests, then a short CUDA benchmark (bf16, H=4096, V=128256)
# Works offline on a machine that already has torch (>=2.11), pytest and hypothesis, such as the
# GPU machines this project borrows: tile_pass is installed without dependency resolution, or run
# from this source tree when that fails (tests/conftest.py registers backend="tile_pass" then).
# Writes cuda_check/ (test log, benchmark JSON) beside the scripts, or under $OUT when it is set.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-cuda_check}"
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
python -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; \
print('torch', torch.__version__, '|', torch.cuda.get_device_name())" || exit 1
python -m pip install --quiet --no-deps --no-build-isolation --no-index -e . 2>/dev/null \
  || echo "tile_pass not installed (offline, no setuptools?): running from the source tree"
status=0
# 1. every CUDA case (slow ones included), at most 5 minutes
timeout 300 python -m pytest -q -k cuda -m "not slow or slow" -p no:cacheprovider \
  2>&1 | tee "$out/cuda_tests.log" | tail -n 30
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
# 2. the benchmark at two lengths, tile_pass against plain Inductor, at most 2.5 minutes
timeout 150 python -m tile_pass.bench --device cuda --dtype bfloat16 --hidden 4096 --vocab 128256 \
  --tokens 8192,16384 --impl inductor,tile_pass --repeats 3 --timeout 70 --markdown \
  --json "$out/cuda_bench.json" || status=1
exit "$status"
