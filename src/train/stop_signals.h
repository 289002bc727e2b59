// Megatron's --exit-signal-handler for a training run: while a StopSignals lives, the first
// SIGTERM or SIGINT only records itself (the loop finishes its step, saves and stops); a
// second one of either restores the default action and re-raises it, ending the process.
#pragma once

namespace octet::train_detail {

class StopSignals {
 public:
  StopSignals();   // installs the handlers (the previous ones are kept)
  ~StopSignals();  // restores them
  StopSignals(const StopSignals&) = delete;
  StopSignals& operator=(const StopSignals&) = delete;
  // The first signal received (SIGTERM or SIGINT) since construction, or 0.
  int received() const;
};

}  // namespace octet::train_detail
