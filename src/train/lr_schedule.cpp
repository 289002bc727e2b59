// Learning-rate schedule: linear warmup, cosine decay to min_lr.
#include <algorithm>
#include <cmath>

#include "octet/train.h"

namespace octet {

float LrSchedule::at(int64_t iteration) const {
  if (warmup_iters > 0 && iteration < warmup_iters) {
    return lr * static_cast<float>(iteration + 1) / static_cast<float>(warmup_iters);
  }
  if (iteration >= decay_iters) return min_lr;
  const double span = std::max<int64_t>(1, decay_iters - warmup_iters);
  const double progress = static_cast<double>(iteration - warmup_iters) / span;
  const double cosine = 0.5 * (1.0 + std::cos(M_PI * progress));
  return static_cast<float>(min_lr + (lr - min_lr) * cosine);
}

}  // namespace octet
