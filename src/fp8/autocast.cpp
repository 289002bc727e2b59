// fp8_autocast: a thread-local stack of (enabled, recipe) scopes; the innermost decides.
// A deque, so the reference fp8_recipe() returns survives inner scopes being pushed.
#include <deque>
#include <utility>

#include "octet/recipe.h"

namespace octet {
namespace {

struct AutocastScope {
  bool enabled;
  recipe::Recipe fp8_recipe;
};

std::deque<AutocastScope>& scope_stack() {
  thread_local std::deque<AutocastScope> stack;
  return stack;
}

}  // namespace

fp8_autocast::fp8_autocast(bool enabled, recipe::Recipe fp8_recipe) {
  scope_stack().push_back({enabled, std::move(fp8_recipe)});
}

fp8_autocast::~fp8_autocast() {
  auto& stack = scope_stack();
  if (!stack.empty()) stack.pop_back();
}

bool fp8_enabled() {
  const auto& stack = scope_stack();
  return !stack.empty() && stack.back().enabled;
}

const recipe::Recipe& fp8_recipe() {
  static const recipe::Recipe kDefault = recipe::DelayedScaling{};
  const auto& stack = scope_stack();
  return stack.empty() ? kDefault : stack.back().fp8_recipe;
}

int fp8_autocast_depth() {
  return static_cast<int>(scope_stack().size());
}

}  // namespace octet
