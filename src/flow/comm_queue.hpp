// comm_queue.hpp — Flow's priority rule for communication, as one small state machine shared by the simulator
// and (later) the executors.
//
//   - all-to-all has strict priority: when the next all-to-all of the static order is ready it is issued;
//   - an AR chunk is issued only when no all-to-all is ready or running, and no other chunk is running;
//   - non-preemptive: a running chunk is never interrupted.
//
// Which operation goes next on each communicator never depends on timing: the all-to-alls go in the graph's
// alltoall_order on communicator A, the chunks in chunk order on communicator B (AR has its own
// communicator). Timing decides only *when* a rank issues its next chunk. NOTE (the no-deadlock invariant,
// docs/flow.md): the issue of an all-to-all never waits for an AR chunk; it waits only for its own
// dependencies and the previous all-to-all. LinkModel::exclusive models what the shared link does — an
// all-to-all that becomes ready while a chunk occupies the link starts when the chunk is done — which is a
// statement about time on the wire, used by the simulator, not a wait an executor may implement on the host.
#pragma once

#include <cstdint>
#include <vector>

#include "flow/task_graph.hpp"

namespace dmoe::flow {

enum class LinkModel : uint8_t {
  exclusive,  // one collective on the link at a time (the paper's model; the simulator's default)
  separate,   // the two communicators progress independently (an executor's issue rule; no link model)
  shared,     // issued as `separate`, but one link: while an all-to-all and an AR chunk are both in flight they
              // share its bandwidth (each progresses at half speed; the simulator's fluid model, simulate() only)
};

class CommQueue {
 public:
  CommQueue(const TaskGraph& graph, LinkModel link = LinkModel::exclusive);
  // One communicator in a fixed order (ArComm::model: single_comm_issue_order, docs/flow.md): the all-to-alls and
  // AR chunks in the order they appear in `order` (its other tasks are skipped), one at a time, each once its
  // dependencies are done — timing decides nothing but when. The all-to-alls and the chunks must each appear in
  // the graph's own orders (checked).
  CommQueue(const TaskGraph& graph, const std::vector<int32_t>& one_communicator_order);

  // The operations to issue now, given which tasks are complete (done[id]); possibly none. At most one
  // all-to-all and at most one AR chunk (the latter only when no all-to-all is ready or running).
  // Call started() for each one issued, finished() when it completes.
  struct Pick {
    int32_t alltoall = -1;
    int32_t allreduce = -1;
  };
  Pick pick(const std::vector<uint8_t>& done) const;
  void started(int32_t task);
  void finished(int32_t task);

  bool alltoall_running() const { return alltoall_running_ >= 0; }
  bool allreduce_running() const { return allreduce_running_ >= 0; }
  bool empty() const;  // everything issued and finished
  int32_t next_alltoall() const;   // the next all-to-all in the static order, -1 when all issued
  int32_t next_allreduce() const;  // the next chunk in chunk order, -1 when all issued

 private:
  bool ready(int32_t task, const std::vector<uint8_t>& done) const;

  const TaskGraph& graph_;
  LinkModel link_;
  std::vector<int32_t> one_comm_;  // the fixed order of the one-communicator mode (empty otherwise)
  size_t next_one_ = 0;
  size_t next_a2a_ = 0, next_ar_ = 0;
  int32_t alltoall_running_ = -1, allreduce_running_ = -1;
};

}  // namespace dmoe::flow
