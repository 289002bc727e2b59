// Names of the FP8 scaling modes.
#include "octet/fp8.h"

namespace octet {

const char* scaling_mode_name(ScalingMode mode) {
  switch (mode) {
    case ScalingMode::PerTensor:
      return "per_tensor";
    case ScalingMode::Block:
      return "block";
    case ScalingMode::MXFP8:
      return "mxfp8";
  }
  return "unknown";
}

}  // namespace octet
