#!/usr/bin/env bash
# The checks to run on a machine with one GPU:
# the CUDA tests, then the NCCL world-size-1 and Gloo+CUDA (2 ranks on one GPU) bandwidth runs.
# Everything it prints and writes lands in $OUT (default: ./gpu-out).
#
#     bash benchmarks/gpu_checks.sh tests      # the GPU tests and the CUDA-aware parts of the suite
#     bash benchmarks/gpu_checks.sh bandwidth  # NCCL world size 1 and Gloo+CUDA 2 ranks, nccl-tests tables
#                                              (one of them: nccl or gloo-cuda)
#     bash benchmarks/gpu_checks.sh train      # ddp_from_scratch.train on NCCL, world size 1, each --impl, with --amp;
#                                              then --impl torch twice, with and without --deterministic
#     bash benchmarks/gpu_checks.sh suite      # the whole suite on the GPU machine (CUDA visible)
#
# The machine has its own torch (no network there); the project is installed over it without
# dependencies, so the torch version in the results is the machine's, printed at the top.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
what=${1:-tests}
day=$(date -u +%F)

python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >/dev/null 2>&1 \
    || export PYTHONPATH=$PWD
{
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
    python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'nccl', '.'.join(map(str, torch.cuda.nccl.version())), 'gpus', torch.cuda.device_count())"
} 2>&1 | tee "$OUT/machine.txt"
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | tr -cs 'A-Za-z0-9' '-' | sed 's/-$//' | tr 'A-Z' 'a-z')

case $what in
tests)
    # the GPU files, then every other test whose name says cuda, gpu or nccl (those two files not again)
    python3 -m pytest -n 4 -q -rfEs tests/collectives/test_gpu.py tests/ddp/test_gpu_ddp.py 2>&1 | tee "$OUT/gpu-tests.txt"
    python3 -m pytest -n 4 -q -rfEs -k "cuda or gpu or nccl" tests --ignore=tests/collectives/test_gpu.py \
        --ignore=tests/ddp/test_gpu_ddp.py 2>&1 | tee -a "$OUT/gpu-tests.txt"
    ;;
bandwidth|nccl|gloo-cuda)
    [ "$what" = gloo-cuda ] || python3 -m benchmarks.bandwidth --world-size 1 --backend nccl --device cuda -c all -b 8 -e 1G -n 20 -w 5 \
        --limits --json "$OUT/bandwidth_nccl-${gpu}_1rank_$day.json" \
        --plot "$OUT/bandwidth_nccl-${gpu}_1rank_$day.png" 2> >(grep -v "^\[round " >&2) | tee "$OUT/bandwidth_nccl-${gpu}_1rank_$day.txt"
    [ "$what" = nccl ] || python3 -m benchmarks.bandwidth --world-size 2 --backend gloo --device cuda -c all -b 8 -e 256M -n 10 -w 3 \
        --limits --json "$OUT/bandwidth_gloo-cuda-${gpu}_2ranks_$day.json" \
        --plot "$OUT/bandwidth_gloo-cuda-${gpu}_2ranks_$day.png" 2> >(grep -v "^\[round " >&2) | tee "$OUT/bandwidth_gloo-cuda-${gpu}_2ranks_$day.txt"
    ;;
train)
    for impl in torch naive flat bucketed; do
        for amp in "" --amp; do
            echo "== --impl $impl $amp" | tee -a "$OUT/train.txt"
            python3 -m ddp_from_scratch.train --nproc 1 --impl $impl --synthetic --train-size 512 --test-size 256 \
                --batch-size 64 $amp --json "/tmp/train-$impl${amp:+-amp}.json" 2>&1 | grep -v "^step" | tee -a "$OUT/train.txt"
        done
    done
    python3 -m benchmarks.cuda_determinism 2>&1 | tee -a "$OUT/train.txt"  # one step repeated in one process
    # run to run: the same command twice, its 8 losses; fp32 on CUDA differs without --deterministic
    for det in "" --deterministic; do
        for run in 1 2; do
            echo "== --impl torch $det, run $run, losses:" $(python3 -m ddp_from_scratch.train --nproc 1 --impl torch --synthetic \
                --train-size 512 --test-size 256 --batch-size 64 $det 2>&1 | tr '\r' '\n' | grep -E "^epoch .* step" | awk '{print $6}') \
                | tee -a "$OUT/train.txt"
        done
    done
    ;;
suite)
    timeout "${SUITE_TIMEOUT:-540}" python3 -m pytest -q -rfEs -x --durations=15 2>&1 | tee "$OUT/suite.txt"
    ;;
*)
    echo "usage: bash benchmarks/gpu_checks.sh tests|bandwidth|train|suite" >&2
    exit 2
    ;;
esac
