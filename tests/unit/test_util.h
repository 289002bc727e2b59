// Helpers the unit tests share: seeded inputs, error measures, the ISA paths to loop over.
#pragma once

#include <algorithm>
#include <cmath>
#include <random>
#include <vector>

#include "octet/cpu.h"
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

// Scalar, then AVX2 and AVX-512 where this processor has them.
inline std::vector<Isa> available_isas() {
  std::vector<Isa> isas = {Isa::Scalar};
  Isa original = active_isa();
  for (Isa isa : {Isa::Avx2, Isa::Avx512}) {
    set_active_isa(isa);
    if (active_isa() == isa) isas.push_back(isa);
  }
  set_active_isa(original);
  return isas;
}

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
