// Embedding: fast path against the reference bit for bit on every ISA path (the backward
// included: repeated ids add in token order whatever the thread count), both against PyTorch
// (F.embedding forward and backward with repeated ids), and bad ids.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "octet/cpu_features.h"
#include "octet/error.h"
#include "octet/ops/embedding.h"
#include "test_util.h"
#include "torch_reference.h"

namespace octet {
namespace {

using octet::testing::available_isas;
using octet::testing::run_torch;

struct IsaGuard {
  Isa saved = active_isa();
  ~IsaGuard() { set_active_isa(saved); }
};

Tensor random_tensor(Shape shape, DType dtype, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> values(static_cast<size_t>(shape_numel(shape)));
  for (float& v : values) v = normal(rng);
  Tensor t = Tensor::from_floats(std::move(shape), values);
  return dtype == DType::F32 ? t : t.to(dtype);
}

// Ids drawn from [0, distinct) < V, so ids repeat.
Tensor random_ids(Shape shape, int64_t distinct, DType dtype, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int64_t> pick(0, distinct - 1);
  Tensor ids = Tensor::empty(std::move(shape), dtype);
  for (int64_t i = 0; i < ids.numel(); ++i) {
    if (dtype == DType::I32) {
      ids.data<int32_t>()[i] = static_cast<int32_t>(pick(rng));
    } else {
      ids.data<int64_t>()[i] = pick(rng);
    }
  }
  return ids;
}

bool same_bytes(const Tensor& a, const Tensor& b) {
  return a.nbytes() == b.nbytes() && std::memcmp(a.raw(), b.raw(), a.nbytes()) == 0;
}

TEST(Embedding, FastMatchesReferenceBitForBitOnEveryIsa) {
  IsaGuard guard;
  // N = 4x9 with many repeats; N = 8x1024 x C = 37 is past the OpenMP threshold.
  for (Shape id_shape : {Shape{4, 9}, Shape{8, 1024}}) {
    for (DType id_dtype : {DType::I32, DType::I64}) {
      const int64_t vocab = 50;
      const int64_t channels = 37;
      const Tensor ids = random_ids(id_shape, 23, id_dtype, 1);
      Shape row_shape = id_shape;
      row_shape.push_back(channels);
      for (DType table_dtype : {DType::F32, DType::BF16}) {
        for (DType out_dtype : {DType::F32, DType::BF16}) {
          SCOPED_TRACE(::testing::Message()
                       << shape_str(id_shape) << " table " << dtype_name(table_dtype) << " out "
                       << dtype_name(out_dtype));
          const Tensor table = random_tensor({vocab, channels}, table_dtype, 2);
          Tensor ref_out = Tensor::empty(row_shape, out_dtype);
          ops::reference::embedding_forward(ids, table, ref_out);
          const Tensor dout = random_tensor(row_shape, out_dtype, 3);
          const Tensor start = random_tensor({vocab, channels}, DType::F32, 4);
          Tensor ref_dtable = start.clone();
          ops::reference::embedding_backward(ids, dout, ref_dtable);
          for (Isa isa : available_isas()) {
            set_active_isa(isa);
            SCOPED_TRACE(isa_name(active_isa()));
            Tensor out = Tensor::empty(row_shape, out_dtype);
            ops::embedding_forward(ids, table, out);
            EXPECT_TRUE(same_bytes(out, ref_out));
            Tensor dtable = start.clone();
            ops::embedding_backward(ids, dout, dtable);
            EXPECT_TRUE(same_bytes(dtable, ref_dtable));
          }
        }
      }
    }
  }
}

// PyTorch in FP64: the forward is a copy (exact); the backward sums a handful of F32 values
// per row in F32 here, so 1e-6 relative to the row sum's magnitude covers its rounding.
TEST(Embedding, MatchesTorchWithRepeatedIds) {
  const int64_t vocab = 100;
  const int64_t channels = 33;
  for (DType table_dtype : {DType::F32, DType::BF16}) {
    SCOPED_TRACE(dtype_name(table_dtype));
    const Tensor ids = random_ids({3, 17}, 12, DType::I64, 5);
    const Tensor table = random_tensor({vocab, channels}, table_dtype, 6);
    const Tensor dout = random_tensor({3, 17, channels}, DType::F32, 7);
    const TensorMap torch =
        run_torch("embedding", {{"ids", ids}, {"table", table}, {"dout", dout}});
    for (bool fast : {false, true}) {
      SCOPED_TRACE(fast ? "fast" : "reference");
      Tensor out = Tensor::empty({3, 17, channels}, DType::F32);
      Tensor dtable = Tensor::zeros({vocab, channels}, DType::F32);
      if (fast) {
        ops::embedding_forward(ids, table, out);
        ops::embedding_backward(ids, dout, dtable);
      } else {
        ops::reference::embedding_forward(ids, table, out);
        ops::reference::embedding_backward(ids, dout, dtable);
      }
      EXPECT_EQ(out.to_floats(), torch.at("out").to_floats());
      const std::vector<float> expected = torch.at("dtable").to_floats();
      const std::vector<float> actual = dtable.to_floats();
      ASSERT_EQ(actual.size(), expected.size());
      for (size_t i = 0; i < actual.size(); ++i) {
        EXPECT_NEAR(actual[i], expected[i], 1e-6 * (std::fabs(expected[i]) + 4)) << i;
      }
    }
  }
}

// Vocabulary parts (vocabulary parallelism): fast against reference bit for bit on every ISA
// path; the parts' forwards sum to the whole embedding and their backwards are the whole
// backward's rows, exactly (the whole embedding is held against PyTorch above); an id outside
// the whole vocabulary is an error naming it.
TEST(Embedding, VocabularyPartsSumToTheWholeOnEveryIsa) {
  IsaGuard guard;
  const int64_t vocab = 37, channels = 11;
  const Tensor ids = random_ids({6, 50}, vocab, DType::I32, 21);
  const Tensor table = random_tensor({vocab, channels}, DType::F32, 22);
  const Tensor dout = random_tensor({6, 50, channels}, DType::F32, 23);
  Tensor whole = Tensor::empty({6, 50, channels}, DType::F32);
  Tensor whole_grad = Tensor::zeros({vocab, channels}, DType::F32);
  ops::embedding_forward(ids, table, whole);
  ops::embedding_backward(ids, dout, whole_grad);
  for (Isa isa : available_isas()) {
    set_active_isa(isa);
    SCOPED_TRACE(isa_name(active_isa()));
    std::vector<float> sum(static_cast<size_t>(whole.numel()), 0.0f);
    for (auto [first, end] : {std::pair<int64_t, int64_t>{0, 13}, {13, 26}, {26, 37}}) {
      const Tensor part = table.slice_rows(first, end).clone();
      Tensor out = Tensor::empty(whole.shape(), DType::F32), ref_out = out.clone();
      ops::embedding_part_forward(ids, part, first, vocab, out);
      ops::reference::embedding_part_forward(ids, part, first, vocab, ref_out);
      EXPECT_TRUE(same_bytes(out, ref_out));
      const std::vector<float> values = out.to_floats();
      for (size_t i = 0; i < sum.size(); ++i) sum[i] += values[i];
      Tensor grad = Tensor::zeros({end - first, channels}, DType::F32), ref_grad = grad.clone();
      ops::embedding_part_backward(ids, dout, first, vocab, grad);
      ops::reference::embedding_part_backward(ids, dout, first, vocab, ref_grad);
      EXPECT_TRUE(same_bytes(grad, ref_grad));
      EXPECT_TRUE(same_bytes(grad, whole_grad.slice_rows(first, end)));
    }
    EXPECT_EQ(sum, whole.to_floats());
  }
  Tensor bad = ids.clone();
  bad.data<int32_t>()[7] = static_cast<int32_t>(vocab);
  Tensor out = Tensor::empty(whole.shape(), DType::F32);
  try {
    ops::embedding_part_forward(bad, table.slice_rows(0, 13).clone(), 0, vocab, out);
    ADD_FAILURE() << "an id past the vocabulary was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("id 37 at position 7"), std::string::npos) << e.what();
  }
}

// Position embeddings on whole batches and on sequence-parallel shards (rows starting past 0,
// not a multiple of T), with a KV-cache offset: fast against reference bit for bit on every
// ISA path (the backward adds each position's rows in row order), BF16 gradients included.
TEST(PositionEmbedding, FastMatchesReferenceOnShardsAndOffsets) {
  IsaGuard guard;
  struct Case {
    int64_t rows, seq_len, first_row, offset;
  };
  const int64_t channels = 19, positions = 40;
  for (Case c :
       {Case{4 * 9, 9, 0, 0}, Case{7, 9, 11, 0}, Case{6, 5, 0, 30}, Case{2048, 32, 64, 0}}) {
    SCOPED_TRACE(::testing::Message() << "rows " << c.rows << " T " << c.seq_len << " first "
                                      << c.first_row << " offset " << c.offset);
    const Tensor table = random_tensor({positions, channels}, DType::F32, 8);
    const Tensor x = random_tensor({c.rows, channels}, DType::F32, 9);
    Tensor ref_out = x.clone();
    ops::reference::position_embedding_forward(ref_out, table, c.seq_len, c.first_row, c.offset);
    for (DType dx_dtype : {DType::F32, DType::BF16}) {
      const Tensor dx = random_tensor({c.rows, channels}, dx_dtype, 10);
      const Tensor start = random_tensor({positions, channels}, DType::F32, 11);
      Tensor ref_dtable = start.clone();
      ops::reference::position_embedding_backward(dx, c.seq_len, ref_dtable, c.first_row, c.offset);
      for (Isa isa : available_isas()) {
        set_active_isa(isa);
        SCOPED_TRACE(isa_name(active_isa()));
        Tensor out = x.clone();
        ops::position_embedding_forward(out, table, c.seq_len, c.first_row, c.offset);
        EXPECT_TRUE(same_bytes(out, ref_out));
        Tensor dtable = start.clone();
        ops::position_embedding_backward(dx, c.seq_len, dtable, c.first_row, c.offset);
        EXPECT_TRUE(same_bytes(dtable, ref_dtable)) << dtype_name(dx_dtype);
      }
    }
  }
}

// PyTorch in FP64 (x + table[positions], autograd for the table): the forward is one F32 add
// (within an F32 rounding), the backward sums rows/T F32 values per position.
TEST(PositionEmbedding, MatchesTorchOnAShard) {
  const int64_t rows = 13, seq_len = 6, first_row = 5, offset = 2, channels = 7;
  const Tensor x = random_tensor({rows, channels}, DType::F32, 12);
  const Tensor table = random_tensor({seq_len + offset, channels}, DType::F32, 13);
  const Tensor dout = random_tensor({rows, channels}, DType::F32, 14);
  Tensor sizes = Tensor::empty({3}, DType::I64);
  sizes.data<int64_t>()[0] = seq_len;
  sizes.data<int64_t>()[1] = first_row;
  sizes.data<int64_t>()[2] = offset;
  const TensorMap torch = run_torch("position_embedding",
                                    {{"x", x}, {"table", table}, {"dout", dout}, {"sizes", sizes}});
  for (bool fast : {false, true}) {
    SCOPED_TRACE(fast ? "fast" : "reference");
    Tensor out = x.clone();
    Tensor dtable = Tensor::zeros({seq_len + offset, channels}, DType::F32);
    if (fast) {
      ops::position_embedding_forward(out, table, seq_len, first_row, offset);
      ops::position_embedding_backward(dout, seq_len, dtable, first_row, offset);
    } else {
      ops::reference::position_embedding_forward(out, table, seq_len, first_row, offset);
      ops::reference::position_embedding_backward(dout, seq_len, dtable, first_row, offset);
    }
    const std::vector<float> out_expected = torch.at("out").to_floats(),
                             out_actual = out.to_floats();
    for (size_t i = 0; i < out_actual.size(); ++i) {
      EXPECT_NEAR(out_actual[i], out_expected[i], 1e-6 * (std::fabs(out_expected[i]) + 1)) << i;
    }
    const std::vector<float> grad_expected = torch.at("dtable").to_floats(),
                             grad_actual = dtable.to_floats();
    ASSERT_EQ(grad_actual.size(), grad_expected.size());
    for (size_t i = 0; i < grad_actual.size(); ++i) {
      EXPECT_NEAR(grad_actual[i], grad_expected[i], 1e-6 * (std::fabs(grad_expected[i]) + 4)) << i;
    }
  }
}

std::string error_of(const std::function<void()>& call) {
  try {
    call();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

TEST(Embedding, BadInputsGetClearErrors) {
  const Tensor table = random_tensor({50, 8}, DType::F32, 8);
  Tensor ids = random_ids({2, 3}, 50, DType::I32, 9);
  ids.data<int32_t>()[4] = 50;
  Tensor negative = random_ids({2, 3}, 50, DType::I64, 10);
  negative.data<int64_t>()[0] = -1;
  Tensor out = Tensor::empty({2, 3, 8}, DType::F32);
  Tensor dtable = Tensor::zeros({50, 8}, DType::F32);
  for (bool fast : {false, true}) {
    auto forward = fast ? ops::embedding_forward : ops::reference::embedding_forward;
    auto backward = fast ? ops::embedding_backward : ops::reference::embedding_backward;
    std::string message = error_of([&] { forward(ids, table, out); });
    EXPECT_NE(message.find("id 50 at position 4 is out of range [0,V) with V=50"),
              std::string::npos)
        << message;
    message = error_of([&] { backward(negative, out, dtable); });
    EXPECT_NE(message.find("id -1 at position 0"), std::string::npos) << message;
    EXPECT_EQ(dtable.to_floats(), std::vector<float>(50 * 8, 0.0f));

    const Tensor good = random_ids({2, 3}, 50, DType::I64, 11);
    Tensor wrong_out = Tensor::empty({6, 8}, DType::F32);
    message = error_of([&] { forward(good, table, wrong_out); });
    EXPECT_NE(message.find("out expected [2,3,8], got [6,8]"), std::string::npos) << message;
    Tensor bf16_dtable = Tensor::zeros({50, 8}, DType::BF16);
    message = error_of([&] { backward(good, out, bf16_dtable); });
    EXPECT_NE(message.find("dtable"), std::string::npos) << message;
    const Tensor float_ids = Tensor::zeros({2, 3}, DType::F32);
    message = error_of([&] { forward(float_ids, table, out); });
    EXPECT_NE(message.find("ids"), std::string::npos) << message;
  }
}

}  // namespace
}  // namespace octet
