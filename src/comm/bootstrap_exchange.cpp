// bootstrap_exchange.cpp — the process's registered bootstrap exchange (see the header).
#include "comm/bootstrap_exchange.hpp"

#include <mutex>
#include <utility>

namespace dmoe {

namespace {
std::mutex g_exchange_mutex;
BootstrapExchange g_exchange;
}  // namespace

void set_bootstrap_exchange(BootstrapExchange exchange) {
  std::lock_guard<std::mutex> lock(g_exchange_mutex);
  g_exchange = std::move(exchange);
}

BootstrapExchange bootstrap_exchange() {
  std::lock_guard<std::mutex> lock(g_exchange_mutex);
  return g_exchange;
}

}  // namespace dmoe
