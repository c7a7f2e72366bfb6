// safetensors.cpp — safetensors parsing (validate everything, trust nothing) and writing.
#include "model/safetensors.hpp"

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cfloat>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <limits>
#include <set>
#include <utility>

#include <nlohmann/json.hpp>

#include "core/error.hpp"
#include "core/host_resources.hpp"
#include "core/output_file.hpp"
#include "model/config_io.hpp"

namespace dmoe {

// Tensor bytes are reinterpreted as host numbers; the format is little-endian.
static_assert(std::endian::native == std::endian::little, "safetensors I/O assumes a little-endian host");

namespace {

using nlohmann::json;

constexpr const char* kMetadataKey = "__metadata__";

struct DTypeSize {
  const char* name;
  size_t size;
};
// Every dtype the safetensors format defines (F8 variants included, so such files still open).
constexpr DTypeSize kDTypes[] = {
    {"BOOL", 1}, {"U8", 1},  {"I8", 1},  {"F8_E5M2", 1}, {"F8_E4M3", 1}, {"I16", 2},
    {"U16", 2},  {"F16", 2}, {"BF16", 2}, {"I32", 4},    {"U32", 4},     {"F32", 4},
    {"F64", 8},  {"I64", 8}, {"U64", 8},
};

std::string allowed_dtypes() {
  std::string s;
  for (const auto& d : kDTypes) s += (s.empty() ? "" : ", ") + std::string(d.name);
  return s;
}

float half_to_float(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000u) << 16;
  const uint32_t exponent = (h >> 10) & 0x1fu;
  const uint32_t mantissa = h & 0x3ffu;
  if (exponent == 0) {  // zero or subnormal: mantissa * 2^-24, exact in float
    const float v = std::ldexp(float(mantissa), -24);
    return sign ? -v : v;
  }
  if (exponent == 31) return bits_float(sign | 0x7f800000u | (mantissa << 13));  // inf / NaN
  return bits_float(sign | ((exponent + 112) << 23) | (mantissa << 13));
}

// double -> float without the undefined behaviour of converting an out-of-range value.
float double_to_float(double d) {
  if (std::isfinite(d) && std::fabs(d) > double(FLT_MAX)) {
    // Round to nearest even: values below FLT_MAX + half an ulp (2^103) round down to FLT_MAX.
    const float mag = std::fabs(d) < double(FLT_MAX) + 0x1p103 ? FLT_MAX : std::numeric_limits<float>::infinity();
    return d < 0 ? -mag : mag;
  }
  return float(d);
}

template <typename T>
T load(const uint8_t* p) {
  T v;
  std::memcpy(&v, p, sizeof(T));
  return v;
}

// Product of dims, or -1 on a negative dimension or int64 overflow.
int64_t checked_numel(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) {
    if (d < 0 || __builtin_mul_overflow(n, d, &n)) return -1;
  }
  return n;
}

// A header integer that must fit in [0, max]; false when it is not a JSON integer or out of range.
bool get_count(const json& v, uint64_t max, uint64_t* out) {
  if (v.is_number_unsigned()) {
    *out = v.get<uint64_t>();
    return *out <= max;
  }
  if (v.is_number_integer()) {  // signed: only negative values land here
    const int64_t s = v.get<int64_t>();
    if (s < 0) return false;
    *out = uint64_t(s);
    return *out <= max;
  }
  return false;
}

std::string describe(const json& v) {
  // Short description of an unexpected JSON value for error messages.
  std::string s = v.dump(-1, ' ', false, json::error_handler_t::replace);
  if (s.size() > 60) {  // in place: GCC 12 at -O3 warns falsely (-Warray-bounds) on substr(...) + "..."
    s.resize(57);
    s += "...";
  }
  return fmt::format("{} {}", v.type_name(), s);
}

// Parses the header under read_json_file's rules (config_io.hpp): a duplicate key (nlohmann's DOM parser keeps the
// last one), nesting past 128 levels (dump() and describe() recurse once per level: 100000 nested arrays crashed the
// error message with SIGSEGV), in time linear in the header.
json parse_header(const uint8_t* begin, const uint8_t* end, const std::string& src) {
  json header;
  StrictJsonProblem problem;
  try {
    header = parse_json_strictly(std::string_view(reinterpret_cast<const char*>(begin), size_t(end - begin)), problem);
  } catch (const json::exception& e) {
    DMOE_FAIL_INPUT("safetensors '{}': header is not valid JSON: {}", src, json_error_text(e));
  }
  switch (problem.kind) {
    case StrictJsonProblem::none: break;
    case StrictJsonProblem::duplicate_key:
      if (problem.depth == 1 && problem.key == "__metadata__")
        DMOE_FAIL_INPUT("safetensors '{}': the header has '__metadata__' more than once (it is one object of strings)",
                        src);
      if (problem.depth == 1) DMOE_FAIL_INPUT("safetensors '{}': duplicate tensor name '{}' in the header", src, problem.key);
      DMOE_FAIL_INPUT("safetensors '{}': duplicate key '{}' inside a header entry (nesting level {})", src, problem.key,
                      problem.depth);
    case StrictJsonProblem::too_deep:
      DMOE_FAIL_INPUT("safetensors '{}': the header's objects and arrays nest deeper than {} levels; a header is an "
                      "object of tensor entries (dtype, shape, data_offsets)", src, kMaxJsonDepth);
    case StrictJsonProblem::underflow: DMOE_FAIL_INPUT("safetensors '{}': header: {}", src, problem.message);
  }
  return header;
}

TensorInfo parse_entry(const std::string& name, const json& entry, uint64_t data_size, const std::string& src) {
  DMOE_REQUIRE_INPUT(entry.is_object(), "safetensors '{}': entry for tensor '{}' is not an object (found {})", src,
                     name, describe(entry));
  TensorInfo t;
  t.name = name;

  const auto dtype = entry.find("dtype");
  DMOE_REQUIRE_INPUT(dtype != entry.end(), "safetensors '{}': tensor '{}' has no dtype", src, name);
  DMOE_REQUIRE_INPUT(dtype->is_string(), "safetensors '{}': tensor '{}': dtype must be a string (found {})", src,
                     name, describe(*dtype));
  t.dtype = dtype->get<std::string>();
  const size_t elem = safetensors_dtype_size(t.dtype);
  DMOE_REQUIRE_INPUT(elem != 0, "safetensors '{}': tensor '{}' has unknown dtype '{}'; allowed: {}", src, name,
                     t.dtype, allowed_dtypes());

  const auto shape = entry.find("shape");
  DMOE_REQUIRE_INPUT(shape != entry.end(), "safetensors '{}': tensor '{}' has no shape", src, name);
  DMOE_REQUIRE_INPUT(shape->is_array(), "safetensors '{}': tensor '{}': shape must be an array (found {})", src, name,
                     describe(*shape));
  for (const json& d : *shape) {
    uint64_t dim = 0;
    DMOE_REQUIRE_INPUT(get_count(d, uint64_t(std::numeric_limits<int64_t>::max()), &dim),
                       "safetensors '{}': tensor '{}': shape entries must be non-negative integers (found {})", src,
                       name, describe(d));
    t.shape.push_back(int64_t(dim));
  }
  const int64_t numel = checked_numel(t.shape);
  DMOE_REQUIRE_INPUT(numel >= 0, "safetensors '{}': tensor '{}': shape {} has an element count that overflows int64",
                     src, name, shape_string(t.shape));
  uint64_t expected_bytes = 0;
  DMOE_REQUIRE_INPUT(!__builtin_mul_overflow(uint64_t(numel), uint64_t(elem), &expected_bytes),
                     "safetensors '{}': tensor '{}': shape {} of {} overflows the byte count", src, name,
                     shape_string(t.shape), t.dtype);

  const auto offsets = entry.find("data_offsets");
  DMOE_REQUIRE_INPUT(offsets != entry.end(), "safetensors '{}': tensor '{}' has no data_offsets", src, name);
  DMOE_REQUIRE_INPUT(offsets->is_array() && offsets->size() == 2,
                     "safetensors '{}': tensor '{}': data_offsets must be an array [begin, end] (found {})", src, name,
                     describe(*offsets));
  const uint64_t u64_max = std::numeric_limits<uint64_t>::max();
  DMOE_REQUIRE_INPUT(get_count((*offsets)[0], u64_max, &t.begin) && get_count((*offsets)[1], u64_max, &t.end),
                     "safetensors '{}': tensor '{}': data_offsets must be non-negative integers (found {})", src,
                     name, describe(*offsets));
  DMOE_REQUIRE_INPUT(t.begin <= t.end, "safetensors '{}': tensor '{}': data_offsets begin {} > end {}", src, name,
                     t.begin, t.end);
  DMOE_REQUIRE_INPUT(t.end <= data_size,
                     "safetensors '{}': tensor '{}': data_offsets end {} is beyond the data region ({} bytes; file "
                     "truncated?)",
                     src, name, t.end, data_size);
  DMOE_REQUIRE_INPUT(t.nbytes() == expected_bytes,
                     "safetensors '{}': tensor '{}': byte size {} does not match shape {} of {} ({} bytes)", src,
                     name, t.nbytes(), shape_string(t.shape), t.dtype, expected_bytes);
  return t;
}

}  // namespace

int64_t TensorInfo::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;  // validated on parse: no overflow
  return n;
}

size_t safetensors_dtype_size(const std::string& dtype) {
  for (const auto& d : kDTypes)
    if (dtype == d.name) return d.size;
  return 0;
}

const char* safetensors_dtype_name(DType t) {
  switch (t) {
    case DType::f32: return "F32";
    case DType::bf16: return "BF16";
    case DType::f64: return "F64";
    case DType::i32: return "I32";
    case DType::i64: return "I64";
  }
  return "?";
}

std::string shape_string(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += fmt::format("{}{}", i ? ", " : "", shape[i]);
  return s + "]";
}

// ---- reading ------------------------------------------------------------------------------------

SafetensorsFile SafetensorsFile::open(const std::string& path) {
  std::error_code ec;
  DMOE_REQUIRE_INPUT(std::filesystem::is_regular_file(path, ec), "safetensors '{}': not a readable regular file{}",
                     path, ec ? " (" + ec.message() + ")" : std::string());
  // The whole file is held in memory: one larger than what is available is refused before reading.
  const uint64_t size_hint = std::filesystem::file_size(path, ec);
  if (!ec) require_host_memory(double(size_hint), fmt::format("reading safetensors '{}' into memory", path), "");
  std::FILE* f = std::fopen(path.c_str(), "rb");
  DMOE_REQUIRE_INPUT(f, "safetensors '{}': cannot open: {}", path, std::strerror(errno));
  std::vector<uint8_t> bytes;
  // On the heap: 64 KiB on the stack was the whole stack under `ulimit -s 64` (SIGSEGV).
  std::vector<uint8_t> chunk(size_t(1) << 16);
  size_t got = 0;
  // Read to EOF rather than trusting a size query (the file may change underneath).
  if (!ec) bytes.reserve(size_t(size_hint));
  while ((got = std::fread(chunk.data(), 1, chunk.size(), f)) > 0)
    bytes.insert(bytes.end(), chunk.begin(), chunk.begin() + std::ptrdiff_t(got));
  const bool failed = std::ferror(f) != 0;
  std::fclose(f);
  DMOE_REQUIRE_INPUT(!failed, "safetensors '{}': read error", path);
  return parse(std::move(bytes), path);
}

SafetensorsFile SafetensorsFile::parse(std::vector<uint8_t> bytes, std::string source_name) {
  SafetensorsFile file;
  file.source_ = std::move(source_name);
  file.bytes_ = std::move(bytes);
  const std::string& src = file.source_;
  const uint64_t size = file.bytes_.size();
  DMOE_REQUIRE_INPUT(size >= 8, "safetensors '{}': file is {} bytes, shorter than the 8-byte header length", src,
                     size);

  uint64_t header_len = 0;
  for (int i = 0; i < 8; ++i) header_len |= uint64_t(file.bytes_[size_t(i)]) << (8 * i);
  DMOE_REQUIRE_INPUT(header_len <= kMaxHeaderBytes,
                     "safetensors '{}': header length {} is absurd (limit {} bytes); not a safetensors file?", src,
                     header_len, kMaxHeaderBytes);
  DMOE_REQUIRE_INPUT(header_len <= size - 8,
                     "safetensors '{}': header length {} is larger than the file ({} bytes after the length field; "
                     "file truncated?)",
                     src, header_len, size - 8);
  file.data_start_ = 8 + header_len;
  const uint64_t data_size = size - file.data_start_;

  const uint8_t* header_begin = file.bytes_.data() + 8;
  // The format's header is JSON padded at its end with spaces (0x20); the reference reader (serde_json) takes any
  // JSON whitespace around it and nothing else. nlohmann's lexer ends its input at a NUL byte, so a header padded
  // with NULs, or with anything after a NUL, was taken: a NUL is refused here, wherever it is (JSON has no raw NUL,
  // not even inside a string).
  const uint8_t* nul = std::find(header_begin, header_begin + header_len, uint8_t(0));
  DMOE_REQUIRE_INPUT(nul == header_begin + header_len,
                     "safetensors '{}': byte {} of the file (byte {} of the {}-byte header) is NUL (0x00); the header "
                     "must be JSON, padded at its end with spaces (0x20) only",
                     src, 8 + (nul - header_begin), nul - header_begin, header_len);
  // nlohmann skips a UTF-8 byte-order mark; the format's header has none and the reference reader refuses one (a
  // config file may carry one, from an editor; a safetensors writer never writes it).
  DMOE_REQUIRE_INPUT(!(header_len >= 3 && header_begin[0] == 0xEF && header_begin[1] == 0xBB && header_begin[2] == 0xBF),
                     "safetensors '{}': the header starts with a UTF-8 byte-order mark (EF BB BF); the header must be "
                     "JSON from its first byte, as the format's reference reader requires",
                     src);
  const json header = parse_header(header_begin, header_begin + header_len, src);
  DMOE_REQUIRE_INPUT(header.is_object(), "safetensors '{}': header is not a JSON object (found {})", src,
                     header.type_name());

  for (const auto& [name, entry] : header.items()) {
    if (name == kMetadataKey) {
      DMOE_REQUIRE_INPUT(entry.is_object(), "safetensors '{}': __metadata__ must be an object of strings (found {})",
                         src, describe(entry));
      for (const auto& [key, value] : entry.items()) {
        DMOE_REQUIRE_INPUT(value.is_string(), "safetensors '{}': __metadata__ value of '{}' must be a string (found {})",
                           src, key, describe(value));
        file.metadata_[key] = value.get<std::string>();
      }
      continue;
    }
    file.tensors_.emplace(name, parse_entry(name, entry, data_size, src));
  }

  // The format forbids overlapping tensors (empty tensors occupy nothing). Holes are tolerated.
  std::vector<const TensorInfo*> by_offset;
  for (const auto& [name, t] : file.tensors_)
    if (t.nbytes() > 0) by_offset.push_back(&t);
  std::sort(by_offset.begin(), by_offset.end(), [](const TensorInfo* a, const TensorInfo* b) {
    return a->begin != b->begin ? a->begin < b->begin : a->name < b->name;
  });
  for (size_t i = 1; i < by_offset.size(); ++i) {
    const TensorInfo& a = *by_offset[i - 1];
    const TensorInfo& b = *by_offset[i];
    DMOE_REQUIRE_INPUT(b.begin >= a.end,
                       "safetensors '{}': tensors '{}' [{}, {}) and '{}' [{}, {}) overlap in the data region", src,
                       a.name, a.begin, a.end, b.name, b.begin, b.end);
  }
  // A header length field 1-7 bytes short (cutting into the spaces that pad the header) still parses, and then
  // every tensor is read that many bytes early: the data region begins with the rest of the padding and is that much
  // longer than its tensors. Holes and trailing bytes are otherwise tolerated, so only this exact pattern is refused.
  if (!by_offset.empty() && by_offset.front()->begin == 0) {
    uint64_t extent = 0;
    for (const TensorInfo* t : by_offset) extent = std::max(extent, t->end);
    const uint64_t extra = data_size - extent;
    const uint8_t* data = file.bytes_.data() + file.data_start_;
    if (extra >= 1 && extra <= 7 && std::all_of(data, data + extra, [](uint8_t c) { return c == ' '; }))
      DMOE_FAIL_INPUT("safetensors '{}': the header length field says {} bytes, but the data region starts with {} "
                      "space(s) and is {} byte(s) longer than its tensors: the field looks {} short of the header's "
                      "padding (it would be {}), and every tensor would be read shifted; the file is damaged",
                      src, header_len, extra, extra, extra, header_len + extra);
  }
  return file;
}

const TensorInfo& SafetensorsFile::info(const std::string& name) const {
  const auto it = tensors_.find(name);
  if (it != tensors_.end()) return it->second;
  // List the names sharing the longest prefix with the one asked for: usually the intended neighbours.
  std::vector<std::pair<size_t, const std::string*>> ranked;
  for (const auto& [n, t] : tensors_) {
    const size_t common = size_t(std::mismatch(n.begin(), n.begin() + std::min(n.size(), name.size()),
                                               name.begin()).first - n.begin());
    ranked.emplace_back(common, &n);
  }
  std::stable_sort(ranked.begin(), ranked.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
  std::string some;
  for (size_t i = 0; i < ranked.size() && i < 6; ++i) some += fmt::format("{}'{}'", i ? ", " : "", *ranked[i].second);
  if (ranked.size() > 6) some += ", ...";
  DMOE_FAIL_INPUT("safetensors '{}': no tensor '{}' ({} tensors{}{})", source_, name, tensors_.size(),
                  tensors_.empty() ? "" : "; closest: ", some);
}

std::vector<std::string> SafetensorsFile::names() const {
  std::vector<std::string> out;
  out.reserve(tensors_.size());
  for (const auto& [name, t] : tensors_) out.push_back(name);
  return out;
}

std::string tensor_list(const SafetensorsFile& file) {
  std::string out;
  for (const std::string& name : file.names()) out += (out.empty() ? "" : ", ") + name;
  return out.empty() ? "none (the file holds no tensors)" : out;
}

std::span<const uint8_t> SafetensorsFile::raw(const std::string& name) const {
  const TensorInfo& t = info(name);
  return {data_of(t), size_t(t.nbytes())};
}

void SafetensorsFile::check_shape(const TensorInfo& t, const std::vector<int64_t>& expected_shape) const {
  DMOE_REQUIRE_INPUT(t.shape == expected_shape, "safetensors '{}': tensor '{}' has shape {}, expected {}", source_,
                     t.name, shape_string(t.shape), shape_string(expected_shape));
}

void SafetensorsFile::read_f32_into(const std::string& name, const std::vector<int64_t>& expected_shape,
                                    float* out) const {
  const TensorInfo& t = info(name);
  check_shape(t, expected_shape);
  const uint8_t* p = data_of(t);
  const size_t n = size_t(t.numel());
  if (t.dtype == "F32") {
    if (n > 0) std::memcpy(out, p, n * 4);
  } else if (t.dtype == "BF16") {
    for (size_t i = 0; i < n; ++i) out[i] = bf16_to_float(bfloat16{load<uint16_t>(p + 2 * i)});
  } else if (t.dtype == "F16") {
    for (size_t i = 0; i < n; ++i) out[i] = half_to_float(load<uint16_t>(p + 2 * i));
  } else if (t.dtype == "F64") {
    for (size_t i = 0; i < n; ++i) {
      const double d = load<double>(p + 8 * i);
      out[i] = double_to_float(d);
      // A finite double past float's range became inf here, and the caller's finiteness check then said "x[0, 5] is
      // inf" of a file that holds 1e300: the value and the cause, instead.
      if (std::isfinite(d) && !std::isfinite(out[i])) {
        std::string index;
        for (size_t k = t.shape.size(), rest = i; k-- > 0;) {
          const size_t dim = size_t(t.shape[k]);
          index = std::to_string(rest % dim) + (index.empty() ? "" : ", ") + index;
          rest /= dim;
        }
        DMOE_FAIL_INPUT("safetensors '{}': tensor '{}' [{}] is {:g} (F64), beyond float32's range (magnitude at most "
                        "{:g}), in which dmoe computes; scale the values into float's range", source_, name, index, d,
                        double(FLT_MAX));
      }
    }
  } else {
    DMOE_FAIL_INPUT("safetensors '{}': tensor '{}' has dtype {}; only F32, BF16, F16 and F64 can be read as float",
                    source_, name, t.dtype);
  }
}

std::vector<float> SafetensorsFile::read_f32(const std::string& name,
                                             const std::vector<int64_t>& expected_shape) const {
  const TensorInfo& t = info(name);
  check_shape(t, expected_shape);
  std::vector<float> out(size_t(t.numel()));
  read_f32_into(name, expected_shape, out.data());
  return out;
}

HostTensor<float> SafetensorsFile::read_f32(const std::string& name) const {
  const TensorInfo& t = info(name);
  HostTensor<float> out{t.shape, std::vector<float>(size_t(t.numel()))};
  read_f32_into(name, t.shape, out.values.data());
  return out;
}

void SafetensorsFile::read_i32_into(const TensorInfo& t, int32_t* out) const {
  const uint8_t* p = data_of(t);
  const size_t n = size_t(t.numel());
  if (t.dtype == "I32") {
    if (n > 0) std::memcpy(out, p, n * 4);
  } else if (t.dtype == "I64") {
    for (size_t i = 0; i < n; ++i) {
      const int64_t v = load<int64_t>(p + 8 * i);
      DMOE_REQUIRE_INPUT(v >= std::numeric_limits<int32_t>::min() && v <= std::numeric_limits<int32_t>::max(),
                         "safetensors '{}': tensor '{}' (I64) element {} = {} does not fit in int32", source_, t.name,
                         i, v);
      out[i] = int32_t(v);
    }
  } else {
    DMOE_FAIL_INPUT("safetensors '{}': tensor '{}' has dtype {}; only I32 and I64 can be read as int32", source_,
                    t.name, t.dtype);
  }
}

std::vector<int32_t> SafetensorsFile::read_i32(const std::string& name,
                                               const std::vector<int64_t>& expected_shape) const {
  const TensorInfo& t = info(name);
  check_shape(t, expected_shape);
  std::vector<int32_t> out(size_t(t.numel()));
  read_i32_into(t, out.data());
  return out;
}

HostTensor<int32_t> SafetensorsFile::read_i32(const std::string& name) const {
  const TensorInfo& t = info(name);
  HostTensor<int32_t> out{t.shape, std::vector<int32_t>(size_t(t.numel()))};
  read_i32_into(t, out.values.data());
  return out;
}

// ---- writing ------------------------------------------------------------------------------------

// Element count of a shape handed to the writer; throws on negative or overflowing dimensions.
static size_t writer_numel(const std::string& name, const std::vector<int64_t>& shape) {
  const int64_t numel = checked_numel(shape);
  DMOE_REQUIRE_INPUT(numel >= 0, "safetensors writer: tensor '{}': shape {} has a negative or overflowing size", name,
                     shape_string(shape));
  return size_t(numel);
}

void SafetensorsWriter::add(const std::string& name, DType dtype, const std::vector<int64_t>& shape,
                            const void* data) {
  DMOE_REQUIRE_INPUT(name != kMetadataKey, "safetensors writer: '{}' is reserved and cannot name a tensor", name);
  DMOE_REQUIRE_INPUT(!has(name), "safetensors writer: tensor '{}' was already added", name);
  try {
    (void)json(name).dump();  // the header must be valid UTF-8; fail here rather than at write()
  } catch (const json::exception&) {
    DMOE_FAIL_INPUT("safetensors writer: tensor name is not valid UTF-8: '{}'", name);
  }
  size_t nbytes = 0;
  DMOE_REQUIRE_INPUT(!__builtin_mul_overflow(writer_numel(name, shape), dtype_size(dtype), &nbytes),
               "safetensors writer: tensor '{}': shape {} of {} overflows the byte count", name, shape_string(shape),
                     dtype_name(dtype));
  DMOE_REQUIRE_INPUT(data != nullptr || nbytes == 0, "safetensors writer: tensor '{}': data is null", name);
  Entry e{dtype, shape, std::vector<uint8_t>(nbytes)};
  if (nbytes > 0) std::memcpy(e.bytes.data(), data, nbytes);
  tensors_.emplace(name, std::move(e));
}

void SafetensorsWriter::add_f32(const std::string& name, const std::vector<int64_t>& shape, const float* values,
                                DType stored_as) {
  const size_t n = writer_numel(name, shape);
  switch (stored_as) {
    case DType::f32: add(name, DType::f32, shape, values); return;
    case DType::bf16: {
      std::vector<bfloat16> b(n);
      for (size_t i = 0; i < n; ++i) b[i] = float_to_bf16(values[i]);
      add(name, DType::bf16, shape, b.data());
      return;
    }
    case DType::f64: {
      std::vector<double> d(values, values + n);
      add(name, DType::f64, shape, d.data());
      return;
    }
    default: break;
  }
  DMOE_FAIL_INPUT("safetensors writer: tensor '{}': floats cannot be stored as {}; use f32, bf16 or f64", name,
                  dtype_name(stored_as));
}

void SafetensorsWriter::add_f32(const std::string& name, const std::vector<int64_t>& shape,
                                const std::vector<float>& values, DType stored_as) {
  const size_t numel = writer_numel(name, shape);
  DMOE_REQUIRE_INPUT(numel == values.size(), "safetensors writer: tensor '{}': shape {} needs {} values, got {}", name,
                     shape_string(shape), numel, values.size());
  add_f32(name, shape, values.data(), stored_as);
}

void SafetensorsWriter::add_i32(const std::string& name, const std::vector<int64_t>& shape,
                                const std::vector<int32_t>& values) {
  const size_t numel = writer_numel(name, shape);
  DMOE_REQUIRE_INPUT(numel == values.size(), "safetensors writer: tensor '{}': shape {} needs {} values, got {}", name,
                     shape_string(shape), numel, values.size());
  add(name, DType::i32, shape, values.data());
}

void SafetensorsWriter::set_metadata(const std::string& key, const std::string& value) {
  try {
    (void)json(key).dump();
    (void)json(value).dump();
  } catch (const json::exception&) {
    DMOE_FAIL_INPUT("safetensors writer: metadata key or value is not valid UTF-8 (key '{}')", key);
  }
  metadata_[key] = value;
}

std::vector<uint8_t> SafetensorsWriter::serialize() const {
  json header = json::object();
  if (!metadata_.empty()) header[kMetadataKey] = metadata_;
  uint64_t offset = 0;
  for (const auto& [name, e] : tensors_) {  // std::map: name order, so the output is deterministic
    header[name] = {{"dtype", safetensors_dtype_name(e.dtype)},
                    {"shape", e.shape},
                    {"data_offsets", {offset, offset + e.bytes.size()}}};
    offset += e.bytes.size();
  }
  std::string text = header.dump();
  // Pad with spaces so the data region starts 8-byte aligned (8 + len is a multiple of 8).
  text.append((8 - text.size() % 8) % 8, ' ');

  std::vector<uint8_t> out;
  out.reserve(8 + text.size() + offset);
  const uint64_t len = text.size();
  for (int i = 0; i < 8; ++i) out.push_back(uint8_t(len >> (8 * i)));
  out.insert(out.end(), text.begin(), text.end());
  for (const auto& [name, e] : tensors_) out.insert(out.end(), e.bytes.begin(), e.bytes.end());
  return out;
}

void SafetensorsWriter::write(const std::string& path) const {
  write_file_atomically(path, serialize());
}

}  // namespace dmoe
