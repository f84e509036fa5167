#!/usr/bin/env bash
# Across two namespace hosts (collectives.cluster; needs root), each host's link shaped to RATE by
# tc tbf, or not shaped ("none"):
#  1. all_reduce busbw, torchrun 2 hosts x 1 rank, Gloo (nccl-tests' convention: a ring
#     all_reduce's busbw approaches the link's bandwidth);
#  2. on a shaped link, the algorithms race on 2 hosts x 2 ranks (every from-scratch all_reduce,
#     hierarchical among them, against Gloo's), each time beside the simulator's prediction on the
#     two-level topology (the fitted model within a host, RATE through the link's token bucket
#     between hosts, CPU costs scaled for ranks sharing cores); `python -m benchmarks.studies.race_ablation
#     benchmarks/results/algorithms-race_*2hosts*.json` then shows what each part of that model buys.
#
#  3. with delay=D or loss=P: node1's egress delayed by D or a share P of it dropped (the cluster's
#     user-space wire, collectives/cluster/wire.py), the all_reduce benchmark from 8 bytes to 4 MiB.
#  4. with powersgd=RATE: our DDP's step time with plain all_reduce, fp16 and PowerSGD rank 1,
#     alternated in one run (benchmarks.powersgd time), the small CNN and ResNet-50, 2 hosts x 1 rank.
#  5. with pipeline=RATE: the pipeline schedules' step time and bubble against microbatches
#     (benchmarks.pipeline_parallel), a stage on each host, Gloo between them.
#
#     bash benchmarks/across_hosts.sh 500mbit 1gbit 2gbit 4gbit none    # writes benchmarks/results/across-hosts_*, algorithms-race_*2hosts*
#     bash benchmarks/across_hosts.sh delay=100ms loss=1%
#     bash benchmarks/across_hosts.sh powersgd=500mbit powersgd=1gbit     # writes benchmarks/results/powersgd-time_*
#     bash benchmarks/across_hosts.sh pipeline=1gbit pipeline=100mbit    # writes benchmarks/results/pipeline-parallel_*2hosts*
set -euo pipefail
for arg in "$@"; do  # before anything touches the cluster
  case "$arg" in
    -h|--help) sed -n '2,22p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    -*) echo "across_hosts.sh: unknown option $arg: the arguments are link rates (1gbit), none, delay=D or loss=P (--help for usage)" >&2; exit 2 ;;
  esac
done
cd "$(dirname "$0")/.."
day=$(date +%F)
torchrun_on_both() {  # nproc-per-node, rdzv-id, program args...: torchrun on node0 and node1 at once
  local nproc=$1 id=$2; shift 2
  for h in node0 node1; do
    python -m collectives.cluster run "$h" -- python -m torch.distributed.run --nnodes 2 --nproc-per-node "$nproc" \
      --rdzv-backend c10d --rdzv-endpoint node0:29500 --rdzv-id "$id" "$@" > "/tmp/across-$h.txt" 2>&1 &
  done
  wait
}
rates=("$@"); [ $# -gt 0 ] || rates=(1gbit none)
for rate in "${rates[@]}"; do
  python -m collectives.cluster down >/dev/null
  case "$rate" in delay=*|loss=*)  # a slow or lossy link on node1
    flag=${rate%%=*} value=${rate#*=}
    up="python -m collectives.cluster up --nodes 2 --$flag $value --impair node1"
    $up >/dev/null
    out="benchmarks/results/across-hosts_gloo-cpu-2core_2hosts-node1-${flag}-${value/\%/pct}_${day}"
    torchrun_on_both 1 "bw-$flag" -m benchmarks.bandwidth -c all_reduce -b 8 -e 4M -f 8 -n 5 -w 1 --json "$out.json"
    { echo "# $up; torchrun 2 hosts x 1 rank:"
      echo "# python -m benchmarks.bandwidth -c all_reduce -b 8 -e 4M -f 8 -n 5 -w 1   ($(date -u +%FT%TZ), this machine: 2-core VM)"
      grep -v "hostname of the client\|^\*\|OMP_NUM_THREADS\|^$\|^\[all_reduce\]" /tmp/across-node0.txt
      sleep 1.2; echo "# node1's wire: $(python -m collectives.cluster status | grep 'wire pid' | sed 's/^ *//')"; } > "$out.txt"
    cat "$out.txt"
    continue;;
  esac
  case "$rate" in pipeline=*)  # the pipeline schedules, a stage a host, on a shaped link
    link=${rate#*=}
    python -m collectives.cluster up --nodes 2 --link "$link" >/dev/null
    out="benchmarks/results/pipeline-parallel_gloo-cpu-2core_2hosts-link-${link}_${day}"
    torchrun_on_both 1 "pp-$link" -m benchmarks.pipeline_parallel --stages 2 -m 2 4 8 16 --backend gloo \
      --json "$out.json"
    { echo "# python -m collectives.cluster up --nodes 2 --link $link; torchrun 2 hosts x 1 rank ($(date -u +%FT%TZ), this machine: 2-core VM):"
      grep -v "hostname of the client\|^\*\|OMP_NUM_THREADS\|^$" /tmp/across-node0.txt; } > "$out.txt"
    cat "$out.txt"
    continue;;
  esac
  case "$rate" in powersgd=*)  # our DDP's step time, plain / fp16 / PowerSGD, on a shaped link
    link=${rate#*=}
    python -m collectives.cluster up --nodes 2 --link "$link" >/dev/null
    for model in small resnet50; do
      out="benchmarks/results/powersgd-time_gloo-cpu-2core_2hosts-link-${link}-${model}_${day}"
      torchrun_on_both 1 "psgd-$link-$model" -m benchmarks.powersgd time --model "$model" --json "$out.json"
      { echo "# python -m collectives.cluster up --nodes 2 --link $link; torchrun 2 hosts x 1 rank ($(date -u +%FT%TZ), this machine: 2-core VM):"
        echo "# python -m benchmarks.powersgd time --model $model"
        grep -v "hostname of the client\|^\*\|OMP_NUM_THREADS\|^$" /tmp/across-node0.txt; } > "$out.txt"
      cat "$out.txt"
    done
    continue;;
  esac
  if [ "$rate" = none ]; then python -m collectives.cluster up --nodes 2 >/dev/null
  else python -m collectives.cluster up --nodes 2 --link "$rate" >/dev/null; fi
  up="python -m collectives.cluster up --nodes 2$( [ "$rate" = none ] || echo " --link $rate" )"
  out="benchmarks/results/across-hosts_gloo-cpu-2core_2hosts-link-${rate}_${day}"
  torchrun_on_both 1 "bw-$rate" -m benchmarks.bandwidth -c all_reduce -b 64K -e 64M -n 10 -w 3 --json "$out.json"
  { echo "# $up; torchrun 2 hosts x 1 rank:"
    echo "# python -m benchmarks.bandwidth -c all_reduce -b 64K -e 64M -n 10 -w 3   ($(date -u +%FT%TZ), this machine: 2-core VM)"
    grep -v "hostname of the client\|^\*\|OMP_NUM_THREADS\|^$\|^\[all_reduce\]" /tmp/across-node0.txt; } > "$out.txt"
  cat "$out.txt"
  [ "$rate" = none ] && continue  # the race's predictions need the link's rate
  race="benchmarks/results/algorithms-race_gloo-cpu-2core_2hosts-x2ranks-link-${rate}_${day}"
  torchrun_on_both 2 "race-$rate" -m benchmarks.algorithms -c all_reduce -b 1M -e 64M -f 2 --link "$rate" \
    --json "$race.json"
  { echo "# $up; torchrun 2 hosts x 2 ranks ($(date -u +%FT%TZ), this machine: 2-core VM):"
    grep -v "hostname of the client\|^\*\|OMP_NUM_THREADS\|^\[all_reduce\]" /tmp/across-node0.txt; } > "$race.txt"
  cat "$race.txt"
done
python -m collectives.cluster down >/dev/null
