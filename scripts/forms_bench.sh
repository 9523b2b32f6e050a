#!/usr/bin/env bash
# The loss forms against plain Inductor as issues 24 and 46 read them: ce, ce_zloss, grpo,
# grpo_trl, entropy, kl_teacher, dpo and distill at N=2048 and 4096, H=512, V=32000, every 7th
# label ignored and every token labelled, each row in a fresh process and the steps interleaved in
# one (ratios paired by round), the GEMM floor of each form in the same run. Steps are timed under
# the shell's allocator (glibc's defaults unless MALLOC_* is set), the peak under a pinned one;
# every table names the CPU and both settings (docs/benchmarks.md, "Every CPU model").
#   bash scripts/forms_bench.sh [device] [dtypes]      # default: cpu bfloat16
#   bash scripts/forms_bench.sh cuda bfloat16,float32
# bfloat16 wants a CPU with bf16 arithmetic (AVX-512 BF16, AMX) or a GPU: on an AVX2-only CPU one
# bf16 step at N=2048 takes ~80 s (docs/benchmarks.md). TOKENS=... overrides the lengths.
# Writes forms_bench/ (a JSON and a Markdown table per dtype and label setting), or under $OUT.
set -euo pipefail
cd "$(dirname "$0")/.."
device="${1:-cpu}"
dtypes="${2:-bfloat16}"
out="${OUT:-forms_bench}"
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
for dtype in ${dtypes//,/ }; do
  for ignore in 7 0; do
    name="$out/forms_${device}_${dtype}_ignore${ignore}"
    python -m tile_pass.bench --impl inductor,tile_pass \
      --form ce,ce_zloss,grpo,grpo_trl,entropy,kl_teacher,dpo,distill --tokens "${TOKENS:-2048,4096}" \
      --hidden 512 --vocab 32000 --device "$device" --dtype "$dtype" --ignore-every "$ignore" \
      --repeats 3 --interleave 5 --markdown --json "$name.json" | tee "$name.md"
  done
done
