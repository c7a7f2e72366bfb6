// fault.cpp — see fault.hpp.
#include "core/fault.hpp"

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <mutex>
#include <set>
#include <utility>

#include "core/error.hpp"

namespace dmoe {
namespace {

constexpr FaultStage kStages[] = {FaultStage::before_dispatch, FaultStage::alltoall, FaultStage::expert_gemm,
                                  FaultStage::combine,         FaultStage::backward, FaultStage::allreduce};
constexpr FaultKind kKinds[] = {FaultKind::throw_error, FaultKind::exit, FaultKind::hang};

[[noreturn]] void bad_spec(std::string_view text, std::string_view why) {
  DMOE_FAIL_INPUT("DMOE_FAULT='{}' is invalid ({}): expected rank:stage:kind, rank >= 0, stage one of "
                  "before_dispatch, alltoall, expert_gemm, combine, backward, allreduce, kind one of throw, exit, "
                  "hang (e.g. 1:expert_gemm:hang)", text, why);
}

}  // namespace

const char* fault_stage_name(FaultStage stage) {
  switch (stage) {
    case FaultStage::none: return "none";
    case FaultStage::before_dispatch: return "before_dispatch";
    case FaultStage::alltoall: return "alltoall";
    case FaultStage::expert_gemm: return "expert_gemm";
    case FaultStage::combine: return "combine";
    case FaultStage::backward: return "backward";
    case FaultStage::allreduce: return "allreduce";
  }
  return "?";
}

const char* fault_kind_name(FaultKind kind) {
  switch (kind) {
    case FaultKind::throw_error: return "throw";
    case FaultKind::exit: return "exit";
    case FaultKind::hang: return "hang";
  }
  return "?";
}

Fault parse_fault(std::string_view text) {
  const size_t a = text.find(':');
  const size_t b = a == std::string_view::npos ? a : text.find(':', a + 1);
  if (b == std::string_view::npos || text.find(':', b + 1) != std::string_view::npos) bad_spec(text, "three fields");
  const std::string rank(text.substr(0, a));
  const std::string_view stage = text.substr(a + 1, b - a - 1), kind = text.substr(b + 1);
  Fault f;
  // Decimal digits only: strtol also took a leading space or '+' (DMOE_FAULT=' 1:…' read as rank 1).
  const bool digits = !rank.empty() &&
                      std::all_of(rank.begin(), rank.end(), [](char ch) { return ch >= '0' && ch <= '9'; });
  if (!digits) bad_spec(text, "rank: decimal digits only");
  // G23B-10: a rank of 8 digits or more was "decimal digits only", though it is: too large, with the bound.
  const size_t first = std::min(rank.find_first_not_of('0'), rank.size());
  const long r = rank.size() - first > 7 ? (1L << 20) + 1 : std::strtol(rank.c_str(), nullptr, 10);
  if (r > 1 << 20) bad_spec(text, "rank too large: at most 1048576");
  f.rank = int32_t(r);
  for (FaultStage s : kStages)
    if (stage == fault_stage_name(s)) f.stage = s;
  if (f.stage == FaultStage::none) bad_spec(text, "stage");
  bool kind_found = false;
  for (FaultKind k : kKinds)
    if (kind == fault_kind_name(k)) {
      f.kind = k;
      kind_found = true;
    }
  if (!kind_found) bad_spec(text, "kind");
  return f;
}

namespace {
struct StagesReached {
  std::mutex mutex;
  std::set<int32_t> ranks;
  std::set<std::pair<int32_t, FaultStage>> reached;
};
StagesReached& stages_reached() {
  static StagesReached s;
  return s;
}
}  // namespace

void note_stage_reached(int32_t rank, FaultStage stage) {
  StagesReached& s = stages_reached();
  std::lock_guard<std::mutex> lock(s.mutex);
  s.ranks.insert(rank);
  s.reached.insert({rank, stage});
}

void reset_stages_reached() {
  StagesReached& s = stages_reached();
  std::lock_guard<std::mutex> lock(s.mutex);
  s.ranks.clear();
  s.reached.clear();
}

namespace {
std::string fault_spec(const Fault& f) {
  return fmt::format("DMOE_FAULT={}:{}:{}", f.rank, fault_stage_name(f.stage), fault_kind_name(f.kind));
}
std::string no_fault_point(const Fault& f, std::string_view command) {
  return fmt::format("{} cannot fire: `dmoe {}` passes no fault point (they are in the MoE layer's exchanges and "
                     "stages: run, bench layer, train, eval, flow measure); unset DMOE_FAULT", fault_spec(f), command);
}
}  // namespace

void require_no_fault_injected(std::string_view command) {
  const std::optional<Fault> fault = fault_from_env();
  if (fault) DMOE_FAIL_INPUT("{}", no_fault_point(*fault, command));
}

namespace {
std::atomic<int32_t> g_fault_run_world{0};
}  // namespace

void require_fault_reachable(std::string_view command, int32_t largest_world, std::string_view world_note,
                             bool backward_runs, std::string_view backward_hint) {
  g_fault_run_world.store(largest_world);
  const std::optional<Fault> fault = fault_from_env();
  if (!fault) return;
  DMOE_REQUIRE_INPUT(fault->rank < largest_world, "DMOE_FAULT names rank {}, but this run has {} ranks (0 to {}{}{}); "
                     "the fault would never fire: name a rank in that range, or unset DMOE_FAULT", fault->rank,
                     largest_world, largest_world - 1, world_note.empty() ? "" : ": ", world_note);
  DMOE_REQUIRE_INPUT(fault->stage != FaultStage::backward || backward_runs, "{} cannot fire: this `dmoe {}` runs no "
                     "backward ({} for one); choose a forward stage (before_dispatch, alltoall, expert_gemm, combine, "
                     "allreduce), or unset DMOE_FAULT", fault_spec(*fault), command, backward_hint);
  // G23B-6: a run of one rank has no all-to-all or all-reduce: a fault there was said to be unfired only after the
  // whole run (its --json or --output written); and a hang waited 4 × DMOE_COMM_TIMEOUT_S (40 min by default) for
  // other ranks to give up on it, which do not exist. Both are refused before the work.
  if (largest_world == 1) {
    DMOE_REQUIRE_INPUT(fault->stage != FaultStage::alltoall && fault->stage != FaultStage::allreduce, "{} cannot fire: "
                       "a run of one rank has no exchange (all-to-all or all-reduce){}{}; give it two ranks or more "
                       "(-n/--world, or dmoe launch -n), choose a stage one rank reaches (before_dispatch, expert_gemm, "
                       "combine{}), or unset DMOE_FAULT", fault_spec(*fault), world_note.empty() ? "" : ": ",
                       world_note, backward_runs ? ", backward" : "");
    DMOE_REQUIRE_INPUT(fault->kind != FaultKind::hang, "{} cannot fire as a hang: a run of one rank has no other rank "
                       "to give up on it (it would wait 4 × DMOE_COMM_TIMEOUT_S); give it two ranks or more "
                       "(-n/--world, or dmoe launch -n), choose kind throw or exit, or unset DMOE_FAULT",
                       fault_spec(*fault));
  }
}

int32_t fault_run_world() { return g_fault_run_world.load(); }

std::string unfired_fault(std::string_view command) {
  const std::optional<Fault> fault = fault_from_env();
  if (!fault) return "";
  StagesReached& s = stages_reached();
  std::lock_guard<std::mutex> lock(s.mutex);
  const std::string spec = fault_spec(*fault);
  if (s.ranks.empty()) return no_fault_point(*fault, command);
  if (!s.ranks.count(fault->rank) || s.reached.count({fault->rank, fault->stage})) return "";
  std::string seen;
  for (FaultStage st : kStages)
    if (s.reached.count({fault->rank, st})) seen += std::string(seen.empty() ? "" : ", ") + fault_stage_name(st);
  return fmt::format("{} did not fire: rank {} ran in this process but never reached stage {} (it reached: {}); "
                     "choose a stage this run reaches, or unset DMOE_FAULT", spec, fault->rank,
                     fault_stage_name(fault->stage), seen);
}

std::optional<Fault> fault_from_env() {
  const char* text = std::getenv("DMOE_FAULT");
  if (!text || !*text) return std::nullopt;
  return parse_fault(text);
}

}  // namespace dmoe
