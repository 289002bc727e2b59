#!/usr/bin/env bash
# Installs octet's build and test dependencies from Debian's archive. Safe to run twice:
# only missing packages are installed.
set -euo pipefail

packages=(
  g++ cmake make            # the toolchain
  lld                       # LLVM's linker: links the ~50 test programs 2-3x faster than GNU ld
  libdnnl-dev               # oneDNN: GEMM (matmul primitive, AMX/AVX-512 BF16 kernels)
  ocl-icd-opencl-dev opencl-c-headers  # only because Debian's dnnl-config.cmake asks for OpenCL
  nlohmann-json3-dev        # JSON for --json output, configs, checkpoint headers
  libssl-dev                # OpenSSL: SHA-256 of checkpoint files (verified on load)
  zlib1g-dev                # zlib: reads the gzip-compressed IDX files of dataset-fashion-mnist
  dataset-fashion-mnist     # Fashion-MNIST (IDX files): ViT and image-text training
  libcli11-dev              # the octet command line
  libgtest-dev              # unit tests
  libcpp-httplib-dev        # octet serve: the HTTP server (and its tests' client)
  curl                      # tests/reliability/serve.sh asks octet serve over HTTP
  pkgconf                   # CMake finds cpp-httplib (a shared library on Debian) through pkg-config
  python3-torch python3-numpy  # PyTorch 1.13: reference numerics and the benchmark peer
  clang-format
  libopenmpi-dev openmpi-bin  # MPI: the communicator of data, tensor and pipeline parallelism
  nodejs npm                # fetches the pinned npm data packages; runs the reference encoder
  # scripts/fuzz.sh: libFuzzer is clang's (gcc has none); clang needs its sanitizer runtimes
  # and LLVM's OpenMP runtime, which --no-install-recommends would leave out.
  clang libfuzzer-14-dev libclang-rt-14-dev libomp-dev
  iproute2 util-linux       # tests/reliability/multi_host.sh: network namespaces as two hosts
)

missing=()
for package in "${packages[@]}"; do
  # A node/npm already on PATH (e.g. from the machine image) will do.
  if [ "$package" = nodejs ] && command -v node >/dev/null; then continue; fi
  if [ "$package" = npm ] && command -v npm >/dev/null; then continue; fi
  if ! dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$package")
  fi
done

if ((${#missing[@]})); then
  echo "setup: installing ${missing[*]}"
  sudo_cmd=()
  if [ "$(id -u)" -ne 0 ]; then sudo_cmd=(sudo); fi
  "${sudo_cmd[@]}" apt-get update -q
  DEBIAN_FRONTEND=noninteractive "${sudo_cmd[@]}" apt-get install -y -q --no-install-recommends \
    "${missing[@]}"
else
  echo "setup: all packages present"
fi
