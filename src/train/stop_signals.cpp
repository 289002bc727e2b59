// The stop signals' thread and the fallback handler (async-signal-safe: a sig_atomic_t and,
// for the second signal, signal() and raise()).
#include "train/stop_signals.h"

#include <csignal>
#include <ctime>

namespace octet::train_detail {

namespace {

volatile std::sig_atomic_t g_received = 0;
struct sigaction g_previous_term {
}, g_previous_int{};

sigset_t stop_set() {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGTERM);
  sigaddset(&set, SIGINT);
  return set;
}

// The first signal is recorded; the second ends the process with the default action.
void take(int signal) {
  if (g_received == 0) {
    g_received = signal;
    return;
  }
  std::signal(signal, SIG_DFL);
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, signal);
  pthread_sigmask(SIG_UNBLOCK, &set, nullptr);
  std::raise(signal);
}

extern "C" void on_stop_signal(int signal) {
  take(signal);
}

// Runs `how` (SIG_BLOCK / SIG_UNBLOCK) of the stop signals on every OpenMP worker thread.
void mask_openmp_workers(int how) {
  const sigset_t set = stop_set();
#pragma omp parallel
  pthread_sigmask(how, &set, nullptr);
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
  const sigset_t set = stop_set();
  pthread_sigmask(SIG_BLOCK, &set, &previous_mask_);
  mask_openmp_workers(SIG_BLOCK);
  // Started with the signals blocked (inherited): it takes them with sigtimedwait.
  waiter_ = std::thread([this, set] {
    const timespec poll{0, 50'000'000};  // looks at stop_ every 50 ms
    while (!stop_.load()) {
      const int signal = sigtimedwait(&set, nullptr, &poll);
      if (signal > 0) take(signal);
    }
  });
}

StopSignals::~StopSignals() {
  stop_ = true;
  waiter_.join();
  mask_openmp_workers(SIG_UNBLOCK);
  pthread_sigmask(SIG_SETMASK, &previous_mask_, nullptr);
  sigaction(SIGTERM, &g_previous_term, nullptr);
  sigaction(SIGINT, &g_previous_int, nullptr);
}

int StopSignals::received() const {
  return g_received;
}

}  // namespace octet::train_detail
