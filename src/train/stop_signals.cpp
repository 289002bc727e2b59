// Signal handlers for a graceful stop: async-signal-safe (a sig_atomic_t and, for the second
// signal, signal() and raise()).
#include "train/stop_signals.h"

#include <csignal>

namespace octet::train_detail {

namespace {

volatile std::sig_atomic_t g_received = 0;
struct sigaction g_previous_term {
}, g_previous_int{};

extern "C" void on_stop_signal(int signal) {
  if (g_received != 0) {
    // The second one: no more grace.
    std::signal(signal, SIG_DFL);
    std::raise(signal);
    return;
  }
  g_received = signal;
}

}  // namespace

StopSignals::StopSignals() {
  g_received = 0;
  struct sigaction action {};
  action.sa_handler = on_stop_signal;
  sigemptyset(&action.sa_mask);
  action.sa_flags = SA_RESTART;  // blocking calls continue; the loop looks at the flag
  sigaction(SIGTERM, &action, &g_previous_term);
  sigaction(SIGINT, &action, &g_previous_int);
}

StopSignals::~StopSignals() {
  sigaction(SIGTERM, &g_previous_term, nullptr);
  sigaction(SIGINT, &g_previous_int, nullptr);
}

int StopSignals::received() const {
  return g_received;
}

}  // namespace octet::train_detail
