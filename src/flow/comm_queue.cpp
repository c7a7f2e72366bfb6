// comm_queue.cpp — the priority rule (see comm_queue.hpp).
#include "flow/comm_queue.hpp"

#include "core/error.hpp"

namespace dmoe::flow {

CommQueue::CommQueue(const TaskGraph& graph, LinkModel link) : graph_(graph), link_(link) {}

CommQueue::CommQueue(const TaskGraph& graph, const std::vector<int32_t>& order)
    : graph_(graph), link_(LinkModel::exclusive) {
  std::vector<int32_t> a2a, ar;
  for (int32_t id : order) {
    DMOE_REQUIRE(id >= 0 && size_t(id) < graph.tasks.size(), "one-communicator order: task {} is not in the graph "
                 "({} tasks)", id, graph.tasks.size());
    const Stream s = graph.tasks[size_t(id)].stream;
    if (s == Stream::compute) continue;
    one_comm_.push_back(id);
    (s == Stream::alltoall ? a2a : ar).push_back(id);
  }
  DMOE_REQUIRE(a2a == graph.alltoall_order && ar == graph.allreduce_order,
               "one-communicator order: its all-to-alls and AR chunks must be the graph's alltoall_order and "
               "allreduce_order, each once and in order ({} and {} given, {} and {} in the graph)",
               a2a.size(), ar.size(), graph.alltoall_order.size(), graph.allreduce_order.size());
}

bool CommQueue::ready(int32_t task, const std::vector<uint8_t>& done) const {
  for (int32_t d : graph_.tasks[size_t(task)].deps)
    if (!done[size_t(d)]) return false;
  return true;
}

int32_t CommQueue::next_alltoall() const {
  return next_a2a_ < graph_.alltoall_order.size() ? graph_.alltoall_order[next_a2a_] : -1;
}

int32_t CommQueue::next_allreduce() const {
  return next_ar_ < graph_.allreduce_order.size() ? graph_.allreduce_order[next_ar_] : -1;
}

bool CommQueue::empty() const {
  return next_alltoall() < 0 && next_allreduce() < 0 && !alltoall_running() && !allreduce_running();
}

CommQueue::Pick CommQueue::pick(const std::vector<uint8_t>& done) const {
  DMOE_REQUIRE(done.size() == graph_.tasks.size(), "done has {} entries; the graph has {} tasks", done.size(),
               graph_.tasks.size());
  Pick p;
  if (!one_comm_.empty()) {  // one communicator: the next operation of the fixed order, once the previous is done
    if (next_one_ == one_comm_.size() || alltoall_running() || allreduce_running()) return p;
    const int32_t id = one_comm_[next_one_];
    if (!ready(id, done)) return p;
    (graph_.tasks[size_t(id)].stream == Stream::alltoall ? p.alltoall : p.allreduce) = id;
    return p;
  }
  const int32_t a2a = next_alltoall();
  const bool a2a_ready = a2a >= 0 && ready(a2a, done);
  // All-to-all first: issued whenever ready and its communicator is free; on an exclusive link it also
  // waits for a running chunk to leave the wire (non-preemptive).
  if (a2a_ready && !alltoall_running() && (link_ != LinkModel::exclusive || !allreduce_running())) p.alltoall = a2a;
  // A chunk only when no all-to-all is ready or running (an all-to-all picked now counts as ready).
  const int32_t ar = next_allreduce();
  if (ar >= 0 && !a2a_ready && !alltoall_running() && !allreduce_running() && ready(ar, done)) p.allreduce = ar;
  return p;
}

void CommQueue::started(int32_t task) {
  if (!one_comm_.empty()) {
    DMOE_REQUIRE(next_one_ < one_comm_.size() && task == one_comm_[next_one_], "task {} started out of the "
                 "one-communicator order (next: {})", graph_.describe(task),
                 next_one_ < one_comm_.size() ? graph_.describe(one_comm_[next_one_]) : "none");
    ++next_one_;
  }
  if (task == next_alltoall()) {
    DMOE_REQUIRE(!alltoall_running(), "all-to-all {} started while {} runs", graph_.describe(task),
                 graph_.describe(alltoall_running_));
    alltoall_running_ = task;
    ++next_a2a_;
  } else if (task == next_allreduce()) {
    DMOE_REQUIRE(!allreduce_running(), "AR {} started while {} runs", graph_.describe(task),
                 graph_.describe(allreduce_running_));
    allreduce_running_ = task;
    ++next_ar_;
  } else {
    DMOE_FAIL("task {} started out of order: the next all-to-all is {}, the next AR chunk {}", graph_.describe(task),
              next_alltoall() >= 0 ? graph_.describe(next_alltoall()) : "none",
              next_allreduce() >= 0 ? graph_.describe(next_allreduce()) : "none");
  }
}

void CommQueue::finished(int32_t task) {
  if (task == alltoall_running_)
    alltoall_running_ = -1;
  else if (task == allreduce_running_)
    allreduce_running_ = -1;
  else
    DMOE_FAIL("task {} finished but is not running on a communicator", graph_.describe(task));
}

}  // namespace dmoe::flow
