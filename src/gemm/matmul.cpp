#include "gemm/matmul.h"

#include <bit>
#include <cstdlib>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>

#include "core/convert.h"
#include "gemm/packed_weight.h"
#include "gemm/workspace.h"
#include "octet/cpu_features.h"

namespace octet::gemm_detail {

using dnnl::algorithm;
using dnnl::memory;

dnnl::engine& cpu_engine() {
  static dnnl::engine engine(dnnl::engine::kind::cpu, 0);
  return engine;
}

dnnl::stream& cpu_stream() {
  static dnnl::stream stream(cpu_engine());
  return stream;
}

memory::data_type dnnl_type(DType dtype) {
  switch (dtype) {
    case DType::F32:
      return memory::data_type::f32;
    case DType::BF16:
      return memory::data_type::bf16;
    case DType::F16:
      return memory::data_type::f16;
    default:
      fail(detail::concat("gemm: dtype ", dtype_name(dtype), " has no oneDNN matmul type"));
  }
}

memory::desc matrix_desc(int64_t rows, int64_t cols, DType dtype, bool transposed) {
  const memory::dims strides = transposed ? memory::dims{1, rows} : memory::dims{cols, 1};
  return memory::desc({rows, cols}, dnnl_type(dtype), strides);
}

namespace {

// Everything that changes the primitive. beta is part of it because oneDNN 2.x bakes the sum
// post-op's scale into the primitive; alpha is a runtime output scale, so only alpha != 1 is.
struct MatmulKey {
  int64_t m, n, k;
  DType a_dtype, b_dtype, c_dtype;
  bool trans_a, trans_b, packed_b, has_output_scale;
  uint32_t beta_bits;
  int bias_dtype;  // -1 without bias
  Activation activation;
  auto operator<=>(const MatmulKey&) const = default;
};

struct MatmulEntry {
  dnnl::matmul::primitive_desc pd;
  dnnl::matmul primitive;
  bool scale_attribute = false;  // alpha as a runtime output scale, not a binary_mul post-op
  std::string kernel;            // oneDNN's implementation ("gemm:jit", "ref:any", ...)
};

std::mutex cache_mutex;
std::map<MatmulKey, std::shared_ptr<const MatmulEntry>> cache;

memory::desc scalar_desc() {
  return memory::desc({1, 1}, memory::data_type::f32, memory::format_tag::ab);
}

algorithm eltwise_algorithm(Activation activation) {
  switch (activation) {
    case Activation::GeluTanh:
      return algorithm::eltwise_gelu_tanh;
    case Activation::GeluErf:
      return algorithm::eltwise_gelu_erf;
    case Activation::Relu:
      return algorithm::eltwise_relu;
    case Activation::None:
      break;
  }
  fail("gemm: no eltwise for Activation::None");
}

std::shared_ptr<const MatmulEntry> create_entry(const MatmulKey& key, bool scale_attribute) {
  const memory::desc a_md = matrix_desc(key.m, key.k, key.a_dtype, key.trans_a);
  const memory::desc b_md =
      key.packed_b ? memory::desc({key.k, key.n}, dnnl_type(key.b_dtype), memory::format_tag::any)
                   : matrix_desc(key.k, key.n, key.b_dtype, key.trans_b);
  const memory::desc c_md = matrix_desc(key.m, key.n, key.c_dtype, false);

  // Post-op order gives act(alpha * AB + beta * C + bias). alpha is a binary_mul by a runtime
  // [1,1] scalar: oneDNN 2.6 drops to the slower gemm:jit kernel for a runtime output scale,
  // while brgemm takes scalar binary post-ops (or, with scale_attribute, the runtime output
  // scale: see find_or_create). The bias is a binary_add and not the matmul bias argument,
  // which oneDNN 2.x would multiply by the output scale.
  dnnl::primitive_attr attr;
  dnnl::post_ops ops;
  if (key.has_output_scale && scale_attribute) {
    attr.set_output_scales(0, {DNNL_RUNTIME_F32_VAL});
  } else if (key.has_output_scale) {
    ops.append_binary(algorithm::binary_mul, scalar_desc());
  }
  const float beta = std::bit_cast<float>(key.beta_bits);
  if (beta != 0.0f) ops.append_sum(beta);
  if (key.bias_dtype >= 0) {
    const auto bias_dtype = static_cast<DType>(key.bias_dtype);
    ops.append_binary(algorithm::binary_add,
                      memory::desc({1, key.n}, dnnl_type(bias_dtype), memory::format_tag::ab));
  }
  if (key.activation != Activation::None) {
    ops.append_eltwise(1.0f, eltwise_algorithm(key.activation), 0.0f, 0.0f);
  }
  attr.set_post_ops(ops);

  const dnnl::matmul::desc desc(a_md, b_md, c_md);
  dnnl::matmul::primitive_desc pd(desc, attr, cpu_engine());
  return std::make_shared<const MatmulEntry>(
      MatmulEntry{pd, dnnl::matmul(pd), scale_attribute, pd.impl_info_str()});
}

bool reference_kernel(const MatmulEntry& entry) {
  return entry.kernel.starts_with("ref");
}

std::shared_ptr<const MatmulEntry> find_or_create(const MatmulKey& key) {
  std::lock_guard<std::mutex> lock(cache_mutex);
  auto found = cache.find(key);
  if (found != cache.end()) return found->second;
  auto entry = create_entry(key, false);
  // Only brgemm (AVX-512) prefers the scale as a binary post-op. Every other kernel takes the
  // runtime output scale better: oneDNN 2.6's F32 gemm:jit folds it into the GEMM's alpha, where
  // a binary_mul costs a pass over C after the product (FP8 GEMMs of gpt-mini's forward shapes
  // ran 0.95-0.98x their BF16 twins on a Zen 3 VM, 1.00x with the scale in alpha); with a
  // transposed A and a sum it takes no binary post-op at all, and the scale went to its reference
  // matmul, ~100x slower (FP8 weight gradients, dW += alpha X^T dY, at 0.08 GFLOP/s).
  if (key.has_output_scale && !entry->kernel.starts_with("brg")) {
    auto scaled = create_entry(key, true);
    if (!reference_kernel(*scaled)) entry = scaled;
  }
  cache.emplace(key, entry);
  return entry;
}

// A [rows, cols] BF16 matrix (any storage order: the elements are widened in place order)
// as F32 in `buffer`.
const float* widened(const void* data, int64_t elements, Buffer& buffer) {
  float* out = static_cast<float*>(buffer.reserve(static_cast<size_t>(elements) * sizeof(float)));
  convert_bf16_to_f32(static_cast<const bfloat16*>(data), out, static_cast<size_t>(elements));
  return out;
}

// Without a oneDNN BF16 matmul: every BF16 operand widened exactly to F32, the F32 matmul run
// (same FP32 accumulation), a BF16 C staged in F32 and rounded to nearest even afterwards.
void run_widened(const MatmulArgs& args) {
  OCTET_CHECK(args.c_dtype == DType::F32 || args.c_dtype == DType::BF16,
              "gemm: a widened BF16 matmul expected an F32 or BF16 C, got ",
              dtype_name(args.c_dtype));
  struct Scratch {
    Buffer a, b, c;
  };
  thread_local Scratch scratch;
  MatmulArgs f32 = args;
  f32.a_dtype = f32.b_dtype = f32.c_dtype = DType::F32;
  if (args.a_dtype == DType::BF16) f32.a = widened(args.a, args.m * args.k, scratch.a);
  // A packed BF16 weight is widened when packed for the F32 primitive (packed_for).
  if (args.packed == nullptr && args.b_dtype == DType::BF16) {
    f32.b = widened(args.b, args.k * args.n, scratch.b);
  }
  Tensor bias;
  if (args.bias != nullptr && args.bias->dtype() == DType::BF16) {
    bias = args.bias->to(DType::F32);
    f32.bias = &bias;
  }
  float* staged = nullptr;
  const size_t c_elements = static_cast<size_t>(args.m * args.n);
  if (args.c_dtype == DType::BF16) {
    staged = static_cast<float*>(scratch.c.reserve(c_elements * sizeof(float)));
    if (args.beta != 0.0f) {
      convert_bf16_to_f32(static_cast<const bfloat16*>(args.c), staged, c_elements);
    }
    f32.c = staged;
  }
  run_matmul(f32);
  if (staged != nullptr) convert_f32_to_bf16(staged, static_cast<bfloat16*>(args.c), c_elements);
}

}  // namespace

size_t matmul_cache_size() {
  std::lock_guard<std::mutex> lock(cache_mutex);
  return cache.size();
}

namespace {
thread_local const MatmulEntry* last_entry = nullptr;  // a cached entry: lives as long
}  // namespace

std::string last_matmul_kernel() {
  return last_entry != nullptr ? last_entry->kernel : std::string();
}

bool last_matmul_scale_in_output_scale() {
  return last_entry != nullptr && last_entry->scale_attribute;
}

void run_matmul(const MatmulArgs& args) {
  if (args.m == 0 || args.n == 0) return;
  // A few rows stream the weight through VDPBF16PS whichever path the GEMMs take: there the
  // weight's bytes, not the dot product's rate, set the time.
  if (run_small_m_bf16(args)) return;
  if ((args.a_dtype == DType::BF16 || args.b_dtype == DType::BF16 || args.c_dtype == DType::BF16) &&
      !gemm_bf16_native()) {
    return run_widened(args);
  }
  if (args.a_dtype == DType::F32 && args.bias != nullptr && args.bias->dtype() == DType::BF16) {
    // An F32 GEMM with a BF16 bias: the bias widened (N values). oneDNN 2.6's F32 gemm:jit takes
    // no BF16 binary operand and ran such GEMMs on its reference matmul.
    const Tensor bias = args.bias->to(DType::F32);
    MatmulArgs f32 = args;
    f32.bias = &bias;
    return run_matmul(f32);
  }
  const MatmulKey key{args.m,
                      args.n,
                      args.k,
                      args.a_dtype,
                      args.b_dtype,
                      args.c_dtype,
                      args.trans_a,
                      args.packed != nullptr ? false : args.trans_b,
                      args.packed != nullptr,
                      args.output_scale != 1.0f,
                      std::bit_cast<uint32_t>(args.beta),
                      args.bias != nullptr ? static_cast<int>(args.bias->dtype()) : -1,
                      args.activation};
  const auto entry = find_or_create(key);
  last_entry = entry.get();
  dnnl::engine& engine = cpu_engine();

  std::unordered_map<int, memory> exec_args;
  exec_args.emplace(DNNL_ARG_SRC, memory(entry->pd.src_desc(), engine, const_cast<void*>(args.a)));
  if (args.packed != nullptr) {
    exec_args.emplace(DNNL_ARG_WEIGHTS, args.packed->packed_for(entry->pd.weights_desc()));
  } else {
    exec_args.emplace(DNNL_ARG_WEIGHTS,
                      memory(entry->pd.weights_desc(), engine, const_cast<void*>(args.b)));
  }
  exec_args.emplace(DNNL_ARG_DST, memory(entry->pd.dst_desc(), engine, args.c));
  // Post-op arguments are numbered by position: [scale] [sum] [bias] [activation].
  int post_op_index = 0;
  float output_scale = args.output_scale;
  if (key.has_output_scale && entry->scale_attribute) {
    exec_args.emplace(DNNL_ARG_ATTR_OUTPUT_SCALES,
                      memory(memory::desc({1}, memory::data_type::f32, memory::format_tag::a),
                             engine, &output_scale));
  } else if (key.has_output_scale) {
    exec_args.emplace(DNNL_ARG_ATTR_MULTIPLE_POST_OP(post_op_index) | DNNL_ARG_SRC_1,
                      memory(scalar_desc(), engine, &output_scale));
    ++post_op_index;
  }
  if (args.beta != 0.0f) ++post_op_index;
  if (args.bias != nullptr) {
    exec_args.emplace(DNNL_ARG_ATTR_MULTIPLE_POST_OP(post_op_index) | DNNL_ARG_SRC_1,
                      memory({{1, args.n}, dnnl_type(args.bias->dtype()), memory::format_tag::ab},
                             engine, const_cast<void*>(args.bias->raw())));
  }
  entry->primitive.execute(cpu_stream(), exec_args);
  cpu_stream().wait();
}

}  // namespace octet::gemm_detail

namespace octet {

bool gemm_bf16_native() {
  static const bool native = [] {
    bool onednn = true;
    try {
      using dnnl::memory;
      const memory::desc md({2, 2}, memory::data_type::bf16, memory::format_tag::ab);
      const dnnl::matmul::desc desc(md, md, md);
      dnnl::matmul::primitive_desc pd(desc, dnnl::primitive_attr(), gemm_detail::cpu_engine());
    } catch (const dnnl::error&) {
      onednn = false;  // no BF16 matmul on this processor (oneDNN 2.6 needs AVX-512)
    }
    const char* forced = std::getenv("OCTET_GEMM_BF16");
    const std::string mode = forced != nullptr ? forced : "";
    OCTET_CHECK(mode.empty() || mode == "auto" || mode == "widen" || mode == "native",
                "OCTET_GEMM_BF16 expected 'widen', 'native' or 'auto' (or unset), got '", mode,
                "'");
    if (mode == "widen" || !onednn) return false;
    if (mode == "native") return true;
    if (dnnl::get_effective_cpu_isa() == dnnl::cpu_isa::avx512_core_amx) return true;  // AMX tiles
    const double rate = gemm_bf16_dot_rate();
    return rate == 0.0 || rate >= 0.75;  // 0: no VDPBF16PS, oneDNN emulates (and decides)
  }();
  return native;
}

double gemm_bf16_dot_rate() {
  return bf16_dot_rate();
}

}  // namespace octet
