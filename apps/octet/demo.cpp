// `octet demo`: the foundation at work on one screen. FP8 formats, each scaling recipe on a
// realistic activation, delayed scaling over a few steps, and GEMMs in every precision.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <functional>
#include <random>

#include "commands.h"
#include "octet/cpu_features.h"
#include "octet/gemm.h"
#include "octet/recipe.h"

namespace octet::cli {
namespace {

// Gaussian activations with a few large outliers, as in a real Transformer.
Tensor activation_like(int64_t rows, int64_t cols, uint32_t seed) {
  Tensor x = Tensor::empty({rows, cols}, DType::F32);
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  float* data = x.data<float>();
  for (int64_t i = 0; i < x.numel(); ++i) data[i] = normal(rng);
  for (int64_t i = 0; i < x.numel(); i += 997) data[i] *= 40.0f;
  return x;
}

struct ErrorStats {
  double relative_rms = 0;
  double underflow = 0;  // nonzero inputs that became zero
};

ErrorStats compare(const Tensor& exact, const Tensor& approx) {
  const float* a = exact.data<float>();
  const float* b = approx.data<float>();
  double error = 0, norm = 0, zeros = 0, nonzero = 0;
  for (int64_t i = 0; i < exact.numel(); ++i) {
    error += (double(a[i]) - b[i]) * (double(a[i]) - b[i]);
    norm += double(a[i]) * a[i];
    if (a[i] != 0) {
      nonzero += 1;
      zeros += b[i] == 0;
    }
  }
  return {std::sqrt(error / std::max(norm, 1e-30)), nonzero ? zeros / nonzero : 0};
}

void show_formats() {
  std::printf("\n== OCP FP8 formats ==\n%10s %12s %12s %12s %12s\n", "value", "e4m3", "->", "e5m2",
              "->");
  for (float v : {0.3f, 1.0f, 3.14159f, 100.0f, 448.0f, 500.0f, 60000.0f, 0.001953125f}) {
    uint8_t a = float_to_fp8(v, DType::E4M3, true);
    uint8_t b = float_to_fp8(v, DType::E5M2, true);
    std::printf("%10g       0x%02x %12g       0x%02x %12g\n", v, a, fp8_to_float(a, DType::E4M3), b,
                fp8_to_float(b, DType::E5M2));
  }
  std::printf("(saturating: 500 -> 448 in E4M3; E5M2 keeps range, E4M3 keeps precision)\n");
}

void show_recipes(const Tensor& x) {
  std::printf("\n== One activation [%lld,%lld], amax %.2f, quantized by each recipe ==\n",
              (long long)x.dim(0), (long long)x.dim(1), amax_of(x.data<float>(), x.numel()));
  std::printf("%-28s %12s %14s %12s\n", "recipe", "scale", "relative rms", "underflow");
  struct Row {
    const char* name;
    Quantizer quantizer;
  };
  Row rows[] = {
      {"per-tensor current E4M3", Quantizer::current(DType::E4M3)},
      {"per-tensor current E5M2", Quantizer::current(DType::E5M2)},
      {"MXFP8 1x32 E4M3", Quantizer::mxfp8(DType::E4M3)},
      {"block 1x128 E4M3 (pow2)", Quantizer::block(DType::E4M3, 1, 128)},
      {"block 128x128 E4M3 (pow2)", Quantizer::block(DType::E4M3, 128, 128)},
  };
  for (const Row& row : rows) {
    Float8Tensor q = row.quantizer.quantize(x);
    ErrorStats stats = compare(x, q.dequantize());
    char scale[32] = "per block";
    if (q.mode == ScalingMode::PerTensor) std::snprintf(scale, sizeof scale, "%.4g", q.scale);
    std::printf("%-28s %12s %14.3e %11.4f%%\n", row.name, scale, stats.relative_rms,
                100 * stats.underflow);
  }
}

void show_delayed_scaling() {
  std::printf("\n== Delayed scaling (HYBRID, history 4, max): the scale follows the history ==\n");
  recipe::DelayedScaling recipe;
  recipe.amax_history_len = 4;
  FP8Meta meta({TensorRole::Input, TensorRole::GradOutput}, recipe.amax_history_len);
  std::printf("%5s %10s %12s %10s %12s\n", "step", "amax(x)", "scale(x)", "amax(dy)", "scale(dy)");
  const float input_amax[] = {2, 4, 1, 1, 1, 1, 0, 8};
  const float grad_amax[] = {1e-3f, 1e-3f, 5e-4f, 5e-4f, 5e-4f, 5e-4f, 5e-4f, 5e-4f};
  for (int step = 0; step < 8; ++step) {
    meta.record_amax(0, input_amax[step]);
    meta.record_amax(1, grad_amax[step]);
    meta.update(recipe);
    std::printf("%5d %10g %12g %10g %12g\n", step, input_amax[step], meta.scale(0), grad_amax[step],
                meta.scale(1));
  }
}

double time_ms(const std::function<void()>& work, int repeats) {
  work();  // warm-up: primitive creation, weight packing
  auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < repeats; ++i) work();
  auto end = std::chrono::steady_clock::now();
  return std::chrono::duration<double, std::milli>(end - start).count() / repeats;
}

void show_gemms(int64_t m, int64_t n, int64_t k) {
  std::printf(
      "\n== GEMM %lldx%lldx%lld (Linear: y = x W^T), error against an FP64-accumulated reference "
      "==\n",
      (long long)m, (long long)n, (long long)k);
  Tensor x = activation_like(m, k, 1);
  Tensor w = activation_like(n, k, 2);
  Tensor exact = Tensor::empty({m, n}, DType::F32);
  Tensor y = Tensor::empty({m, n}, DType::F32);
  double flop = 2.0 * m * n * k;
  auto report = [&](const char* name, double ms) {
    ErrorStats stats = compare(exact, y);
    std::printf("%-24s %9.2f ms %9.1f GFLOP/s   relative rms %.3e\n", name, ms, flop / ms / 1e6,
                stats.relative_rms);
  };
  gemm_reference(x, w, exact, false, true);  // FP64 accumulation: the yardstick
  report("f32", time_ms([&] { gemm(x, w, y, false, true); }, 3));
  Tensor xb = x.to(DType::BF16);
  PackedWeight wb(w.to(DType::BF16), true);
  report("bf16 (packed weight)", time_ms([&] { gemm(xb, wb, y, false); }, 3));
  struct Fp8Row {
    const char* name;
    Quantizer input;
    Quantizer weight;
  };
  Fp8Row rows[] = {
      {"fp8 per-tensor e4m3", Quantizer::current(DType::E4M3), Quantizer::current(DType::E4M3)},
      {"fp8 mxfp8 1x32", Quantizer::mxfp8(DType::E4M3), Quantizer::mxfp8(DType::E4M3)},
      {"fp8 block 1x128/128x128", Quantizer::block(DType::E4M3, 1, 128),
       Quantizer::block(DType::E4M3, 128, 128)},
  };
  for (const Fp8Row& row : rows) {
    Float8Tensor xq = row.input.quantize(x);
    PackedWeight wq(row.weight.quantize(w), true);
    report(row.name, time_ms([&] { gemm(xq, wq, y, false); }, 3));
  }
}

void run_demo(int64_t m, int64_t n, int64_t k) {
  const CpuFeatures& f = cpu_features();
  std::printf("octet demo on %s (kernels: %s, AMX-BF16: %s, threads: %d)\n", f.brand.c_str(),
              isa_name(active_isa()), f.amx_bf16 ? "yes" : "no", num_threads());
  show_formats();
  show_recipes(activation_like(1024, 1024, 7));
  show_delayed_scaling();
  show_gemms(m, n, k);
}

}  // namespace

void register_demo(CLI::App& app) {
  CLI::App* demo = app.add_subcommand("demo", "FP8 formats, scaling recipes and GEMMs at work");
  auto shape = std::make_shared<std::vector<int64_t>>(std::vector<int64_t>{2048, 768, 3072});
  demo->add_option("--gemm-shape", *shape, "M N K of the GEMM section")->expected(3);
  demo->callback([shape] { run_demo((*shape)[0], (*shape)[1], (*shape)[2]); });
}

}  // namespace octet::cli
