// Every collective of the MPI communicator against the same result computed locally, at
// the world sizes CMake runs this under (1-4 ranks). Values are small integers and halves,
// so sums are exact in any reduction order and in BF16.
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <thread>

#include "octet/comm.h"
#include "octet/error.h"

namespace octet {
namespace {

// The value rank r holds at index i.
float value_at(int r, int64_t i) {
  return static_cast<float>((r * 7 + i * 3) % 64) * 0.5f - 8.0f;
}

Tensor rank_tensor(int r, Shape shape, DType dtype, int64_t offset = 0) {
  Tensor t = Tensor::empty(shape, DType::F32);
  for (int64_t i = 0; i < t.numel(); ++i) t.data<float>()[i] = value_at(r, i + offset);
  if (dtype == DType::F32 || dtype == DType::BF16) return t.to(dtype);
  Tensor out = Tensor::empty(shape, dtype);
  for (int64_t i = 0; i < t.numel(); ++i) {
    const int64_t v = static_cast<int64_t>(2 * t.data<float>()[i]);
    if (dtype == DType::I32) out.data<int32_t>()[i] = static_cast<int32_t>(v);
    if (dtype == DType::I64) out.data<int64_t>()[i] = v * 1000000007LL;
    if (dtype == DType::U8 || dtype == DType::E4M3) {
      out.view_as(DType::U8).data<uint8_t>()[i] = static_cast<uint8_t>(v & 0xff);
    }
  }
  return out;
}

std::vector<double> values(const Tensor& t) {
  std::vector<double> out(static_cast<size_t>(t.numel()));
  const bool floating = t.dtype() == DType::F32 || t.dtype() == DType::BF16;
  const std::vector<float> floats = floating ? t.to_floats() : std::vector<float>();
  for (int64_t i = 0; i < t.numel(); ++i) {
    switch (t.dtype()) {
      case DType::I32:
        out[i] = t.data<int32_t>()[i];
        break;
      case DType::I64:
        out[i] = static_cast<double>(t.data<int64_t>()[i]);
        break;
      case DType::U8:
      case DType::E4M3:
        out[i] = t.view_as(DType::U8).data<uint8_t>()[i];
        break;
      default:
        out[i] = floats[i];
    }
  }
  return out;
}

class Collectives : public ::testing::Test {
 protected:
  void SetUp() override {
    world = world_communicator();
    n = world->size();
    r = world->rank();
  }
  std::shared_ptr<Communicator> world;
  int n = 1, r = 0;
};

const std::vector<int64_t> kSizes = {1, 7, 1000, 65537};

TEST_F(Collectives, WorldMatchesTheLauncher) {
  EXPECT_EQ(n, launcher_world_size());
  EXPECT_GE(r, 0);
  EXPECT_LT(r, n);
}

TEST_F(Collectives, AllReduceEveryOpDtypeAndSize) {
  for (DType dtype : {DType::F32, DType::BF16, DType::I32, DType::I64}) {
    for (ReduceOp op : {ReduceOp::Sum, ReduceOp::Max, ReduceOp::Min}) {
      for (int64_t size : kSizes) {
        Tensor t = rank_tensor(r, {size}, dtype);
        std::vector<double> expected = values(rank_tensor(0, {size}, dtype));
        for (int q = 1; q < n; ++q) {
          std::vector<double> other = values(rank_tensor(q, {size}, dtype));
          for (size_t i = 0; i < expected.size(); ++i) {
            expected[i] = op == ReduceOp::Sum   ? expected[i] + other[i]
                          : op == ReduceOp::Max ? std::max(expected[i], other[i])
                                                : std::min(expected[i], other[i]);
          }
        }
        world->all_reduce(t, op);
        EXPECT_EQ(values(t), expected)
            << dtype_name(dtype) << " " << reduce_op_name(op) << " " << size;
      }
    }
  }
}

TEST_F(Collectives, MaxPropagatesNaN) {
  Tensor t = Tensor::from_floats({3}, {1.0f, 2.0f, r == n - 1 ? NAN : 0.0f});
  world->all_reduce(t, ReduceOp::Max);
  EXPECT_EQ(t.data<float>()[0], 1.0f);
  EXPECT_TRUE(std::isnan(t.data<float>()[2]));
}

TEST_F(Collectives, AllGatherStacksRanksInOrder) {
  for (DType dtype : {DType::F32, DType::BF16, DType::I64, DType::E4M3}) {
    for (int64_t rows : {1, 5, 300}) {
      Tensor part = rank_tensor(r, {rows, 3}, dtype);
      Tensor whole = world->all_gather(part);
      ASSERT_EQ(whole.shape(), (Shape{rows * n, 3}));
      std::vector<double> expected;
      for (int q = 0; q < n; ++q) {
        std::vector<double> v = values(rank_tensor(q, {rows, 3}, dtype));
        expected.insert(expected.end(), v.begin(), v.end());
      }
      EXPECT_EQ(values(whole), expected) << dtype_name(dtype) << " rows " << rows;
    }
  }
}

TEST_F(Collectives, ReduceScatterGivesEachRankItsBlockSum) {
  for (DType dtype : {DType::F32, DType::BF16, DType::I32}) {
    for (int64_t rows : {1, 4, 257}) {
      Tensor input = rank_tensor(r, {rows * n, 2}, dtype);
      Tensor block = world->reduce_scatter(input);
      ASSERT_EQ(block.shape(), (Shape{rows, 2}));
      std::vector<double> expected(static_cast<size_t>(rows * 2), 0.0);
      for (int q = 0; q < n; ++q) {
        std::vector<double> v = values(rank_tensor(q, {rows * n, 2}, dtype));
        for (size_t i = 0; i < expected.size(); ++i) expected[i] += v[r * rows * 2 + i];
      }
      EXPECT_EQ(values(block), expected) << dtype_name(dtype) << " rows " << rows;
    }
  }
}

TEST_F(Collectives, AllToAllExchangesBlocks) {
  const int64_t rows = 3;
  Tensor input = rank_tensor(r, {rows * n, 4}, DType::F32);
  Tensor output = world->all_to_all(input);
  for (int q = 0; q < n; ++q) {
    // Block q of the output is block r of rank q's input.
    std::vector<double> sent = values(rank_tensor(q, {rows * n, 4}, DType::F32));
    std::vector<double> got = values(output);
    for (int64_t i = 0; i < rows * 4; ++i) {
      EXPECT_EQ(got[q * rows * 4 + i], sent[r * rows * 4 + i]);
    }
  }
}

TEST_F(Collectives, AllToAllvMovesUnevenRows) {
  // Rank a sends (a + b) % 3 rows to rank b, taken in order from its input.
  auto rows_between = [](int a, int b) { return static_cast<int64_t>((a + b) % 3); };
  std::vector<int64_t> send(n), receive(n);
  int64_t send_total = 0, receive_total = 0;
  for (int q = 0; q < n; ++q) {
    send[q] = rows_between(r, q);
    receive[q] = rows_between(q, r);
    send_total += send[q];
    receive_total += receive[q];
  }
  Tensor input = rank_tensor(r, {send_total, 2}, DType::BF16);
  Tensor output = Tensor::zeros({receive_total, 2}, DType::BF16);
  world->iall_to_allv(input, send, output, receive).wait();
  std::vector<double> got = values(output);
  size_t at = 0;
  for (int q = 0; q < n; ++q) {
    int64_t first = 0;  // the first row rank q sent to r
    for (int b = 0; b < r; ++b) first += rows_between(q, b);
    int64_t q_total = 0;
    for (int b = 0; b < n; ++b) q_total += rows_between(q, b);
    std::vector<double> sent = values(rank_tensor(q, {q_total, 2}, DType::BF16));
    for (int64_t i = 0; i < receive[q] * 2; ++i) EXPECT_EQ(got[at++], sent[first * 2 + i]);
  }
}

TEST_F(Collectives, BroadcastFromEveryRoot) {
  for (int root = 0; root < n; ++root) {
    Tensor t = rank_tensor(r, {33}, DType::I32);
    world->broadcast(t, root);
    EXPECT_EQ(values(t), values(rank_tensor(root, {33}, DType::I32)));
  }
}

TEST_F(Collectives, SendReceiveAroundARing) {
  if (n == 1) GTEST_SKIP() << "no peer";
  const int next = (r + 1) % n, prev = (r + n - 1) % n;
  Tensor out = rank_tensor(r, {1000}, DType::F32), in = Tensor::empty({1000}, DType::F32);
  Work receive = world->irecv(in, prev, 5);
  Work send = world->isend(out, next, 5);
  send.wait(60);
  receive.wait(60);
  EXPECT_EQ(values(in), values(rank_tensor(prev, {1000}, DType::F32)));
}

TEST_F(Collectives, NonBlockingOperationsOverlapAndCompleteInAnyWaitOrder) {
  std::vector<Tensor> tensors;
  std::vector<Work> works;
  for (int k = 0; k < 6; ++k) tensors.push_back(rank_tensor(r, {20000}, DType::F32, k));
  for (Tensor& t : tensors) works.push_back(world->iall_reduce(t, ReduceOp::Sum));
  for (size_t k = works.size(); k-- > 0;) works[k].wait();
  for (int k = 0; k < 6; ++k) {
    std::vector<double> expected(20000, 0.0);
    for (int q = 0; q < n; ++q) {
      std::vector<double> v = values(rank_tensor(q, {20000}, DType::F32, k));
      for (size_t i = 0; i < v.size(); ++i) expected[i] += v[i];
    }
    EXPECT_EQ(values(tensors[k]), expected);
  }
  if (n > 1) {
    EXPECT_GE(works[0].transfer_seconds(), 0.0);
    EXPECT_TRUE(works[0].done());
  }
}

TEST_F(Collectives, DifferentCollectivesInFlightTogetherMatchAcrossRanks) {
  // As in data parallelism: a large all-reduce, gathers and a reduce-scatter started back to
  // back, all in flight together, waited for in another order. Every rank must issue them
  // in the same order (MPI's rule), whatever completes first where.
  Tensor big = rank_tensor(r, {1 << 20}, DType::F32);
  Tensor part = rank_tensor(r, {300, 4}, DType::F32);
  Tensor gathered = Tensor::empty({300 * n, 4}, DType::F32);
  Tensor scatter_in = rank_tensor(r, {n * 70000}, DType::F32);
  Tensor scatter_out = Tensor::empty({70000}, DType::F32);
  Tensor small = rank_tensor(r, {17}, DType::F32);
  std::vector<Work> works;
  works.push_back(world->iall_reduce(big, ReduceOp::Sum));
  works.push_back(world->iall_gather(part, gathered));
  works.push_back(world->ireduce_scatter(scatter_in, scatter_out, ReduceOp::Sum));
  works.push_back(world->iall_reduce(small, ReduceOp::Max));
  for (size_t k = works.size(); k-- > 0;) works[k].wait(120);
  auto sum_over_ranks = [&](Shape shape) {
    std::vector<double> total(static_cast<size_t>(Tensor::empty(shape, DType::F32).numel()), 0.0);
    for (int q = 0; q < n; ++q) {
      std::vector<double> v = values(rank_tensor(q, shape, DType::F32));
      for (size_t i = 0; i < v.size(); ++i) total[i] += v[i];
    }
    return total;
  };
  EXPECT_EQ(values(big), sum_over_ranks({1 << 20}));
  std::vector<double> scattered = sum_over_ranks({n * 70000});
  EXPECT_EQ(values(scatter_out), std::vector<double>(scattered.begin() + r * 70000,
                                                     scattered.begin() + (r + 1) * 70000));
  // The gather stacks every rank's block in rank order.
  std::vector<double> stacked;
  for (int q = 0; q < n; ++q) {
    std::vector<double> v = values(rank_tensor(q, {300, 4}, DType::F32));
    stacked.insert(stacked.end(), v.begin(), v.end());
  }
  EXPECT_EQ(values(gathered), stacked);
  std::vector<double> largest = values(rank_tensor(0, {17}, DType::F32));
  for (int q = 1; q < n; ++q) {
    std::vector<double> v = values(rank_tensor(q, {17}, DType::F32));
    for (size_t i = 0; i < v.size(); ++i) largest[i] = std::max(largest[i], v[i]);
  }
  EXPECT_EQ(values(small), largest);
}

TEST_F(Collectives, AWorldOfOneCopiesNothing) {
  std::shared_ptr<Communicator> self = self_communicator();
  Tensor t = rank_tensor(0, {4, 2}, DType::F32);
  EXPECT_EQ(self->all_gather(t).raw(), t.raw());
  EXPECT_EQ(self->reduce_scatter(t).raw(), t.raw());
  EXPECT_THROW(self->send(t, 0, 0), Error);
  if (n == 1) {
    EXPECT_EQ(world->all_gather(t).raw(), t.raw());
  }
}

TEST_F(Collectives, BadArgumentsAreClearErrors) {
  Tensor codes = Tensor::zeros({4}, DType::E4M3);
  try {
    world->all_reduce(codes, ReduceOp::Sum);
    FAIL() << "FP8 reduction accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("expected f32, bf16, i32 or i64, got e4m3"),
              std::string::npos)
        << e.what();
  }
  if (n > 1) {
    Tensor wrong = Tensor::zeros({5, 2}, DType::F32), part = Tensor::zeros({2, 2}, DType::F32);
    EXPECT_THROW(world->iall_gather(part, wrong), Error);
    EXPECT_THROW(world->send(part, r, 0), Error);  // to itself
  }
}

TEST_F(Collectives, MismatchedAndMissingMessagesAreReportedNotHung) {
  if (n == 1) GTEST_SKIP() << "no peer";
  if (r == 0) {
    Tensor small = Tensor::zeros({3}, DType::F32);
    world->send(small, 1, 7);  // rank 1 expects 8 elements
    world->barrier();
    Tensor late = Tensor::zeros({2}, DType::F32);
    world->send(late, 1, 8);
  } else if (r == 1) {
    Tensor big = Tensor::zeros({8}, DType::F32);
    try {
      world->recv(big, 0, 7);
      FAIL() << "a 3-element message filled an 8-element receive silently";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("mismatched message: expected 8 elements, the "
                                           "sender sent 3"),
                std::string::npos)
          << e.what();
    }
    // Rank 0 sends tag 8 only after the barrier: waiting before it must time out.
    Tensor late = Tensor::zeros({2}, DType::F32);
    Work pending = world->irecv(late, 0, 8);
    try {
      pending.wait(0.2);
      FAIL() << "a receive completed without a sender";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("still pending after 0.2 s"), std::string::npos)
          << e.what();
      EXPECT_NE(std::string(e.what()).find("receive from rank 0 tag 8"), std::string::npos)
          << e.what();
      // Rank 0 is alive (in the barrier): its MPI thread answers the roll call.
      EXPECT_NE(std::string(e.what()).find("every peer answered a roll call (rank 0 (pid "),
                std::string::npos)
          << e.what();
    }
    world->barrier();
    pending.wait(60);
  } else {
    world->barrier();
  }
}

// A rank that reaches a collective late: the others' waits time out naming the collective and
// saying every peer is alive (the roll call, answered by each MPI thread while its caller is
// busy); the operation itself is intact and completes once the late rank comes.
TEST_F(Collectives, AWaitThatTimesOutNamesTheCollectiveAndTheRollCall) {
  Tensor values = Tensor::from_floats({4}, {1, 1, 1, 1});
  if (r == n - 1) std::this_thread::sleep_for(std::chrono::milliseconds(1500));
  Work work = world->iall_reduce(values, ReduceOp::Sum);
  if (r != n - 1 && n > 1) {
    try {
      work.wait(0.3);
      FAIL() << "an all-reduce completed before its last rank joined";
    } catch (const Error& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find("world: all_reduce (f32 [4]): still pending after 0.3 s"),
                std::string::npos)
          << what;
      EXPECT_NE(what.find("every peer answered a roll call"), std::string::npos) << what;
      EXPECT_NE(what.find(detail::concat("rank ", n - 1, " (pid ")), std::string::npos) << what;
    }
  }
  work.wait();
  EXPECT_EQ(values.to_floats(), std::vector<float>(4, static_cast<float>(n)));
}

TEST_F(Collectives, TheCommunicationTimeoutIsCheckedAndSettable) {
  const double before = communication_timeout();
  EXPECT_GT(before, 0);
  EXPECT_THROW(set_communication_timeout(-1), Error);
  EXPECT_THROW(set_communication_timeout(std::nan("")), Error);
  set_communication_timeout(0);  // forever
  EXPECT_EQ(communication_timeout(), 0);
  set_communication_timeout(before);
  EXPECT_EQ(communication_timeout(), before);
}

TEST_F(Collectives, ParallelStateGroupsFollowMegatronsOrder) {
  for (int tp : {1, 2}) {
    for (int pp : {1, 2}) {
      if (n % (tp * pp) != 0) continue;
      ParallelState state(world, tp, pp);
      const int dp = n / (tp * pp);
      EXPECT_EQ(state.data_size(), dp);
      EXPECT_EQ(state.tensor().size(), tp);
      EXPECT_EQ(state.data().size(), dp);
      EXPECT_EQ(state.pipeline().size(), pp);
      EXPECT_EQ(state.tensor_and_data().size(), tp * dp);
      EXPECT_EQ(state.model().size(), tp * pp);
      EXPECT_EQ(r,
                state.world_rank_of(state.tensor_rank(), state.data_rank(), state.pipeline_rank()));
      EXPECT_EQ(state.tensor_rank(), r % tp);
      EXPECT_EQ(state.pipeline().rank(), state.pipeline_rank());
      // A tensor-group sum adds exactly the consecutive ranks of this group.
      Tensor t = Tensor::from_floats({1}, {static_cast<float>(r)});
      state.tensor().all_reduce(t);
      const int first = r - r % tp;
      EXPECT_EQ(t.data<float>()[0], static_cast<float>(tp * first + tp * (tp - 1) / 2));
    }
  }
}

TEST_F(Collectives, ParallelStateRejectsSizesThatDoNotDivideTheWorld) {
  try {
    ParallelState state(world, n + 1, 1);
    FAIL() << "accepted TP larger than the world";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("expected a multiple of tensor-model-parallel-size"),
              std::string::npos)
        << e.what();
  }
  EXPECT_THROW(ParallelState(world, 0, 1), Error);
}

}  // namespace
}  // namespace octet
