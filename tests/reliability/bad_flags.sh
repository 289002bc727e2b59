#!/usr/bin/env bash
# Bad flags and unwritable outputs are refused while the command line is parsed, before any
# work: each case must exit non-zero within seconds and name the flag and what was expected.
# Runs as root too (CI), so unwritable paths are made so by structure (a file where a
# directory must be, /proc), not by permissions.
# Usage: bad_flags.sh OCTET_BINARY
set -euo pipefail
octet="$1"
dir="$(mktemp -d)"
trap 'rm -rf "$dir"' EXIT
touch "$dir/file"
mkdir "$dir/dir"
train=(train --config gpt-tiny --mock-data --train-iters 1 --peak-gflops 100)
failures=0
# expect_error "message fragment" octet-args...
expect_error() {
  local fragment="$1"
  shift
  local output status=0
  output="$(timeout 60 "$octet" "$@" 2>&1)" || status=$?
  if [ "$status" -eq 0 ] || [ "$status" -eq 124 ] || ! grep -qF -- "$fragment" <<<"$output"; then
    echo "FAIL: octet $* -> status $status, expected an error with '$fragment', got:"
    echo "$output" | head -n 5
    failures=$((failures + 1))
  else
    echo "ok: octet $* -> $(head -n 1 <<<"$output")"
  fi
}
expect_error "--lr: expected a finite number >= 0, got nan" "${train[@]}" --lr nan
# Mixture-of-experts flags: on a dense config, and values the MoE config cannot take.
expect_error "--moe-* flags need a mixture-of-experts config" "${train[@]}" --moe-router-topk 2
expect_error "moe_router_topk expected in [1, num_experts = 4], got 9" train --config moe-tiny \
  --mock-data --train-iters 1 --peak-gflops 100 --moe-router-topk 9
expect_error "--moe-aux-loss-coeff: expected a finite number >= 0" train --config moe-tiny \
  --mock-data --train-iters 1 --peak-gflops 100 --moe-aux-loss-coeff -1
expect_error "--expert-model-parallel-size: expected a finite number >= 1" train --config moe-tiny \
  --mock-data --train-iters 1 --peak-gflops 100 --expert-model-parallel-size 0
expect_error "num_experts (4) expected a multiple of --expert-model-parallel-size (3)" train \
  --config moe-tiny --mock-data --train-iters 1 --peak-gflops 100 --expert-model-parallel-size 3
expect_error "--expert-model-parallel-size 2 splits a mixture of experts' experts" "${train[@]}" \
  --expert-model-parallel-size 2
expect_error "--expert-model-parallel-size (2) expected >= 1 and to divide the data-parallel size 1" \
  train --config moe-tiny --mock-data --train-iters 1 --peak-gflops 100 --expert-model-parallel-size 2
# Context parallelism: sizes, the sequence's chunks, a2a's heads, families.
expect_error "--context-parallel-size: expected a finite number >= 1" "${train[@]}" \
  --context-parallel-size 0
expect_error "--context-parallel-size (2) expected >= 1 and to divide the data-parallel size 1" \
  "${train[@]}" --context-parallel-size 2
expect_error "the sequence length 30 expected a multiple of 8" "${train[@]}" \
  --context-parallel-size 4 --seq-length 30
expect_error "--cp-comm-type a2a splits each rank's attention heads over CP" "${train[@]}" \
  --context-parallel-size 3 --cp-comm-type a2a --seq-length 48
expect_error "--cp-comm-type: " "${train[@]}" --cp-comm-type ring
expect_error "--context-parallel-size splits a GPT's sequences" train --config vit-tiny \
  --mock-data --train-iters 1 --peak-gflops 100 --context-parallel-size 2
expect_error "--expert-model-parallel-size > 1 with --fp8-recipe delayed is not supported" train \
  --config moe-tiny --mock-data --train-iters 1 --peak-gflops 100 --precision fp8 \
  --expert-model-parallel-size 2
expect_error "--lr: expected a finite number >= 0, got inf" "${train[@]}" --lr inf
expect_error "--lr: expected a finite number >= 0, got -1" "${train[@]}" --lr -1
expect_error "--clip-grad: expected a finite number >= 0" "${train[@]}" --clip-grad -0.5
expect_error "--adam-beta2: expected a finite number in [0, 1), got 1" "${train[@]}" --adam-beta2 1
expect_error "--micro-batch-size: expected a finite number >= 1, got 0" "${train[@]}" --micro-batch-size 0
expect_error "--train-iters: expected a finite number >= 1, got -3" "${train[@]}" --train-iters -3
expect_error "--tensor-model-parallel-size: expected a finite number >= 1" "${train[@]}" --tensor-model-parallel-size 0
expect_error "--save: output directory '$dir/file/ckpt': cannot create the directory" "${train[@]}" --save "$dir/file/ckpt"
expect_error "--save: output directory '$dir/file': exists and is not a directory" "${train[@]}" --save "$dir/file"
expect_error "--metrics: output file '/proc/octet-metrics.jsonl': cannot create files in '/proc'" "${train[@]}" --metrics /proc/octet-metrics.jsonl
expect_error "--plot: output file '$dir/dir': exists and is not a regular file" "${train[@]}" --plot "$dir/dir"
expect_error "--dump-grads: output directory '$dir/file/x'" "${train[@]}" --dump-grads "$dir/file/x"
expect_error "--load: Directory does not exist" "${train[@]}" --load "$dir/missing"
expect_error "--train-data: Path does not exist" train --config gpt-tiny --train-data "$dir/missing.bin"
# A ViT config: its data is a directory of IDX files, its sequence the patches.
expect_error "found neither: install the Debian package dataset-fashion-mnist" train --config vit-tiny --train-data "$dir"
expect_error "--seq-length 10: a ViT's sequence is its 16 patches and the class token (17)" train --config vit-tiny --mock-data --seq-length 10
# A BERT config: sequence pairs need room for [CLS] A [SEP] B [SEP].
expect_error "--seq-length 40 expected in [5, 32] for a BERT" train --config bert-tiny --mock-data --seq-length 40
expect_error "--image-augment is for image models; the config" train --config bert-tiny --mock-data --image-augment
# A T5 config: --seq-length is its encoder's input length.
expect_error "--seq-length 40 expected in [2, 32] for a T5" train --config t5-tiny --mock-data --seq-length 40
expect_error "--max-new-tokens: expected a finite number >= 1, got -5" generate --ckpt "$dir/dir" --max-new-tokens -5
expect_error "--temperature: expected a finite number >= 0, got nan" generate --ckpt "$dir/dir" --temperature nan
expect_error "--top-p: expected a finite number in (0, 1], got 0" generate --ckpt "$dir/dir" --top-p 0
expect_error "--repetition-penalty: expected a finite number in (0, 1e+06], got 0" generate --ckpt "$dir/dir" --repetition-penalty 0
expect_error "--frequency-penalty: expected a finite number in [-2, 2], got 3" generate --ckpt "$dir/dir" --frequency-penalty 3
: > "$dir/empty_prompts.txt"
expect_error "generate: --prompts-file '$dir/empty_prompts.txt' has no prompt (one per line)" generate --ckpt "$dir/dir" --prompts-file "$dir/empty_prompts.txt"
expect_error "--prompts-file: File does not exist" generate --ckpt "$dir/dir" --prompts-file "$dir/missing.txt"
expect_error "--block-size: expected a finite number in [1, 4096], got 0" generate --ckpt "$dir/dir" --block-size 0
expect_error "--fp8-weight-scaling requires --fp8-weights" generate --ckpt "$dir/dir" --fp8-weight-scaling block128
expect_error "--fp8-weight-scaling: block64 not in {channel,block128}" serve --ckpt "$dir/dir" --port 8080 --fp8-weights --fp8-weight-scaling block64
expect_error "--vocab-size: expected a finite number in [257, 65536], got 10" learn-bpe --vocab-size 10 "$dir/file" -o "$dir/v"
expect_error "--output: output file '$dir/file/shard.bin'" tokenize "$dir/file" -o "$dir/file/shard.bin"
expect_error "--svg: output file '$dir/dir'" schedule --pipeline-model-parallel-size 2 --num-microbatches 4 --svg "$dir/dir"
expect_error "--cost-f: expected a finite number >= 0, got -1" schedule --pipeline-model-parallel-size 2 --num-microbatches 4 --cost-f -1
expect_error "--steps: expected a finite number >= 1, got 0" bench train --steps 0
expect_error "--variants: unknown variant 'fp9'" bench converge --mock-data --variants bf16,fp9 --out "$dir/cv"
expect_error "give --train-data SHARD" bench converge --variants bf16 --out "$dir/cv"
expect_error "--fp8-dpa (FP8 attention) needs --fp8-recipe delayed" "${train[@]}" --precision fp8 --fp8-recipe current --fp8-dpa
expect_error "--fp8-dpa (FP8 attention) needs --precision fp8" "${train[@]}" --precision bf16 --fp8-dpa
# A writable --save in a directory that does not exist yet is accepted (and created).
"$octet" "${train[@]}" --eval-iters 0 --save "$dir/new/ckpt" >/dev/null
[ -f "$dir/new/ckpt/trainer.json" ] || { echo "FAIL: --save into a new directory wrote nothing"; failures=$((failures + 1)); }
[ -z "$(ls -A "$dir/new" | grep -v '^ckpt$')" ] || { echo "FAIL: the probe left files: $(ls -A "$dir/new")"; failures=$((failures + 1)); }
if [ "$failures" -ne 0 ]; then
  echo "$failures case(s) failed"
  exit 1
fi
echo "all bad flags refused before any work"
