#!/usr/bin/env bash
# Every CUDA check in one command, for a machine with a GPU:
#   bash scripts/cuda_check.sh            # tests on CUDA, then the CUDA benchmark (bf16, H=4096, V=128256)
# Writes cuda_bench.json and prints both; the CPU-only parts are skipped.
set -euo pipefail
cd "$(dirname "$0")/.."
python -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.cuda.get_device_name())"
python -m pytest -q -k cuda -m "not slow or slow"
python -m tile_pass.bench --device cuda --dtype bfloat16 --hidden 4096 --vocab 128256 \
    --tokens 4096,8192,16384,32768 --markdown --json cuda_bench.json
