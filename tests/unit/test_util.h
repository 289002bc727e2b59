// Helpers the unit tests share: seeded inputs, error measures, the ISA paths to loop over
// (and a report of the ones a test binary ran).
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "octet/cpu_features.h"
#include "octet/error.h"
#include "octet/tensor.h"

namespace octet::testing {

// Normal(mean, stddev) values from a seeded generator, stored in `dtype` (rounded once).
inline Tensor random_tensor(Shape shape, DType dtype, uint32_t seed, float mean = 0.0f,
                            float stddev = 1.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(mean, stddev);
  Tensor t = Tensor::empty(shape, DType::F32);
  for (int64_t i = 0; i < t.numel(); ++i) t.data<float>()[i] = normal(rng);
  return dtype == DType::F32 ? t : t.to(dtype);
}

// Largest |a - b| / (atol + rtol * |b|) over all elements: <= 1 passes.
inline double worst(const Tensor& a, const Tensor& b, double atol, double rtol) {
  std::vector<float> x = a.to_floats(), y = b.to_floats();
  if (x.size() != y.size()) return INFINITY;
  double w = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    double error = std::fabs(double(x[i]) - y[i]) / (atol + rtol * std::fabs(double(y[i])));
    w = std::isnan(error) ? INFINITY : std::max(w, error);
  }
  return w;
}

// The message of the octet::Error that `f` throws, or "no error".
inline std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "no error";
}

inline double max_abs(const Tensor& t) {
  double m = 0;
  for (float v : t.to_floats()) m = std::max(m, std::fabs(double(v)));
  return m;
}

// ||a - b|| / ||b||.
inline double relative_rms(const Tensor& a, const Tensor& b) {
  std::vector<float> x = a.to_floats(), y = b.to_floats();
  double error = 0, norm = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    error += (double(x[i]) - y[i]) * (double(x[i]) - y[i]);
    norm += double(y[i]) * y[i];
  }
  return std::sqrt(error / norm);
}

namespace detail {
// The instruction sets available_isas() handed to per-ISA loops in this test binary.
inline std::vector<Isa>& looped_isas() {
  static std::vector<Isa> isas;
  return isas;
}
}  // namespace detail

// Puts the active instruction set back when a test that loops over them ends.
struct IsaGuard {
  Isa saved = active_isa();
  ~IsaGuard() { set_active_isa(saved); }
};

// Scalar, then AVX2 and AVX-512 where this processor has them.
inline std::vector<Isa> available_isas() {
  std::vector<Isa> isas = {Isa::Scalar};
  Isa original = active_isa();
  for (Isa isa : {Isa::Avx2, Isa::Avx512}) {
    set_active_isa(isa);
    if (active_isa() == isa) isas.push_back(isa);
  }
  set_active_isa(original);
  for (Isa isa : isas) {
    std::vector<Isa>& looped = detail::looped_isas();
    if (std::find(looped.begin(), looped.end(), isa) == looped.end()) looped.push_back(isa);
  }
  return isas;
}

// One line per test binary naming the instruction-set paths it ran and why the others did not
// run, so that a green CI log says what it covered, e.g.
//   [ ISA paths ] run: scalar avx2 (avx512 skipped: no AVX512F, AVX512BW, AVX512VL)
// The active path (OCTET_ISA lowers it) runs everything; per-ISA loops add the rest.
class IsaPathsReport : public ::testing::Environment {
 public:
  void SetUp() override { default_isa_ = active_isa(); }
  void TearDown() override {
    const std::vector<Isa>& looped = detail::looped_isas();
    std::string run, skipped;
    for (Isa isa : {Isa::Scalar, Isa::Avx2, Isa::Avx512}) {
      const bool ran =
          isa == default_isa_ || std::find(looped.begin(), looped.end(), isa) != looped.end();
      if (ran) {
        run += std::string(" ") + isa_name(isa);
        continue;
      }
      std::string why = isa_unavailable_reason(isa);
      if (why.empty() && static_cast<int>(isa) > static_cast<int>(default_isa_)) {
        const char* env = std::getenv("OCTET_ISA");
        why = std::string("OCTET_ISA=") + (env != nullptr ? env : "");
      } else if (why.empty()) {
        why = "no per-ISA loop ran";
      }
      skipped += std::string(skipped.empty() ? "" : "; ") + isa_name(isa) + " skipped: " + why;
    }
    std::printf("[ ISA paths ] run:%s%s\n", run.c_str(),
                skipped.empty() ? "" : (" (" + skipped + ")").c_str());
    std::fflush(stdout);
  }

 private:
  Isa default_isa_ = Isa::Scalar;
};

namespace detail {
inline ::testing::Environment* const isa_paths_report =
    ::testing::AddGlobalTestEnvironment(new IsaPathsReport);
}  // namespace detail

// Runs a scope with one ISA forced, restoring the previous choice on exit.
class IsaScope {
 public:
  explicit IsaScope(Isa isa) : saved_(active_isa()) { set_active_isa(isa); }
  ~IsaScope() { set_active_isa(saved_); }
  IsaScope(const IsaScope&) = delete;
  IsaScope& operator=(const IsaScope&) = delete;

 private:
  Isa saved_;
};

}  // namespace octet::testing
