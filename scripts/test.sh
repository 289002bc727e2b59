#!/usr/bin/env bash
# The tests: install what is missing, build with warnings as errors, run every suite, then
# build again with AddressSanitizer + UndefinedBehaviorSanitizer and run them again, run the
# communication suites under ThreadSanitizer, and fuzz each reader briefly.
set -euo pipefail
cd "$(dirname "$0")/.."
# Each stage's minutes, printed as it ends and again at the end: CI must stay under its hour.
stage_start=$SECONDS
stages=()
stage_done() {
  stages+=("$1 $((SECONDS - stage_start)) s")
  echo "test.sh: $1 took $((SECONDS - stage_start)) s"
  stage_start=$SECONDS
}
trap 'printf "test.sh stages:%s\n" "$(printf " %s;" "${stages[@]}")"' EXIT
bash scripts/setup.sh
bash scripts/fetch_data.sh  # the tokenizer tests compare against the pinned reference encoder

stage_done "setup + data"
bash scripts/build.sh build
stage_done "Release build"
build/octet info  # the processor, the kernel instruction set and the BF16 GEMM path under test
# Two test programs at a time, each with two OpenMP threads, on two cores: a thread waiting at
# a barrier for one that is not running spins (libgomp's active wait) and takes the core from
# the thread it waits for. Passive waiting (sleep at once) keeps both threads' code paths under
# test at a quarter of the time: ctest -j 2 over the BERT, ViT, CLIP, GEMM-epilogue and
# attention suites measured 19.1 s active -> 5.4 s passive in Release (4.9 s with one thread),
# 76.9 s -> 19.7 s under ASan. (Training alone on the machine keeps the default: spinning is
# the faster wait when every thread has its core.)
export OMP_WAIT_POLICY=passive
# The PyTorch references' outputs, kept by the exact bytes of their inputs
# (tests/unit/torch_reference.h): the sanitizer pass below feeds the same inputs and reads them
# instead of starting Python again (about 2 minutes of the pass).
export OCTET_TORCH_CACHE="$PWD/build/torch-reference-cache"
# And one Python process that imports torch once and forks a child per reference, so that the
# ~120 references do not each start Python and import torch (measured: `ctest -R Torch` 126 s
# -> 26 s, the outputs byte for byte the same). A test that cannot reach it starts Python itself.
export OCTET_TORCH_SERVER="$PWD/build/torch-reference.sock"
rm -f "$OCTET_TORCH_SERVER"
/usr/bin/python3 tests/reference/torch_ref.py --serve "$OCTET_TORCH_SERVER" \
  >build/torch-reference-server.log 2>&1 &
torch_server=$!
trap 'kill "$torch_server" 2>/dev/null || true; printf "test.sh stages:%s\n" "$(printf " %s;" "${stages[@]}")"' EXIT
(cd build && ctest --output-on-failure -j 2)
stage_done "Release tests"
# Which instruction-set paths the suites ran (each test binary reports its own).
isa_paths() {
  grep -h '\[ ISA paths \]' "$1/Testing/Temporary/LastTest.log" | sort | uniq -c ||
    { echo "no test reported its instruction-set paths"; exit 1; }
}
isa_paths build

# -O1 with minimal debug information (-g1: functions and line tables, what a sanitizer's stack
# trace needs): half the compile time of -O2 -g (measured: test_gpt.cpp 44 -> 23 s, bench_ops.cpp
# 91 -> 43 s), the whole pass's build ~17 -> ~10 minutes on two cores.
bash scripts/build.sh build-sanitize -DOCTET_SANITIZE=ON -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O1 -g1"
stage_done "ASan+UBSan build"
# oneDNN's JIT and libgomp keep allocations alive for the process lifetime: leaks are not
# findings here; every other ASan/UBSan report fails the run.
# The longest runs are the Release pass's: every model's layouts (end-to-end training under
# mpiexec), the precision curves, the convergence report's five tiny trainings, the two network
# namespaces of multi_host, and the T5 / CLIP / captioner trainer runs (the trainer and
# checkpoint code they share runs here in GPT's, ViT's and BERT's resume tests, their models in
# their own suites). Their code paths run here in the shorter suites; their minutes under the
# sanitizers would take CI past its hour (stop 33's CI: 3648 s).
(cd build-sanitize && ASAN_OPTIONS=detect_leaks=0:abort_on_error=1 \
  UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
  ctest --output-on-failure -j 2 \
  -E '^(train_layouts.*|bench_converge|multi_host|GPT.MixedPrecisionCurvesFollowFp32|GPT.Mxfp8CurveFollowsFp32|GPT.Fp4CurvesFollowFp32|(T5|Clip|Captioner).TrainerResumes.*|Captioner.GreedyDecodingWritesLearnedCaptions)$')
isa_paths build-sanitize
kill "$torch_server" 2>/dev/null || true
stage_done "ASan+UBSan tests"

# ThreadSanitizer over the communicator, its MPI (progress) thread and roll calls, the
# inference engine's stepping thread and the HTTP server's workers, and the
# data-parallel and pipeline suites built on them (one OpenMP thread per rank: libgomp is not
# instrumented), with several ranks (the collectives' odd world size and one rank are left to
# the Release and ASan passes). tests/tsan.supp holds the one report inside Open MPI itself.
TARGET="test_collectives test_data_parallel test_pipeline test_engine test_server" bash scripts/build.sh build-tsan \
  -DOCTET_TSAN=ON -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O1 -g1"
(cd build-tsan && OMP_NUM_THREADS=1 \
  TSAN_OPTIONS="halt_on_error=1:second_deadlock_stack=1:suppressions=$PWD/../tests/tsan.supp" \
  ctest --output-on-failure -j 2 \
  -R '^(test_collectives_np[24]|test_data_parallel_np[23]|test_pipeline_np[24])$|^Engine[.]|^ServerTest[.]')
stage_done "TSan build + tests"

# libFuzzer under ASan + UBSan: each reader 6 s (tens of thousands of inputs or more; kept crash
# inputs replayed first).
# A fixed seed: CI explores the same inputs each run (long, random runs are scripts/fuzz.sh's
# own use, e.g. FUZZ_FLAGS=-runs=10000000 bash scripts/fuzz.sh 3600).
FUZZ_FLAGS=-seed=1 bash scripts/fuzz.sh 6
stage_done "fuzz build + runs"
