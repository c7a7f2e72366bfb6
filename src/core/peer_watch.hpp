// peer_watch.hpp — what this process knows about its peer ranks while it waits for them.
//
// Ranks that run as processes cannot see each other's state: a rank waiting on a collective only sees its
// stream not finishing. A PeerWatch (comm/stage_board.hpp implements one, shared memory between the ranks
// of a node) tells the host-side waits (cuda::wait_stream, the NCCL waits) whether a peer has already
// failed — so they stop at once, naming it, instead of running into their time limit — and, when a wait
// does time out, where every peer is (which rank hangs, in which stage). One per process; none in
// single-rank runs and for ranks as threads (ThreadComm has its own).
#pragma once

#include <string>

namespace dmoe {

class PeerWatch {
 public:
  virtual ~PeerWatch() = default;
  // Non-empty: a peer has failed or gone (its reason in words); waiting for it is pointless.
  virtual std::string failed_peer() = 0;
  // Where the peers are, for the message of a wait that timed out ("" when nothing is known).
  virtual std::string describe_peers() = 0;
  // This rank sits in a host-side wait (true) or has left it (false).
  virtual void set_waiting(bool waiting) = 0;
  // This rank stops waiting on its peers for good (its wait timed out): peers hung in an injected fault
  // see it through Comm::abandoned().
  virtual void give_up() = 0;
};

// The process's watch (null when none): set by the communicator that opens one, cleared by it.
PeerWatch* peer_watch();
void set_peer_watch(PeerWatch* watch);

}  // namespace dmoe
