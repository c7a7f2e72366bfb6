// peer_watch.cpp — the process's PeerWatch pointer (see peer_watch.hpp).
#include "core/peer_watch.hpp"

#include <atomic>

namespace dmoe {

namespace {
std::atomic<PeerWatch*> g_watch{nullptr};
}

PeerWatch* peer_watch() { return g_watch.load(std::memory_order_acquire); }
void set_peer_watch(PeerWatch* watch) { g_watch.store(watch, std::memory_order_release); }

}  // namespace dmoe
