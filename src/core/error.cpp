#include "core/error.hpp"

namespace dmoe {

int& error_rank() {
  thread_local int rank = -1;
  return rank;
}

namespace {

// Messages quote what the user gave (JSON keys, tensor names, paths), which may hold control characters: a NUL ended
// the printed message there ("unknown key 'tokens" and nothing after; a tensor "x\u0000" listed as "x"), an escape
// sequence would act on the terminal. They are shown as \u00XX; newlines and tabs stay.
std::string printable(const std::string& message) {
  std::string out;
  out.reserve(message.size());
  for (const char ch : message) {
    const auto c = static_cast<unsigned char>(ch);
    if ((c < 0x20 && c != '\n' && c != '\t') || c == 0x7f) {
      constexpr char kHex[] = "0123456789abcdef";
      out += "\\u00";
      out += kHex[c >> 4];
      out += kHex[c & 0xf];
    } else
      out += ch;
  }
  return out;
}

}  // namespace

void throw_error(const char* file, int line, const std::string& raw) {
  const std::string message = printable(raw);
  const char* base = file;
  for (const char* p = file; *p; ++p)
    if (*p == '/') base = p + 1;
  if (error_rank() >= 0)
    throw Error(fmt::format("[rank {}] {} ({}:{})", error_rank(), message, base, line));
  throw Error(fmt::format("{} ({}:{})", message, base, line));
}

namespace {

[[noreturn]] void throw_without_location(const std::string& raw, ErrorKind kind) {
  const std::string message = printable(raw);
  if (error_rank() >= 0) throw Error(fmt::format("[rank {}] {}", error_rank(), message), kind);
  throw Error(message, kind);
}

}  // namespace

void throw_input_error(const std::string& raw) { throw_without_location(raw, ErrorKind::input); }
void throw_run_error(const std::string& raw) { throw_without_location(raw, ErrorKind::run); }

}  // namespace dmoe
