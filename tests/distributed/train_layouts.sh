#!/usr/bin/env bash
# `octet train` end to end in every parallel layout it supports, under mpirun: each run's
# per-step losses (4 decimals, as printed) and gradient norms (3 decimals) must equal the
# single-process run's; --clip-grad 0.5 is below those norms, so a wrong norm would also
# change the losses. Usage:
#   train_layouts.sh OCTET_BINARY CONFIG
set -euo pipefail
octet="$1"
config="$2"
common=(--config "$config" --mock-data --precision fp32 --micro-batch-size 2
  --global-batch-size 8 --train-iters 3 --log-interval 1 --eval-iters 0 --peak-gflops 100
  --clip-grad 0.5)
losses() { grep -oE '(loss|grad norm) [0-9.]+' | head -n 6 | tr '\n' ' '; }
reference="$(OMP_NUM_THREADS=1 "$octet" train "${common[@]}" | losses)"
echo "single process: $reference"
[ -n "$reference" ] || { echo "no losses from the single-process run"; exit 1; }
status=0
run() {
  local ranks="$1" name="$2"
  shift 2
  local got
  got="$(OMP_NUM_THREADS=1 mpiexec -n "$ranks" --oversubscribe "$octet" train "${common[@]}" "$@" \
    | losses)"
  if [ "$got" = "$reference" ]; then
    echo "ok   $name: $got"
  else
    echo "FAIL $name: $got (expected $reference)"
    status=1
  fi
}
run 2 "DP=2" 
run 2 "DP=2 ZeRO-1" --use-distributed-optimizer
# ZeRO-1 in every layout: the clipping norm counts each parameter once over the model group.
run 4 "PP=2 x DP=2 ZeRO-1" --pipeline-model-parallel-size 2 --use-distributed-optimizer
run 2 "PP=2 DualPipe ZeRO-1 (DP=1)" --pipeline-model-parallel-size 2 --pipeline-schedule dualpipe \
  --use-distributed-optimizer
run 4 "TP=2 x DP=2 sequence-parallel ZeRO-1, 100k-element buckets" --tensor-model-parallel-size 2 \
  --sequence-parallel --use-distributed-optimizer --ddp-bucket-size 100000
run 4 "TP=2 x PP=2 sequence-parallel ZeRO-1 (DP=1)" --tensor-model-parallel-size 2 \
  --pipeline-model-parallel-size 2 --sequence-parallel --use-distributed-optimizer
run 2 "DP=2 reduce after backward" --no-overlap-grad-reduce
run 2 "PP=2 1F1B" --pipeline-model-parallel-size 2 --pipeline-schedule 1f1b
run 2 "PP=2 interleaved (1 chunk)" --pipeline-model-parallel-size 2 --pipeline-schedule interleaved \
  --virtual-pipeline-model-parallel-size 1
run 2 "PP=2 ZB1P" --pipeline-model-parallel-size 2 --pipeline-schedule zb1p
run 2 "PP=2 DualPipe" --pipeline-model-parallel-size 2 --pipeline-schedule dualpipe
run 4 "PP=2 x DP=2 (each chunk reduced after its last backward)" --pipeline-model-parallel-size 2
run 4 "PP=2 x DP=2 reduce after the step" --pipeline-model-parallel-size 2 --no-overlap-grad-reduce
run 4 "PP=2 x DP=2 ZB1P, 2 buckets" --pipeline-model-parallel-size 2 --pipeline-schedule zb1p \
  --ddp-bucket-size 100000
# gpt-tiny's vocabulary (50257) is odd: the TP=2 shards hold 25129 and 25128 rows.
run 2 "TP=2" --tensor-model-parallel-size 2
run 2 "TP=2 sequence-parallel" --tensor-model-parallel-size 2 --sequence-parallel
run 2 "TP=2 sequence-parallel, all-gathers overlapped with the GEMMs" \
  --tensor-model-parallel-size 2 --sequence-parallel --tp-comm-overlap
run 4 "TP=2 x DP=2 sequence-parallel (each layer reduced after its backward)" \
  --tensor-model-parallel-size 2 --sequence-parallel
run 4 "TP=2 x DP=2 sequence-parallel, 100k-element buckets" --tensor-model-parallel-size 2 \
  --sequence-parallel --ddp-bucket-size 100000
run 4 "TP=2 x DP=2 reduce after the step" --tensor-model-parallel-size 2 --no-overlap-grad-reduce
run 4 "TP=2 x PP=2 1F1B" --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2
run 2 "TP=2 sequence-parallel, recompute" --tensor-model-parallel-size 2 --sequence-parallel \
  --recompute-activations
run 4 "TP=2 x PP=2, recompute" --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 \
  --recompute-activations
run 4 "TP=2 x PP=2 sequence-parallel DualPipe" --tensor-model-parallel-size 2 \
  --pipeline-model-parallel-size 2 --pipeline-schedule dualpipe --sequence-parallel
# FP8 (delayed scaling, BF16 compute): amaxes reduced over the tensor (and data) ranks keep
# every rank on the single process's scales; BF16 roundings between the FP8 GEMMs make the
# numbers close, not equal (test_gpt_tensor_parallel holds them equal in F32 compute), so
# these losses must stay within 2e-3 of the single process's.
fp8_common=("${common[@]/fp32/fp8}")
fp8_losses() { grep -o 'loss [0-9.]*' | head -n 3 | tr '\n' ' '; }
fp8_reference="$(OMP_NUM_THREADS=1 "$octet" train "${fp8_common[@]}" | fp8_losses)"
close() {
  local ranks="$1" name="$2"
  shift 2
  local got
  got="$(OMP_NUM_THREADS=1 mpiexec -n "$ranks" --oversubscribe "$octet" train \
    "${fp8_common[@]}" "$@" | fp8_losses)"
  if [ -n "$got" ] && awk -v a="$got" -v b="$fp8_reference" 'BEGIN {
      n = split(a, x, " "); m = split(b, y, " "); if (n != m || n < 6) exit 1
      for (i = 2; i <= n; i += 2) { d = x[i] - y[i]; if (d < -0.002 || d > 0.002) exit 1 } }'
  then
    echo "ok   $name: $got (single process $fp8_reference)"
  else
    echo "FAIL $name: '$got' (expected within 2e-3 of $fp8_reference)"
    status=1
  fi
}
close 2 "FP8 TP=2" --tensor-model-parallel-size 2
close 2 "FP8 TP=2 sequence-parallel" --tensor-model-parallel-size 2 --sequence-parallel
close 4 "FP8 TP=2 x PP=2" --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2
close 2 "FP8 PP=2" --pipeline-model-parallel-size 2
close 4 "FP8 TP=2 x PP=2, recompute" --tensor-model-parallel-size 2 \
  --pipeline-model-parallel-size 2 --recompute-activations
# FP8 PP=2 computes exactly what one process does; so must its recomputation, although 1F1B
# runs micro-batch 1's forward (moving the delayed scales) before micro-batch 0's backward.
got="$(OMP_NUM_THREADS=1 mpiexec -n 2 --oversubscribe "$octet" train "${fp8_common[@]}" \
  --pipeline-model-parallel-size 2 --recompute-activations | fp8_losses)"
if [ "$got" = "$fp8_reference" ]; then
  echo "ok   FP8 PP=2 recompute: the single process's losses $got"
else
  echo "FAIL FP8 PP=2 recompute: '$got' (expected '$fp8_reference')"
  status=1
fi
# Validation runs through the pipeline stages (forward only): the single process's losses.
eval_common=(--config "$config" --mock-data --precision fp32 --micro-batch-size 2
  --global-batch-size 8 --train-iters 2 --log-interval 1 --eval-iters 3 --eval-interval 1
  --peak-gflops 100)
val_losses() { grep -o 'val loss [0-9.]*' | tr '\n' ' '; }
val_reference="$(OMP_NUM_THREADS=1 "$octet" train "${eval_common[@]}" | val_losses)"
validate() {
  local ranks="$1" name="$2"
  shift 2
  local got
  got="$(OMP_NUM_THREADS=1 mpiexec -n "$ranks" --oversubscribe "$octet" train \
    "${eval_common[@]}" "$@" | val_losses)"
  if [ -n "$val_reference" ] && [ "$got" = "$val_reference" ]; then
    echo "ok   validation $name: $got"
  else
    echo "FAIL validation $name: '$got' (expected '$val_reference')"
    status=1
  fi
}
validate 2 "PP=2" --pipeline-model-parallel-size 2
validate 4 "PP=2 x DP=2" --pipeline-model-parallel-size 2
validate 2 "PP=2 DualPipe" --pipeline-model-parallel-size 2 --pipeline-schedule dualpipe
validate 4 "TP=2 x PP=2 sequence-parallel" --tensor-model-parallel-size 2 \
  --pipeline-model-parallel-size 2 --sequence-parallel
# --fp8-stats under PP: every stage's tensors, gathered on rank 0, give the single process's
# summary table (amax, scales, underflow and saturation of all 24 quantized tensors).
fp8_table() { sed -n '/^FP8 tensors over/,$p'; }
stats_reference="$(OMP_NUM_THREADS=1 "$octet" train "${fp8_common[@]}" --fp8-stats | fp8_table)"
stats="$(OMP_NUM_THREADS=1 mpiexec -n 2 --oversubscribe "$octet" train "${fp8_common[@]}" \
  --fp8-stats --pipeline-model-parallel-size 2 | fp8_table)"
if [ "$(echo "$stats_reference" | wc -l)" -gt 20 ] && [ "$stats" = "$stats_reference" ]; then
  echo "ok   FP8 stats PP=2: the single process's table"
else
  echo "FAIL FP8 stats PP=2:"; echo "$stats"; echo "expected:"; echo "$stats_reference"
  status=1
fi
# A checkpoint written at one layout resumes at another with the uninterrupted run's losses
# (constant learning rate, so the schedule does not depend on --train-iters).
dir="$(mktemp -d)"
trap 'rm -rf "$dir"' EXIT
constant=(--config "$config" --mock-data --precision fp32 --micro-batch-size 2
  --global-batch-size 8 --log-interval 1 --eval-iters 0 --peak-gflops 100 --lr 1e-3
  --min-lr 1e-3 --lr-warmup-iters 0)
later() { grep -o 'iter *[456]/6 | loss [0-9.]*' | grep -o 'loss [0-9.]*' | tr '\n' ' '; }
uninterrupted="$(OMP_NUM_THREADS=1 "$octet" train "${constant[@]}" --train-iters 6 | later)"
resume() {
  local name="$1" save_ranks="$2" load_ranks="$3" save_flags="$4" load_flags="$5" got
  rm -rf "$dir/ckpt"
  # shellcheck disable=SC2086
  OMP_NUM_THREADS=1 mpiexec -n "$save_ranks" --oversubscribe "$octet" train "${constant[@]}" \
    --train-iters 3 --save "$dir/ckpt" $save_flags >/dev/null
  # shellcheck disable=SC2086
  got="$(OMP_NUM_THREADS=1 mpiexec -n "$load_ranks" --oversubscribe "$octet" train \
    "${constant[@]}" --train-iters 6 --load "$dir/ckpt" $load_flags | later)"
  if [ -n "$got" ] && [ "$got" = "$uninterrupted" ]; then
    echo "ok   resume $name: $got"
  else
    echo "FAIL resume $name: '$got' (expected '$uninterrupted')"
    status=1
  fi
}
resume "PP=2 -> 1 process" 2 1 "--pipeline-model-parallel-size 2" ""
resume "1 process -> PP=2" 1 2 "" "--pipeline-model-parallel-size 2"
resume "DP=2 ZeRO-1 -> PP=2 x DP=2" 2 4 "--use-distributed-optimizer" \
  "--pipeline-model-parallel-size 2"
resume "PP=2 x DP=2 ZeRO-1 -> TP=2 x DP=2 sequence-parallel ZeRO-1" 4 4 \
  "--pipeline-model-parallel-size 2 --use-distributed-optimizer" \
  "--tensor-model-parallel-size 2 --sequence-parallel --use-distributed-optimizer"
resume "TP=2 -> 1 process" 2 1 "--tensor-model-parallel-size 2" ""
resume "1 process -> TP=2 sequence-parallel" 1 2 "" \
  "--tensor-model-parallel-size 2 --sequence-parallel"
resume "PP=2 (sharded) -> TP=2" 2 2 "--pipeline-model-parallel-size 2" \
  "--tensor-model-parallel-size 2"
resume "TP=2 x PP=2 (sharded) -> 1 process" 4 1 \
  "--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --sequence-parallel" ""
resume "1 process -> TP=2 x PP=2" 1 4 "" \
  "--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --pipeline-schedule zb1p"
# FP8 under TP and PP resumes its amax histories and scales: bit for bit the uninterrupted
# run. FP8 PP=2 computes what one process does, so its checkpoint (each stage's states under
# their whole-model indices) also resumes in one process exactly.
fp8_tp=("${constant[@]/fp32/fp8}" --tensor-model-parallel-size 2)
tp2() { OMP_NUM_THREADS=1 mpiexec -n 2 --oversubscribe "$octet" train "${fp8_tp[@]}" "$@"; }
uninterrupted="$(tp2 --train-iters 6 | later)"
rm -rf "$dir/ckpt"
tp2 --train-iters 3 --save "$dir/ckpt" >/dev/null
got="$(tp2 --train-iters 6 --load "$dir/ckpt" | later)"
if [ -n "$got" ] && [ "$got" = "$uninterrupted" ]; then
  echo "ok   resume FP8 TP=2 -> FP8 TP=2: $got"
else
  echo "FAIL resume FP8 TP=2 -> FP8 TP=2: '$got' (expected '$uninterrupted')"
  status=1
fi
fp8_constant=("${constant[@]/fp32/fp8}")
uninterrupted="$(OMP_NUM_THREADS=1 "$octet" train "${fp8_constant[@]}" --train-iters 6 | later)"
rm -rf "$dir/ckpt"
OMP_NUM_THREADS=1 mpiexec -n 2 --oversubscribe "$octet" train "${fp8_constant[@]}" \
  --train-iters 3 --pipeline-model-parallel-size 2 --save "$dir/ckpt" >/dev/null
for target in "PP=2" "1 process"; do
  if [ "$target" = "PP=2" ]; then
    got="$(OMP_NUM_THREADS=1 mpiexec -n 2 --oversubscribe "$octet" train "${fp8_constant[@]}" \
      --train-iters 6 --pipeline-model-parallel-size 2 --load "$dir/ckpt" | later)"
  else
    got="$(OMP_NUM_THREADS=1 "$octet" train "${fp8_constant[@]}" --train-iters 6 \
      --load "$dir/ckpt" | later)"
  fi
  if [ -n "$got" ] && [ "$got" = "$uninterrupted" ]; then
    echo "ok   resume FP8 PP=2 -> FP8 $target: $got"
  else
    echo "FAIL resume FP8 PP=2 -> FP8 $target: '$got' (expected '$uninterrupted')"
    status=1
  fi
done
# Sizes that do not fit are clear errors, not hangs.
if OMP_NUM_THREADS=1 mpiexec -n 2 --oversubscribe "$octet" train "${common[@]}" \
  --tensor-model-parallel-size 3 >/tmp/octet-layouts-err.txt 2>&1; then
  echo "FAIL: TP=3 on 2 ranks was accepted"
  status=1
elif grep -q "expected a multiple of tensor-model-parallel-size" /tmp/octet-layouts-err.txt; then
  echo "ok   TP=3 on 2 ranks: clear error"
else
  echo "FAIL: TP=3 on 2 ranks: unexpected output"; cat /tmp/octet-layouts-err.txt
  status=1
fi
exit $status
