// Appends compute actions to a schedule together with the receives and sends they need, so a
// generator states only the order of computation on each rank.
#pragma once

#include "octet/pipeline.h"

namespace octet::pipeline {

class ScheduleBuilder {
 public:
  explicit ScheduleBuilder(Schedule& schedule) : schedule_(schedule) {}

  // Receive the input (when the previous stage is on another rank), compute, send the output.
  void forward(int rank, int micro_batch, int chunk);
  // Receive the output gradient, compute the full backward, send the input gradient.
  void backward(int rank, int micro_batch, int chunk);
  // As backward, but computes only the input gradient; the weight gradient comes later.
  void backward_input(int rank, int micro_batch, int chunk);
  void backward_weight(int rank, int micro_batch, int chunk);
  // DualPipe's overlapped pair: forward of one micro-batch with the backward of another.
  void forward_backward(int rank, int forward_micro_batch, int forward_chunk,
                        int backward_micro_batch, int backward_chunk);

 private:
  void recv_forward(int rank, int micro_batch, int chunk);
  void send_forward(int rank, int micro_batch, int chunk);
  void recv_backward(int rank, int micro_batch, int chunk);
  void send_backward(int rank, int micro_batch, int chunk);
  void push(int rank, const Action& action) { schedule_.actions[rank].push_back(action); }

  Schedule& schedule_;
};

// Route helpers: stage s of the single route is on rank s (chunk 0), and so on.
std::vector<Place> straight_route(int ranks, int chunk);              // 0 → ranks-1
std::vector<Place> reverse_route(int ranks, int chunk);               // ranks-1 → 0
std::vector<Place> interleaved_route(int ranks, int virtual_stages);  // rank s % P, chunk s / P
std::vector<Place> v_route(int ranks);  // down on chunk 0, back up on chunk 1

// A schedule with every micro-batch on route 0 and empty action lists.
Schedule empty_schedule(ScheduleKind kind, int ranks, int micro_batches, int chunks_per_rank,
                        std::vector<Place> route);

}  // namespace octet::pipeline
