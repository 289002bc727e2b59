// Flash attention: fast path against the reference (every ISA path) and both against
// PyTorch's explicit softmax(Q K^T * scale + bias + mask) V with autograd, forward and backward
// (dbias included).
#include <gtest/gtest.h>
#include <omp.h>

#include <bit>
#include <cmath>
#include <cstdlib>
#include <functional>
#include <limits>
#include <random>
#include <string>
#include <tuple>
#include <utility>

#include "octet/cpu_features.h"
#include "octet/ops/attention.h"
#include "octet/rng.h"
#include "ops/attention/checks.h"
#include "test_util.h"
#include "torch_reference.h"

namespace octet {
namespace {

using octet::testing::available_isas;
using octet::testing::IsaGuard;
using ops::AttentionOptions;

Tensor random_tensor(const Shape& shape, DType dtype, uint32_t seed) {
  std::mt19937 gen(seed);
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  std::vector<float> values(static_cast<size_t>(shape_numel(shape)));
  for (float& v : values) v = dist(gen);
  Tensor t = Tensor::from_floats(shape, values);
  return dtype == DType::F32 ? t : t.to(dtype);
}

// The largest |a - e| / (scale + |e|) elementwise, scale = max |e| (at least 1), and where;
// +inf where an infinity (lse of an empty row) is not matched exactly.
std::pair<double, size_t> worst_error(const Tensor& actual, const Tensor& expected) {
  std::vector<float> a = actual.to_floats(), e = expected.to_floats();
  double scale = 1.0;
  for (float x : e) {
    if (std::isfinite(x)) scale = std::max(scale, std::fabs(double{x}));
  }
  double worst = 0.0;
  size_t worst_at = 0;
  for (size_t n = 0; n < a.size(); ++n) {
    const double err = !std::isfinite(e[n])
                           ? (a[n] == e[n] ? 0.0 : std::numeric_limits<double>::infinity())
                           : std::fabs(double{a[n]} - e[n]) / (scale + std::fabs(double{e[n]}));
    if (!(err <= worst)) {
      worst = err;
      worst_at = n;
    }
  }
  return {worst, worst_at};
}

// |a - e| <= tol * (1 + |e|) elementwise, relative to the tensor's scale (max |e|, at least 1):
// gradients and outputs here are O(1). Infinities (lse of empty rows) must match exactly.
void expect_close(const Tensor& actual, const Tensor& expected, double tol,
                  const std::string& what) {
  ASSERT_EQ(actual.shape(), expected.shape()) << what;
  const auto [worst, worst_at] = worst_error(actual, expected);
  EXPECT_LE(worst, tol) << what << ": worst at " << worst_at << " got "
                        << actual.to_floats()[worst_at] << " expected "
                        << expected.to_floats()[worst_at];
}

// Every element bit for bit (an F32 or BF16 tensor's values as floats).
void expect_identical(const Tensor& actual, const Tensor& expected, const std::string& what) {
  ASSERT_EQ(actual.shape(), expected.shape()) << what;
  ASSERT_EQ(actual.dtype(), expected.dtype()) << what;
  const std::vector<float> a = actual.to_floats(), e = expected.to_floats();
  for (size_t n = 0; n < a.size(); ++n) {
    ASSERT_EQ(std::bit_cast<uint32_t>(a[n]), std::bit_cast<uint32_t>(e[n]))
        << what << " at " << n << ": " << a[n] << " vs " << e[n];
  }
}

struct Grads {
  Tensor out, lse, dq, dk, dv;
  Tensor dbias;  // [H,T,S] where the options carry a bias
};

// With options.bias, the backward also writes dbias (options.dbias is set here).
template <typename Forward, typename Backward>
Grads run(Forward forward, Backward backward, const Tensor& q, const Tensor& k, const Tensor& v,
          const Tensor& dout, AttentionOptions o, bool lse_hi_lo) {
  Grads g;
  if (o.bias != nullptr) {
    g.dbias = Tensor::empty(o.bias->shape(), DType::F32);
    o.dbias = &g.dbias;
  }
  g.out = Tensor::empty(q.shape(), q.dtype());
  g.lse = lse_hi_lo ? Tensor::empty({q.dim(0), q.dim(2), q.dim(1), 2}, DType::F32)
                    : Tensor::empty({q.dim(0), q.dim(2), q.dim(1)}, DType::F32);
  g.dq = Tensor::empty(q.shape(), q.dtype());
  g.dk = Tensor::empty(k.shape(), k.dtype());
  g.dv = Tensor::empty(v.shape(), v.dtype());
  forward(q, k, v, o, g.out, g.lse);
  backward(q, k, v, g.out, g.lse, dout, o, g.dq, g.dk, g.dv);
  return g;
}

// lse_hi_lo: lse [B,H,T,2] (hi + lo) instead of [B,H,T].
Grads run_fast(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& dout,
               const AttentionOptions& o, bool lse_hi_lo = false) {
  return run(ops::flash_attention_forward, ops::flash_attention_backward, q, k, v, dout, o,
             lse_hi_lo);
}
Grads run_reference(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& dout,
                    const AttentionOptions& o, bool lse_hi_lo = false) {
  return run(ops::reference::flash_attention_forward, ops::reference::flash_attention_backward, q,
             k, v, dout, o, lse_hi_lo);
}

void expect_grads_close(const Grads& a, const Grads& e, double tol, const std::string& what) {
  expect_close(a.out, e.out, tol, what + " out");
  expect_close(a.lse, e.lse, 1e-5, what + " lse");  // F32 in every dtype
  expect_close(a.dq, e.dq, tol, what + " dq");
  expect_close(a.dk, e.dk, tol, what + " dk");
  expect_close(a.dv, e.dv, tol, what + " dv");
  ASSERT_EQ(a.dbias.defined(), e.dbias.defined()) << what;
  if (e.dbias.defined()) expect_close(a.dbias, e.dbias, tol, what + " dbias");
}

// Prints the worst relative error of out and each gradient (see worst_error).
void print_errors(const Grads& a, const Grads& e, const std::string& what) {
  std::printf("[ measured ] %s:", what.c_str());
  for (auto [name, x, y] : {std::tuple{"out", &a.out, &e.out}, std::tuple{"dq", &a.dq, &e.dq},
                            std::tuple{"dk", &a.dk, &e.dk}, std::tuple{"dv", &a.dv, &e.dv},
                            std::tuple{"dbias", &a.dbias, &e.dbias}}) {
    if (x->defined() && y->defined()) std::printf(" %s %.1e", name, worst_error(*x, *y).first);
  }
  std::printf("\n");
}

// A bias [H,T,S] F32, uniform in [-magnitude, magnitude].
Tensor random_bias(int64_t H, int64_t T, int64_t S, float magnitude, uint32_t seed) {
  Tensor bias = random_tensor({H, T, S}, DType::F32, seed);
  for (int64_t n = 0; n < bias.numel(); ++n) bias.data<float>()[n] *= magnitude;
  return bias;
}

struct Case {
  const char* name;
  int64_t B, T, S, H, Hkv, D;
  bool causal = false;
  int64_t window_left = -1, window_right = -1;
  std::vector<int32_t> q_lengths = {}, kv_lengths = {};  // empty: no padding
  float dropout = 0.0f;
  DType dtype = DType::F32;
  float bias = 0.0f;  // > 0: a bias [H,T,S] uniform in [-bias, bias] (and dbias checked)
};

std::ostream& operator<<(std::ostream& out, const Case& c) {
  return out << c.name;
}

// F32: both sides accumulate in F32 or better; the fast path's exp2 polynomial (2e-7) and
// summation order over up to 256-long dots and 130 keys stay well below 1e-4.
// BF16: inputs are identical bf16 values on every side; outputs and gradients are rounded
// to bf16 (2^-8 relative spacing), so one side may land one bf16 step from the other.
double tolerance(DType dtype) {
  return dtype == DType::F32 ? 1e-4 : 1e-2;
}

class AttentionCase : public ::testing::TestWithParam<Case> {};

TEST_P(AttentionCase, FastMatchesReferenceOnEveryIsaAndTorch) {
  const Case& c = GetParam();
  Tensor q = random_tensor({c.B, c.T, c.H, c.D}, c.dtype, 1);
  Tensor k = random_tensor({c.B, c.S, c.Hkv, c.D}, c.dtype, 2);
  Tensor v = random_tensor({c.B, c.S, c.Hkv, c.D}, c.dtype, 3);
  Tensor dout = random_tensor({c.B, c.T, c.H, c.D}, c.dtype, 4);
  AttentionOptions o;
  o.causal = c.causal;
  o.window_left = c.window_left;
  o.window_right = c.window_right;
  o.dropout = c.dropout;
  o.seed = 1234;
  o.offset = 7;
  Tensor q_lengths, kv_lengths;
  TensorMap inputs{{"q", q}, {"k", k}, {"v", v}, {"dout", dout}};
  if (!c.q_lengths.empty()) {
    q_lengths = Tensor::empty({c.B}, DType::I32);
    kv_lengths = Tensor::empty({c.B}, DType::I32);
    for (int64_t b = 0; b < c.B; ++b) {
      q_lengths.data<int32_t>()[b] = c.q_lengths[b];
      kv_lengths.data<int32_t>()[b] = c.kv_lengths[b];
    }
    o.q_lengths = &q_lengths;
    o.kv_lengths = &kv_lengths;
    inputs["q_lengths"] = q_lengths;
    inputs["kv_lengths"] = kv_lengths;
  }
  if (c.dropout > 0.0f) {
    Tensor keep = Tensor::empty({c.B, c.H, c.T, c.S}, DType::U8);
    ops::attention_dropout_mask(o.seed, o.offset, o.dropout, keep);
    inputs["keep"] = keep;
  }
  Tensor bias;
  if (c.bias > 0.0f) {
    bias = random_bias(c.H, c.T, c.S, c.bias, 5);
    o.bias = &bias;
    inputs["bias"] = bias;
  }

  const double tol = tolerance(c.dtype);
  Grads reference = run_reference(q, k, v, dout, o);
  const Isa saved = active_isa();
  for (Isa isa : available_isas()) {
    set_active_isa(isa);
    const Grads fast = run_fast(q, k, v, dout, o);
    expect_grads_close(fast, reference, tol, std::string("fast/") + isa_name(isa));
    if (c.bias > 0.0f) print_errors(fast, reference, std::string("fast/") + isa_name(isa));
    // lse as hi + lo (what the modules pass): the same results, +inf rows included.
    const Grads split = run_fast(q, k, v, dout, o, true);
    Grads split_as_f32 = split;
    split_as_f32.lse = Tensor::empty(reference.lse.shape(), DType::F32);
    for (int64_t row = 0; row < reference.lse.numel(); ++row) {
      split_as_f32.lse.data<float>()[row] = split.lse.data<float>()[2 * row];
    }
    expect_grads_close(split_as_f32, reference, tol, std::string("fast hi + lo/") + isa_name(isa));
  }
  set_active_isa(saved);

  std::string args = "{\"causal\": " + std::string(c.causal ? "true" : "false") +
                     ", \"window_left\": " + std::to_string(c.window_left) +
                     ", \"window_right\": " + std::to_string(c.window_right) +
                     ", \"dropout\": " + std::to_string(c.dropout) + "}";
  TensorMap torch = testing::run_torch("attention", inputs, args);
  Grads expected{torch.at("out"), torch.at("lse"), torch.at("dq"),
                 torch.at("dk"),  torch.at("dv"),  c.bias > 0.0f ? torch.at("dbias") : Tensor()};
  expect_grads_close(reference, expected, tol, "reference vs torch");
  const Grads fast = run_fast(q, k, v, dout, o);
  expect_grads_close(fast, expected, tol, "fast vs torch");
  if (c.bias > 0.0f) {
    print_errors(reference, expected, "reference vs torch");
    print_errors(fast, expected, "fast vs torch");
  }
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, AttentionCase,
    ::testing::Values(
        Case{.name = "single_query_d32", .B = 1, .T = 1, .S = 7, .H = 2, .Hkv = 2, .D = 32},
        Case{.name = "causal_t7_gqa_d64",
             .B = 2,
             .T = 7,
             .S = 7,
             .H = 2,
             .Hkv = 1,
             .D = 64,
             .causal = true},
        Case{.name = "causal_t65_s130_gqa6to2_d80",
             .B = 1,
             .T = 65,
             .S = 130,
             .H = 6,
             .Hkv = 2,
             .D = 80,
             .causal = true},
        Case{.name = "causal_t130_s65_rows_fully_masked_d128",
             .B = 2,
             .T = 130,
             .S = 65,
             .H = 2,
             .Hkv = 2,
             .D = 128,
             .causal = true},
        Case{.name = "window_16_8_t130_d64",
             .B = 1,
             .T = 130,
             .S = 130,
             .H = 2,
             .Hkv = 1,
             .D = 64,
             .window_left = 16,
             .window_right = 8},
        Case{.name = "window_left_causal_t65_d40",
             .B = 1,
             .T = 65,
             .S = 65,
             .H = 2,
             .Hkv = 2,
             .D = 40,
             .causal = true,
             .window_left = 20},
        Case{.name = "padding_causal_t65_s70_d32",
             .B = 3,
             .T = 65,
             .S = 70,
             .H = 2,
             .Hkv = 2,
             .D = 32,
             .causal = true,
             .q_lengths = {65, 30, 1},
             .kv_lengths = {70, 5, 0}},
        Case{.name = "no_mask_t33_s47_d256", .B = 1, .T = 33, .S = 47, .H = 2, .Hkv = 2, .D = 256},
        Case{.name = "dropout_t65_s70_d32",
             .B = 1,
             .T = 65,
             .S = 70,
             .H = 2,
             .Hkv = 1,
             .D = 32,
             .dropout = 0.2f},
        Case{.name = "bf16_causal_t65_s130_gqa6to2_d64",
             .B = 1,
             .T = 65,
             .S = 130,
             .H = 6,
             .Hkv = 2,
             .D = 64,
             .causal = true,
             .dtype = DType::BF16},
        Case{.name = "bf16_dropout_window_t130_d128",
             .B = 1,
             .T = 130,
             .S = 130,
             .H = 4,
             .Hkv = 2,
             .D = 128,
             .window_left = 32,
             .window_right = 0,
             .dropout = 0.1f,
             .dtype = DType::BF16},
        // BF16 tiles: padding rows and keys, head dims that are not a multiple of 64 or 32, or odd.
        Case{.name = "bf16_padding_causal_t65_s70_d40",
             .B = 3,
             .T = 65,
             .S = 70,
             .H = 2,
             .Hkv = 2,
             .D = 40,
             .causal = true,
             .q_lengths = {65, 30, 1},
             .kv_lengths = {70, 5, 0},
             .dtype = DType::BF16},
        Case{.name = "bf16_causal_gqa_t70_d33",
             .B = 2,
             .T = 70,
             .S = 70,
             .H = 4,
             .Hkv = 2,
             .D = 33,
             .causal = true,
             .dtype = DType::BF16},
        Case{.name = "bf16_no_mask_t33_s47_d256",
             .B = 1,
             .T = 33,
             .S = 47,
             .H = 2,
             .Hkv = 2,
             .D = 256,
             .dtype = DType::BF16},
        // T5's relative position bias, +-30 so that some rows are ruled by the bias alone,
        // with every other feature at once (one PyTorch run: its start-up is most of the
        // time): padding (a batch entry without keys), causal, dropout, GQA, T != S. More
        // bias cases, BF16 among them, are held to the reference in BiasMatchesReference*.
        Case{.name = "bias30_padding_causal_dropout_gqa_t65_s70_d24",
             .B = 3,
             .T = 65,
             .S = 70,
             .H = 4,
             .Hkv = 2,
             .D = 24,
             .causal = true,
             .q_lengths = {65, 30, 1},
             .kv_lengths = {70, 5, 0},
             .dropout = 0.2f,
             .bias = 30.0f}),
    [](const ::testing::TestParamInfo<Case>& param) { return std::string(param.param.name); });

// OCTET_ATTENTION_TILES picks the tile products where the processor has VDPBF16PS (the suite
// runs again under each, see CMakeLists.txt): BF16 tiles (P and dS rounded to BF16 as operands)
// agree with F32 tiles to BF16's tolerance, and only BF16 inputs without FP8 attention take them.
TEST(Attention, Bf16TilesAgreeWithF32Tiles) {
  const char* saved_env = std::getenv("OCTET_ATTENTION_TILES");
  const std::string saved = saved_env != nullptr ? saved_env : "";
  IsaGuard guard;
  set_active_isa(Isa::Avx512);
  const bool available = active_isa() == Isa::Avx512 && cpu_features().avx512_bf16;
  Tensor q = random_tensor({2, 150, 4, 64}, DType::BF16, 41);
  Tensor k = random_tensor({2, 150, 2, 64}, DType::BF16, 42);
  Tensor v = random_tensor({2, 150, 2, 64}, DType::BF16, 43);
  Tensor dout = random_tensor({2, 150, 4, 64}, DType::BF16, 44);
  AttentionOptions o;
  o.causal = true;
  setenv("OCTET_ATTENTION_TILES", "f32", 1);
  EXPECT_FALSE(ops::cpu::flash_attention_bf16_tiles(o, DType::BF16));
  const Grads f32_tiles = run_fast(q, k, v, dout, o);
  setenv("OCTET_ATTENTION_TILES", "bf16", 1);
  EXPECT_EQ(ops::cpu::flash_attention_bf16_tiles(o, DType::BF16), available);
  EXPECT_FALSE(ops::cpu::flash_attention_bf16_tiles(o, DType::F32));
  AttentionOptions fp8 = o;
  fp8.fp8.p_scale = 1.0f;
  EXPECT_FALSE(ops::cpu::flash_attention_bf16_tiles(fp8, DType::BF16));
  const Grads bf16_tiles = run_fast(q, k, v, dout, o);
  expect_grads_close(bf16_tiles, f32_tiles, tolerance(DType::BF16), "bf16 vs f32 tiles");
  expect_grads_close(bf16_tiles, run_reference(q, k, v, dout, o), tolerance(DType::BF16),
                     "bf16 tiles vs reference");
  setenv("OCTET_ATTENTION_TILES", "fast", 1);
  EXPECT_THROW(ops::cpu::flash_attention_bf16_tiles(o, DType::BF16), Error);
  if (saved.empty()) {
    unsetenv("OCTET_ATTENTION_TILES");
  } else {
    setenv("OCTET_ATTENTION_TILES", saved.c_str(), 1);
  }
}

// Sets OCTET_ATTENTION_TILES for a scope and puts it back.
struct TilesGuard {
  std::string saved;
  bool had = false;
  explicit TilesGuard(const char* tiles) {
    const char* text = std::getenv("OCTET_ATTENTION_TILES");
    had = text != nullptr;
    saved = had ? text : "";
    setenv("OCTET_ATTENTION_TILES", tiles, 1);
  }
  ~TilesGuard() {
    if (had) {
      setenv("OCTET_ATTENTION_TILES", saved.c_str(), 1);
    } else {
      unsetenv("OCTET_ATTENTION_TILES");
    }
  }
};

// Every kernel path the processor has for a dtype, as (ISA, OCTET_ATTENTION_TILES): F32 tiles on
// each ISA, and BF16 tiles (AVX-512 BF16) for BF16 inputs.
std::vector<std::pair<Isa, const char*>> kernel_paths(DType dtype) {
  std::vector<std::pair<Isa, const char*>> paths;
  for (Isa isa : available_isas()) paths.emplace_back(isa, "f32");
  IsaGuard guard;
  set_active_isa(Isa::Avx512);
  if (dtype == DType::BF16 && active_isa() == Isa::Avx512 && cpu_features().avx512_bf16) {
    paths.emplace_back(Isa::Avx512, "bf16");
  }
  return paths;
}

// A zero bias is no bias, bit for bit, on every kernel path: the kernels add bias / scale to the
// unscaled scores, so adding 0 changes nothing; asking for dbias changes no other result; and
// dbias does not need a bias (the score gradients are the same).
TEST(Attention, ZeroBiasIsExactlyNoBias) {
  const int64_t B = 3, T = 40, S = 70, H = 4, Hkv = 2, D = 24;
  Tensor q_lengths = Tensor::empty({B}, DType::I32), kv_lengths = Tensor::empty({B}, DType::I32);
  for (int64_t b = 0; b < B; ++b) {
    q_lengths.data<int32_t>()[b] = std::vector<int32_t>{40, 17, 3}[b];
    kv_lengths.data<int32_t>()[b] = std::vector<int32_t>{70, 30, 0}[b];
  }
  Tensor zero_bias = Tensor::zeros({H, T, S}, DType::F32);
  IsaGuard guard;
  for (DType dtype : {DType::F32, DType::BF16}) {
    Tensor q = random_tensor({B, T, H, D}, dtype, 61);
    Tensor k = random_tensor({B, S, Hkv, D}, dtype, 62);
    Tensor v = random_tensor({B, S, Hkv, D}, dtype, 63);
    Tensor dout = random_tensor({B, T, H, D}, dtype, 64);
    AttentionOptions o;
    o.causal = true;
    o.dropout = 0.1f;
    o.seed = 3;
    o.q_lengths = &q_lengths;
    o.kv_lengths = &kv_lengths;
    for (auto [isa, tiles] : kernel_paths(dtype)) {
      set_active_isa(isa);
      const TilesGuard tiles_guard(tiles);
      const std::string what =
          std::string(dtype_name(dtype)) + ", " + isa_name(isa) + ", " + tiles + " tiles";
      const Grads plain = run_fast(q, k, v, dout, o);
      AttentionOptions zero = o;
      zero.bias = &zero_bias;
      const Grads biased = run_fast(q, k, v, dout, zero);
      for (auto [name, a, e] :
           {std::tuple{"out", &biased.out, &plain.out}, std::tuple{"lse", &biased.lse, &plain.lse},
            std::tuple{"dq", &biased.dq, &plain.dq}, std::tuple{"dk", &biased.dk, &plain.dk},
            std::tuple{"dv", &biased.dv, &plain.dv}}) {
        expect_identical(*a, *e, what + " " + name);
      }
      Tensor dbias = Tensor::empty({H, T, S}, DType::F32);
      AttentionOptions gradient_only = o;
      gradient_only.dbias = &dbias;
      Grads g = run_fast(q, k, v, dout, o);
      ops::flash_attention_backward(q, k, v, plain.out, plain.lse, dout, gradient_only, g.dq, g.dk,
                                    g.dv);
      expect_identical(dbias, biased.dbias, what + " dbias without a bias");
      expect_identical(g.dq, plain.dq, what + " dq beside dbias");
    }
  }
}

// A bias on every kernel path (F32 tiles on each ISA, BF16 tiles), F32 and BF16 inputs, against
// the reference to each dtype's tolerance, dbias included: +-30 with a causal mask, GQA and
// T < S over three key tiles; +-3 with padding (a batch entry without keys) and dropout. dbias
// is summed over the batch without races at any thread count: one thread (one chunk, written
// in place), this machine's, and 8 (here a chunk per batch entry, summed after).
TEST(Attention, BiasMatchesReferenceOnEveryPathAndThreadCount) {
  struct BiasCase {
    const char* name;
    int64_t B, T, S, H, Hkv, D;
    bool causal;
    std::vector<int32_t> q_lengths, kv_lengths;
    float dropout, bias;
  };
  const BiasCase cases[] = {
      {"bias30 causal gqa t40 s140", 3, 40, 140, 4, 2, 16, true, {}, {}, 0.0f, 30.0f},
      {"bias3 padding dropout t65 s70",
       3,
       65,
       70,
       2,
       1,
       16,
       false,
       {65, 30, 1},
       {70, 5, 0},
       0.2f,
       3.0f}};
  const int saved_threads = omp_get_max_threads();
  IsaGuard guard;
  for (const BiasCase& c : cases) {
    Tensor q_lengths = Tensor::empty({c.B}, DType::I32);
    Tensor kv_lengths = Tensor::empty({c.B}, DType::I32);
    AttentionOptions o;
    if (!c.q_lengths.empty()) {
      for (int64_t b = 0; b < c.B; ++b) {
        q_lengths.data<int32_t>()[b] = c.q_lengths[b];
        kv_lengths.data<int32_t>()[b] = c.kv_lengths[b];
      }
      o.q_lengths = &q_lengths;
      o.kv_lengths = &kv_lengths;
    }
    Tensor bias = random_bias(c.H, c.T, c.S, c.bias, 75);
    o.causal = c.causal;
    o.dropout = c.dropout;
    o.seed = 9;
    o.bias = &bias;
    for (DType dtype : {DType::F32, DType::BF16}) {
      Tensor q = random_tensor({c.B, c.T, c.H, c.D}, dtype, 71);
      Tensor k = random_tensor({c.B, c.S, c.Hkv, c.D}, dtype, 72);
      Tensor v = random_tensor({c.B, c.S, c.Hkv, c.D}, dtype, 73);
      Tensor dout = random_tensor({c.B, c.T, c.H, c.D}, dtype, 74);
      const Grads expected = run_reference(q, k, v, dout, o);
      for (auto [isa, tiles] : kernel_paths(dtype)) {
        set_active_isa(isa);
        const TilesGuard tiles_guard(tiles);
        for (int threads : {1, saved_threads, 8}) {
          omp_set_num_threads(threads);
          const Grads g = run_fast(q, k, v, dout, o);
          omp_set_num_threads(saved_threads);
          const std::string what = std::string(c.name) + ", " + std::string(dtype_name(dtype)) +
                                   ", " + isa_name(isa) + ", " + tiles + " tiles, " +
                                   std::to_string(threads) + " threads";
          expect_grads_close(g, expected, tolerance(dtype), what);
          if (threads == 8) print_errors(g, expected, what);
        }
      }
    }
  }
}

// Central differences of L = sum(out * dout) against the fast backward, F32, tiny shape with
// GQA, a causal mask, T != S and a bias. eps = 1e-2 keeps the F32 rounding of L (~1e-7 / eps)
// and the O(eps^2) truncation both near 1e-4.
TEST(Attention, FiniteDifferencesMatchBackward) {
  const int64_t B = 1, T = 3, S = 5, H = 2, Hkv = 1, D = 8;
  Tensor q = random_tensor({B, T, H, D}, DType::F32, 11);
  Tensor k = random_tensor({B, S, Hkv, D}, DType::F32, 12);
  Tensor v = random_tensor({B, S, Hkv, D}, DType::F32, 13);
  Tensor dout = random_tensor({B, T, H, D}, DType::F32, 14);
  Tensor bias = random_bias(H, T, S, 2.0f, 15);
  AttentionOptions o;
  o.causal = true;
  o.bias = &bias;
  Grads g = run_fast(q, k, v, dout, o);
  auto loss = [&]() {
    Tensor out = Tensor::empty(q.shape(), DType::F32);
    Tensor lse = Tensor::empty({B, H, T}, DType::F32);
    ops::flash_attention_forward(q, k, v, o, out, lse);
    double sum = 0.0;
    for (int64_t n = 0; n < out.numel(); ++n)
      sum += double{out.data<float>()[n]} * dout.data<float>()[n];
    return sum;
  };
  const float eps = 1e-2f;
  for (auto [input, grad, name] :
       {std::tuple{&q, &g.dq, "dq"}, std::tuple{&k, &g.dk, "dk"}, std::tuple{&v, &g.dv, "dv"},
        std::tuple{&bias, &g.dbias, "dbias"}}) {
    for (int64_t n = 0; n < input->numel(); ++n) {
      float& x = input->data<float>()[n];
      const float saved = x;
      x = saved + eps;
      const double up = loss();
      x = saved - eps;
      const double down = loss();
      x = saved;
      const double numeric = (up - down) / (2.0 * eps);
      EXPECT_NEAR(grad->data<float>()[n], numeric, 2e-3) << name << "[" << n << "]";
    }
  }
}

// Scores shifted by a constant c (the probabilities do not change) keep F32 accuracy at any
// magnitude on every ISA path: the online softmax subtracts the running maximum from the
// unscaled scores before scaling them, and the backward recomputes them from an lse kept as
// hi + lo, relative to a reference value near the row's maximum. q = (1, s_i, 0...) and k_j = (c,
// r_j, 0...), with s_i a power of two and r_j a multiple of 1/32, make every score c + s_i r_j
// exact in F32, so the float64 reference sees the same scores. (Scaling q by scale * log2 e first
// rounds each score to ~2^-8 at c = 1e5: ~3e-3 relative error in the probabilities.)
TEST(Attention, ShiftedScoresKeepF32AccuracyAtAnyMagnitude) {
  const int64_t B = 1, T = 70, S = 130, H = 2, Hkv = 1, D = 16;
  std::mt19937 gen(21);
  Tensor q = Tensor::zeros({B, T, H, D}, DType::F32);
  for (int64_t i = 0; i < T * H; ++i) {
    q.data<float>()[i * D] = 1.0f;
    q.data<float>()[i * D + 1] = std::ldexp(1.0f, static_cast<int>(gen() % 3) - 1);
  }
  Tensor v = random_tensor({B, S, Hkv, D}, DType::F32, 22);
  Tensor dout = random_tensor({B, T, H, D}, DType::F32, 23);
  IsaGuard guard;
  for (const bool causal : {false, true}) {
    for (const float c : {0.0f, 1e3f, -1e4f, 1e5f, -1e5f}) {
      Tensor k = Tensor::zeros({B, S, Hkv, D}, DType::F32);
      for (int64_t j = 0; j < S; ++j) {
        k.data<float>()[j * D] = c;
        k.data<float>()[j * D + 1] = static_cast<float>(static_cast<int>(gen() % 129) - 64) / 32;
      }
      AttentionOptions o;
      o.causal = causal;
      o.softmax_scale = 0.9f;
      const Grads expected = run_reference(q, k, v, dout, o);
      for (Isa isa : available_isas()) {
        set_active_isa(isa);
        const Grads g = run_fast(q, k, v, dout, o);
        const std::string what = std::string(causal ? "causal" : "full") + ", shift " +
                                 std::to_string(c) + ", " + isa_name(isa);
        expect_close(g.out, expected.out, 1e-5, what + " out");
        expect_close(g.lse, expected.lse, 1e-6, what + " lse");
        // The backward from an lse as hi + lo: dK and dV to F32 accuracy at every shift. dQ's
        // first column is c * sum_j dS_j, where sum_j dS_j = 0: the few F32 roundings of each
        // dS_j are multiplied by c, so it is held to c * 2^-21 (an F32 lse: 81 at c = 1e5).
        const Grads split = run_fast(q, k, v, dout, o, true);
        const Grads split_ref = run_reference(q, k, v, dout, o, true);
        for (int64_t row = 0; row < B * H * T; ++row) {  // hi + lo to ~1e-6 at any shift
          const float* a = split.lse.data<float>() + 2 * row;
          const float* e = split_ref.lse.data<float>() + 2 * row;
          ASSERT_NEAR(double{a[0]} + a[1], double{e[0]} + e[1], 1e-5) << what << " lse row " << row;
        }
        expect_close(split.dv, split_ref.dv, 1e-5, what + " dv");
        expect_close(split.dk, split_ref.dk, 1e-5, what + " dk");
        expect_close(split.dq, split_ref.dq, 1e-5 + std::fabs(c) * 0x1p-21, what + " dq");
      }
    }
  }
}

// The dropout words are Philox4x32-10 (include/octet/rng.h, its known answers are tested in
// test_dropout) at counter (j / 4, i, b * H + h, offset), as attention.h documents.
TEST(Attention, DropoutWordsUseTheDocumentedCounter) {
  auto words = ops::attention_detail::dropout_words(0x299f31d0a4093822ull, 7, 5, 9, 12);
  auto expected =
      philox4x32(0x299f31d0a4093822ull, (uint64_t{9} << 32) | 3, (uint64_t{7} << 32) | 5);
  for (int w = 0; w < 4; ++w) EXPECT_EQ(words.word[w], expected[w]) << w;
}

TEST(Attention, DropoutKeepRateAndDeterminism) {
  const float p = 0.3f;
  Tensor keep = Tensor::empty({2, 4, 128, 128}, DType::U8);
  ops::attention_dropout_mask(99, 0, p, keep);
  double kept = 0;
  for (int64_t n = 0; n < keep.numel(); ++n) kept += keep.data<uint8_t>()[n];
  // 131072 Bernoulli(0.7) draws: standard deviation of the rate 0.0013; allow ~5 sigma.
  EXPECT_NEAR(kept / static_cast<double>(keep.numel()), 1.0 - p, 0.0065);

  Tensor q = random_tensor({1, 70, 2, 32}, DType::F32, 21);
  Tensor k = random_tensor({1, 70, 2, 32}, DType::F32, 22);
  Tensor v = random_tensor({1, 70, 2, 32}, DType::F32, 23);
  AttentionOptions o;
  o.dropout = p;
  o.seed = 5;
  auto forward = [&](const AttentionOptions& options) {
    Tensor out = Tensor::empty(q.shape(), DType::F32);
    Tensor lse = Tensor::empty({1, 2, 70}, DType::F32);
    ops::flash_attention_forward(q, k, v, options, out, lse);
    return out.to_floats();
  };
  const std::vector<float> first = forward(o);
  EXPECT_EQ(first, forward(o)) << "same seed and offset must give the same mask";
  AttentionOptions other_seed = o;
  other_seed.seed = 6;
  EXPECT_NE(first, forward(other_seed));
  AttentionOptions other_offset = o;
  other_offset.offset = 1;
  EXPECT_NE(first, forward(other_offset));
  AttentionOptions no_dropout = o;
  no_dropout.dropout = 0.0f;
  EXPECT_NE(first, forward(no_dropout));
}

// `run` throws an octet::Error whose message is exactly `message`.
void expect_error(const std::function<void()>& run, const std::string& message) {
  try {
    run();
    ADD_FAILURE() << "no error; expected: " << message;
  } catch (const Error& e) {
    EXPECT_EQ(std::string(e.what()), message);
  }
}

TEST(Attention, BadArgumentsThrow) {
  Tensor q = Tensor::zeros({1, 4, 4, 32}, DType::F32);
  Tensor k = Tensor::zeros({1, 6, 2, 32}, DType::F32);
  Tensor out = Tensor::empty(q.shape(), DType::F32);
  Tensor lse = Tensor::empty({1, 4, 4}, DType::F32);
  AttentionOptions o;
  EXPECT_NO_THROW(ops::flash_attention_forward(q, k, k, o, out, lse));
  Tensor k3 = Tensor::zeros({1, 6, 3, 32}, DType::F32);  // 4 heads over 3 kv heads
  EXPECT_THROW(ops::flash_attention_forward(q, k3, k3, o, out, lse), Error);
  Tensor v_short = Tensor::zeros({1, 5, 2, 32}, DType::F32);
  EXPECT_THROW(ops::flash_attention_forward(q, k, v_short, o, out, lse), Error);
  Tensor k_bf16 = Tensor::zeros({1, 6, 2, 32}, DType::BF16);
  EXPECT_THROW(ops::flash_attention_forward(q, k_bf16, k_bf16, o, out, lse), Error);
  {
    // Head dims past 256 are unsupported: every entry point says so, not some later check.
    Tensor q_wide = Tensor::zeros({1, 4, 4, 264}, DType::F32);
    Tensor k_wide = Tensor::zeros({1, 6, 2, 264}, DType::F32);
    Tensor out_wide = Tensor::empty(q_wide.shape(), DType::F32);
    Tensor dk_wide = Tensor::empty(k_wide.shape(), DType::F32);
    Tensor dv_wide = Tensor::empty(k_wide.shape(), DType::F32);
    expect_error([&] { ops::flash_attention_forward(q_wide, k_wide, k_wide, o, out_wide, lse); },
                 "flash_attention_forward: head dim D expected in [1,256], got 264");
    expect_error(
        [&] { ops::reference::flash_attention_forward(q_wide, k_wide, k_wide, o, out_wide, lse); },
        "flash_attention_forward: head dim D expected in [1,256], got 264");
    expect_error(
        [&] {
          ops::flash_attention_backward(q_wide, k_wide, k_wide, out_wide, lse, out_wide, o,
                                        out_wide, dk_wide, dv_wide);
        },
        "flash_attention_backward: head dim D expected in [1,256], got 264");
    // 256 itself is supported.
    Tensor q_256 = Tensor::zeros({1, 4, 4, 256}, DType::F32);
    Tensor k_256 = Tensor::zeros({1, 6, 2, 256}, DType::F32);
    Tensor out_256 = Tensor::empty(q_256.shape(), DType::F32);
    EXPECT_NO_THROW(ops::flash_attention_forward(q_256, k_256, k_256, o, out_256, lse));
  }
  Tensor bad_lse = Tensor::empty({1, 4, 5}, DType::F32);
  EXPECT_THROW(ops::flash_attention_forward(q, k, k, o, out, bad_lse), Error);
  Tensor q3 = Tensor::zeros({4, 4, 32}, DType::F32);
  EXPECT_THROW(ops::flash_attention_forward(q3, k, k, o, out, lse), Error);
  AttentionOptions full_dropout;
  full_dropout.dropout = 1.0f;
  EXPECT_THROW(ops::flash_attention_forward(q, k, k, full_dropout, out, lse), Error);
  Tensor lengths = Tensor::empty({1}, DType::I32);
  lengths.data<int32_t>()[0] = 7;  // more than S = 6
  AttentionOptions padded;
  padded.kv_lengths = &lengths;
  EXPECT_THROW(ops::flash_attention_forward(q, k, k, padded, out, lse), Error);
  Tensor dq = Tensor::empty(q.shape(), DType::F32);
  Tensor dk_bad = Tensor::empty({1, 6, 4, 32}, DType::F32);
  Tensor dv = Tensor::empty(k.shape(), DType::F32);
  EXPECT_THROW(ops::flash_attention_backward(q, k, k, out, lse, out, o, dq, dk_bad, dv), Error);

  // Bias [H,T,S] = [4,4,6] F32, finite, not with FP8; dbias the same shape and dtype.
  Tensor bias_short = Tensor::zeros({4, 4, 5}, DType::F32);
  Tensor bias_bf16 = Tensor::zeros({4, 4, 6}, DType::BF16);
  Tensor bias_inf = Tensor::zeros({4, 4, 6}, DType::F32);
  bias_inf.data<float>()[(2 * 4 + 1) * 6 + 3] = -std::numeric_limits<float>::infinity();
  const Tensor bias = Tensor::zeros({4, 4, 6}, DType::F32);
  for (auto [tensor, message] :
       {std::pair{&bias_short,
                  "flash_attention_forward: bias expected [H,T,S]=[4,4,6], got [4,4,5]"},
        std::pair{&bias_bf16, "flash_attention_forward: bias expected dtype f32, got bf16"},
        std::pair{&bias_inf,
                  "flash_attention_forward: bias / softmax_scale expected finite, got -inf / "
                  "0.176777 at [h,i,j]=[2,1,3]"}}) {
    AttentionOptions biased;
    biased.bias = tensor;
    expect_error([&] { ops::flash_attention_forward(q, k, k, biased, out, lse); }, message);
    expect_error([&] { ops::reference::flash_attention_forward(q, k, k, biased, out, lse); },
                 message);
  }
  AttentionOptions fp8_bias;
  fp8_bias.bias = &bias;
  fp8_bias.fp8.p_scale = 448.0f;
  expect_error([&] { ops::flash_attention_forward(q, k, k, fp8_bias, out, lse); },
               "flash_attention_forward: bias expected no FP8 attention (fp8 scales 0), got "
               "p_scale 448, ds_scale 0");
  Tensor dbias_bad = Tensor::empty({1, 4, 6}, DType::F32);
  AttentionOptions bad_dbias;
  bad_dbias.bias = &bias;
  bad_dbias.dbias = &dbias_bad;
  Tensor dk = Tensor::empty(k.shape(), DType::F32);
  expect_error(
      [&] { ops::flash_attention_backward(q, k, k, out, lse, out, bad_dbias, dq, dk, dv); },
      "flash_attention_backward: dbias expected [H,T,S]=[4,4,6], got [1,4,6]");
  Tensor shared = Tensor::zeros({4, 4, 6}, DType::F32);
  AttentionOptions aliased;
  aliased.bias = &shared;
  aliased.dbias = &shared;
  expect_error([&] { ops::flash_attention_backward(q, k, k, out, lse, out, aliased, dq, dk, dv); },
               "flash_attention_backward: dbias expected its own storage, got the bias's");
}

// Peak scratch of forward + backward grows linearly with T (4x T -> ~4x bytes), never T^2.
TEST(Attention, ScratchMemoryIsLinearInSequenceLength) {
  auto peak_extra = [](int64_t T) {
    Tensor q = random_tensor({1, T, 2, 64}, DType::BF16, 31);
    Tensor k = random_tensor({1, T, 2, 64}, DType::BF16, 32);
    Tensor dout = random_tensor({1, T, 2, 64}, DType::BF16, 33);
    Tensor out = Tensor::empty(q.shape(), DType::BF16);
    Tensor lse = Tensor::empty({1, 2, T}, DType::F32);
    Tensor dq = Tensor::empty(q.shape(), DType::BF16);
    Tensor dk = Tensor::empty(k.shape(), DType::BF16);
    Tensor dv = Tensor::empty(k.shape(), DType::BF16);
    AttentionOptions o;
    o.causal = true;
    reset_peak_memory();
    const int64_t before = memory_stats().current_bytes;
    ops::flash_attention_forward(q, k, k, o, out, lse);
    ops::flash_attention_backward(q, k, k, out, lse, dout, o, dq, dk, dv);
    return memory_stats().peak_bytes - before;
  };
  const int64_t small = peak_extra(256), large = peak_extra(1024);
  ASSERT_GT(small, 0);
  EXPECT_LT(static_cast<double>(large) / static_cast<double>(small), 6.0)
      << small << " bytes at T=256, " << large << " at T=1024";
}

// ---------------------------------------------------------------------------------------------
// FP8 attention (AttentionOptions::fp8).

// The kernels' rounding equals the format tables: float_to_fp8 (saturating) decoded, for every
// code's value, the midpoints between neighbours (ties to even), values just beside them,
// subnormals, zero, the saturation region and Inf, at three scales.
TEST(Attention, Fp8RounderMatchesTheFormatTables) {
  for (DType format : {DType::E4M3, DType::E5M2}) {
    std::vector<float> values;
    for (int code = 0; code < 256; ++code) {
      const float x = fp8_to_float(static_cast<uint8_t>(code), format);
      if (!std::isfinite(x)) continue;
      for (float f : {1.0f, 1.0f + 0x1p-20f, 1.0f - 0x1p-20f}) values.push_back(x * f);
      const float next = fp8_to_float(static_cast<uint8_t>((code + 1) & 0xff), format);
      if (std::isfinite(next) && (code & 0x7f) != 0x7f) {
        const float mid = (x + next) / 2;
        for (float f : {1.0f, 1.0f + 0x1p-20f, 1.0f - 0x1p-20f}) values.push_back(mid * f);
      }
    }
    std::mt19937 gen(3);
    std::uniform_real_distribution<float> exponent(-30.0f, 20.0f);
    for (int n = 0; n < 20000; ++n) {
      values.push_back((gen() % 2 ? 1.0f : -1.0f) * std::exp2(exponent(gen)));
    }
    values.push_back(1e30f);
    values.push_back(-std::numeric_limits<float>::infinity());
    for (float scale : {1.0f, 448.0f, 3.7f}) {
      const ops::attention_detail::Fp8Rounder round(format, scale);
      for (float x : values) {
        const float expected =
            fp8_to_float(float_to_fp8(x * scale, format, /*saturate=*/true), format) *
            (1.0f / scale);
        ASSERT_EQ(round(x), expected) << dtype_name(format) << " scale " << scale << " x " << x;
      }
    }
    EXPECT_TRUE(std::isnan(ops::attention_detail::Fp8Rounder(format, 1.0f)(std::nanf(""))));
  }
}

// Inputs on the E4M3 grid (as DotProductAttention passes them), F32.
Tensor e4m3_values(const Shape& shape, uint32_t seed) {
  Tensor t = random_tensor(shape, DType::F32, seed);
  const ops::attention_detail::Fp8Rounder round(DType::E4M3, 448.0f);
  for (int64_t i = 0; i < t.numel(); ++i) t.data<float>()[i] = round(t.data<float>()[i]);
  return t;
}

// The forward's probabilities and the backward's score gradients are rounded to FP8, on every
// ISA path as in the reference: where each row's keys fit one 64-key tile, the fast path's
// tile-relative P is the reference's, so out, lse and every gradient agree to F32 accuracy;
// the amaxes agree. The ds scale comes from the reference's measured amax (delayed scaling's
// next step).
TEST(Attention, Fp8MatchesReferenceOnEveryIsa) {
  struct Fp8Case {
    const char* name;
    int64_t B, T, S, H, Hkv, D;
    bool causal;
    float dropout;
  };
  const Fp8Case cases[] = {{"causal gqa", 2, 48, 48, 4, 2, 32, true, 0.0f},
                           {"full, dropout", 1, 40, 64, 2, 2, 16, false, 0.2f},
                           {"cross 17x33", 2, 17, 33, 2, 1, 24, false, 0.0f}};
  IsaGuard guard;
  for (const Fp8Case& c : cases) {
    Tensor q = e4m3_values({c.B, c.T, c.H, c.D}, 41);
    Tensor k = e4m3_values({c.B, c.S, c.Hkv, c.D}, 42);
    Tensor v = e4m3_values({c.B, c.S, c.Hkv, c.D}, 43);
    Tensor dout = random_tensor({c.B, c.T, c.H, c.D}, DType::F32, 44);
    AttentionOptions o;
    o.causal = c.causal;
    o.dropout = c.dropout;
    o.seed = 5;
    float ref_p_amax = 0, ref_ds_amax = 0;
    o.fp8.p_scale = 448.0f;
    o.fp8.ds_scale = 1.0f;
    o.fp8.p_amax = &ref_p_amax;
    o.fp8.ds_amax = &ref_ds_amax;
    run_reference(q, k, v, dout, o);
    ASSERT_GT(ref_ds_amax, 0.0f) << c.name;
    o.fp8.ds_scale = 57344.0f / ref_ds_amax;  // E5M2's max over the measured amax
    const Grads expected = run_reference(q, k, v, dout, o, true);
    const Grads exact = [&] {
      AttentionOptions plain = o;
      plain.fp8 = {};
      return run_reference(q, k, v, dout, plain, true);
    }();
    EXPECT_NEAR(ref_p_amax, c.dropout > 0 ? 1.0f / (1.0f - c.dropout) : 1.0f, 1e-6) << c.name;
    for (Isa isa : available_isas()) {
      set_active_isa(isa);
      float p_amax = 0, ds_amax = 0;
      AttentionOptions fast = o;
      fast.fp8.p_amax = &p_amax;
      fast.fp8.ds_amax = &ds_amax;
      const Grads g = run_fast(q, k, v, dout, fast, true);
      const std::string what = std::string(c.name) + ", " + isa_name(isa);
      expect_grads_close(g, expected, 1e-4, what);
      EXPECT_NEAR(p_amax, ref_p_amax, 1e-6) << what;
      EXPECT_NEAR(ds_amax, ref_ds_amax, 1e-5 * ref_ds_amax) << what;
    }
    // And the rounding is there: FP8 attention differs from exact attention by FP8's error
    // (E4M3 P: 2^-4 relative; E5M2 dS: 2^-3), not by nothing and not by more. Measured 2-8%
    // (out, dv: sums of +-1 values that cancel, which magnifies P's rounding), 5.5% (dq).
    for (auto [name, fp8, plain, low, high] :
         {std::tuple{"out", &expected.out, &exact.out, 1e-3, 0.12},
          std::tuple{"dq", &expected.dq, &exact.dq, 1e-3, 0.15},
          std::tuple{"dv", &expected.dv, &exact.dv, 1e-3, 0.12}}) {
      const std::vector<float> a = fp8->to_floats(), e = plain->to_floats();
      double diff = 0, norm = 0;
      for (size_t n = 0; n < a.size(); ++n) {
        diff += (double{a[n]} - e[n]) * (double{a[n]} - e[n]);
        norm += double{e[n]} * e[n];
      }
      const double relative = std::sqrt(diff / norm);
      std::printf("[ measured ] %s %s: |fp8 - exact| / |exact| = %.4f\n", c.name, name, relative);
      EXPECT_GT(relative, low) << c.name << " " << name;
      EXPECT_LT(relative, high) << c.name << " " << name;
    }
  }
}

// Longer rows (several key tiles): the backward's P and dS are functions of the final lse, so
// fast and reference backward agree at any length given the same forward output; the forward
// differs only by which running maximum each tile's P was rounded against.
TEST(Attention, Fp8BackwardMatchesReferenceAtAnyLength) {
  const int64_t B = 1, T = 200, S = 200, H = 2, D = 32;
  Tensor q = e4m3_values({B, T, H, D}, 51);
  Tensor k = e4m3_values({B, S, H, D}, 52);
  Tensor v = e4m3_values({B, S, H, D}, 53);
  Tensor dout = random_tensor({B, T, H, D}, DType::F32, 54);
  AttentionOptions o;
  o.causal = true;
  o.fp8.p_scale = 448.0f;
  o.fp8.ds_scale = 4096.0f;
  IsaGuard guard;
  for (Isa isa : available_isas()) {
    set_active_isa(isa);
    Tensor out = Tensor::empty(q.shape(), DType::F32),
           lse = Tensor::empty({B, H, T, 2}, DType::F32);
    ops::flash_attention_forward(q, k, v, o, out, lse);
    Tensor ref_out = Tensor::empty(q.shape(), DType::F32);
    Tensor ref_lse = Tensor::empty({B, H, T, 2}, DType::F32);
    ops::reference::flash_attention_forward(q, k, v, o, ref_out, ref_lse);
    expect_close(out, ref_out, 0.02, std::string("forward, ") + isa_name(isa));
    Grads fast, ref;
    for (Grads* g : {&fast, &ref}) {
      g->dq = Tensor::empty(q.shape(), DType::F32);
      g->dk = Tensor::empty(k.shape(), DType::F32);
      g->dv = Tensor::empty(v.shape(), DType::F32);
    }
    ops::flash_attention_backward(q, k, v, out, lse, dout, o, fast.dq, fast.dk, fast.dv);
    ops::reference::flash_attention_backward(q, k, v, out, lse, dout, o, ref.dq, ref.dk, ref.dv);
    const std::string what = std::string("backward, ") + isa_name(isa);
    expect_close(fast.dq, ref.dq, 1e-4, what + " dq");
    expect_close(fast.dk, ref.dk, 1e-4, what + " dk");
    expect_close(fast.dv, ref.dv, 1e-4, what + " dv");
  }
}

TEST(Attention, Fp8BadOptionsThrow) {
  Tensor q = random_tensor({1, 4, 2, 8}, DType::F32, 1);
  Tensor out = Tensor::empty(q.shape(), DType::F32), lse = Tensor::empty({1, 2, 4}, DType::F32);
  AttentionOptions o;
  o.fp8.p_scale = -1.0f;
  EXPECT_THROW(ops::flash_attention_forward(q, q, q, o, out, lse), Error);
  o.fp8.p_scale = std::numeric_limits<float>::infinity();
  EXPECT_THROW(ops::flash_attention_forward(q, q, q, o, out, lse), Error);
  o.fp8.p_scale = 1.0f;
  o.fp8.p_format = DType::BF16;
  EXPECT_THROW(ops::flash_attention_forward(q, q, q, o, out, lse), Error);
}

}  // namespace
}  // namespace octet
