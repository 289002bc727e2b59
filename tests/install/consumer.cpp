// Uses an installed octet: one Linear forward in a world of one, checked against its definition.
#include <cmath>
#include <cstdio>

#include "octet/modules.h"

int main() {
  octet::LinearOptions options;
  options.in_features = 4;
  options.out_features = 3;
  options.seed = 7;
  octet::Linear linear(options);
  octet::Tensor x = octet::Tensor::from_floats({2, 4}, {1, 2, 3, 4, -1, 0.5f, 0, 2});
  octet::Linear::Context ctx;
  octet::Tensor y = linear.forward(x, ctx);
  const float* w = linear.weight.value.data<float>();
  const float* b = linear.bias.value.data<float>();
  double worst = 0;
  for (int n = 0; n < 2; ++n) {
    for (int o = 0; o < 3; ++o) {
      double expected = b[o];
      for (int i = 0; i < 4; ++i) expected += x.data<float>()[n * 4 + i] * w[o * 4 + i];
      worst = std::fmax(worst, std::fabs(expected - y.data<float>()[n * 3 + o]));
    }
  }
  std::printf("installed octet: Linear [2,4] -> [2,3], max error %.2e\n", worst);
  return worst < 1e-5 ? 0 : 1;
}
