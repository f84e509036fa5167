#!/usr/bin/env bash
# On a machine with 16 cores or more (the GPU machine's host): what 2 cores cannot settle, with a
# core a rank. Expert and context parallelism's bit-for-bit proofs at 8 ranks (Gloo and shm), then
# their benchmarks at 8 ranks. Everything it prints and writes lands in $OUT (default ./eight-out).
#
#     bash benchmarks/eight_ranks.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-eight-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
day=$(date -u +%F)
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >/dev/null 2>&1 || export PYTHONPATH=$PWD
cores=$(nproc)
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 | grep -o 'H[0-9]*' | tr 'A-Z' 'a-z')
where="${gpu:-cpu}-host-8of${cores}cores"  # the machine, as benchmarks/results names it
python3 -c "import torch; print('torch', torch.__version__, '$cores cores')" | tee "$OUT/machine.txt"

# the proofs at 8 ranks: the tests' own comparisons, run on 8 ranks instead of 2 and 4
taskset -c 0-7 python3 -m tests.at_eight_ranks 2>&1 | tee "$OUT/proofs-8ranks.txt"

taskset -c 0-7 python3 -m benchmarks.expert_parallel --nproc 8 --experts 16 --top-k 2 \
    --json "$OUT/expert-parallel_shm-${where}_8ranks_${day}.json" \
    --plot "$OUT/expert-parallel_shm-${where}_8ranks_${day}.png" 2>&1 \
    | tee "$OUT/expert-parallel_shm-${where}_8ranks_${day}.txt"
taskset -c 0-7 python3 -m benchmarks.context_parallel --ranks 1 2 4 8 --seq 1024 2048 4096 8192 --rounds 5 \
    --json "$OUT/context-parallel_shm-${where}_8ranks_${day}.json" \
    --plot "$OUT/context-parallel_shm-${where}_8ranks_${day}.png" 2>&1 \
    | tee "$OUT/context-parallel_shm-${where}_8ranks_${day}.txt"
