#!/usr/bin/env bash
# all_reduce busbw across two namespace hosts (torchrun, 1 rank per host, Gloo) with each host's
# link shaped to RATE by tc tbf, or not shaped ("none"); nccl-tests' convention: a ring
# all_reduce's busbw approaches the link's bandwidth. Needs root (collectives.cluster).
#
#     bash benchmarks/across_hosts.sh 1gbit none          # writes benchmarks/results/across-hosts_*.{json,txt}
set -euo pipefail
cd "$(dirname "$0")/.."
day=$(date +%F)
for rate in "${@:-1gbit none}"; do
  python -m collectives.cluster down >/dev/null
  if [ "$rate" = none ]; then python -m collectives.cluster up --nodes 2 >/dev/null
  else python -m collectives.cluster up --nodes 2 --link "$rate" >/dev/null; fi
  out="benchmarks/results/across-hosts_gloo-cpu-2core_2hosts-link-${rate}_${day}"
  for h in node0 node1; do
    python -m collectives.cluster run "$h" -- python -m torch.distributed.run --nnodes 2 --nproc-per-node 1 \
      --rdzv-backend c10d --rdzv-endpoint node0:29500 --rdzv-id "bw-$rate" \
      -m benchmarks.bandwidth -c all_reduce -b 64K -e 64M -n 10 -w 3 --json "$out.json" > "/tmp/across-$h.txt" 2>&1 &
  done
  wait
  { echo "# python -m collectives.cluster up --nodes 2 $( [ "$rate" = none ] || echo "--link $rate" ); torchrun 2 hosts x 1 rank:"
    echo "# python -m benchmarks.bandwidth -c all_reduce -b 64K -e 64M -n 10 -w 3   ($(date -u +%FT%TZ), this machine: 2-core VM)"
    grep -v "hostname of the client\|^\*\|OMP_NUM_THREADS\|^$\|^\[all_reduce\]" /tmp/across-node0.txt; } > "$out.txt"
  cat "$out.txt"
done
python -m collectives.cluster down >/dev/null
