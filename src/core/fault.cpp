// fault.cpp — see fault.hpp.
#include "core/fault.hpp"

#include <cstdlib>

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
  char* end = nullptr;
  const long r = std::strtol(rank.c_str(), &end, 10);
  if (rank.empty() || *end != '\0' || r < 0 || r > 1 << 20) bad_spec(text, "rank");
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

std::optional<Fault> fault_from_env() {
  const char* text = std::getenv("DMOE_FAULT");
  if (!text || !*text) return std::nullopt;
  return parse_fault(text);
}

}  // namespace dmoe
