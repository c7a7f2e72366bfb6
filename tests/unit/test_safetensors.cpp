// test_safetensors.cpp — safetensors round trips, conversions, every corrupt-header case, and a fuzz pass.
//
// Run: dmoe_unit_tests --gtest_filter='Safetensors*'. The fuzz test is deterministic (fixed seeds) and
// kept small enough to run in well under a second under ASan+UBSan.
#include <gtest/gtest.h>

#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "core/error.hpp"
#include "error_test_util.hpp"
#include "core/random.hpp"
#include "model/safetensors.hpp"

namespace dmoe {
namespace {

using test::error_of;

std::string temp_path(const std::string& tag) {
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  return (std::filesystem::temp_directory_path() /
          fmt::format("dmoe_{}_{}_{}_{}.safetensors", info->test_suite_name(), info->name(), getpid(), tag))
      .string();
}

// A file from a hand-written header and `data_size` bytes of data (byte i = i mod 251).
std::vector<uint8_t> make_file(const std::string& header, size_t data_size) {
  std::vector<uint8_t> out;
  const uint64_t n = header.size();
  for (int i = 0; i < 8; ++i) out.push_back(uint8_t(n >> (8 * i)));
  out.insert(out.end(), header.begin(), header.end());
  for (size_t i = 0; i < data_size; ++i) out.push_back(uint8_t(i % 251));
  return out;
}

void set_header_length(std::vector<uint8_t>& bytes, uint64_t n) {
  for (int i = 0; i < 8; ++i) bytes[size_t(i)] = uint8_t(n >> (8 * i));
}

// Parsing must throw dmoe::Error whose message holds every one of `words` (and the source name).
void expect_parse_error(std::vector<uint8_t> bytes, const std::vector<std::string>& words) {
  try {
    SafetensorsFile::parse(std::move(bytes), "bad.safetensors");
    ADD_FAILURE() << "parse succeeded; expected an error containing '" << words.front() << "'";
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("bad.safetensors"), std::string::npos) << msg;
    for (const auto& w : words) EXPECT_NE(msg.find(w), std::string::npos) << "missing '" << w << "' in: " << msg;
  }
}

TEST(SafetensorsTest, RoundTripWithMetadata) {
  const std::vector<float> a = {1.5f, -2.25f, 3.0f, 0.f, -0.f, 1e-3f};
  const std::vector<float> b = {0.1f, 0.2f, -7.75f, 1024.f};
  const std::vector<int32_t> c = {0, -1, 2147483647, -2147483647 - 1, 42};
  const int64_t d[3] = {-5, 1ll << 40, 7};
  const double f[2] = {0.1, -1e300};

  SafetensorsWriter w;
  w.add_f32("layer.a", {2, 3}, a);
  w.add_f32("layer.b", {4}, b, DType::bf16);
  w.add_i32("ids", {5}, c);
  w.add("big", DType::i64, {3}, d);
  w.add("wide", DType::f64, {1, 2}, f);
  w.add_f32("empty", {0, 4}, std::vector<float>{});
  w.add_f32("scalar", {}, std::vector<float>{2.5f});
  w.set_metadata("format", "pt");
  w.set_metadata("note", "héllo");
  const std::string path = temp_path("rt");
  w.write(path);

  const SafetensorsFile file = SafetensorsFile::open(path);
  std::filesystem::remove(path);
  EXPECT_EQ(file.source(), path);
  EXPECT_EQ(file.names(), (std::vector<std::string>{"big", "empty", "ids", "layer.a", "layer.b", "scalar", "wide"}));
  EXPECT_EQ(file.metadata().at("format"), "pt");
  EXPECT_EQ(file.metadata().at("note"), "héllo");

  EXPECT_EQ(file.read_f32("layer.a", {2, 3}), a);
  EXPECT_EQ(file.info("layer.a").dtype, "F32");
  EXPECT_EQ(file.info("layer.b").dtype, "BF16");
  const HostTensor<float> tb = file.read_f32("layer.b");
  EXPECT_EQ(tb.shape, (std::vector<int64_t>{4}));
  for (size_t i = 0; i < b.size(); ++i) EXPECT_EQ(tb.values[i], round_to_bf16(b[i])) << i;
  EXPECT_EQ(file.read_i32("ids", {5}), c);
  EXPECT_EQ(file.info("big").dtype, "I64");
  int64_t big[3];
  std::memcpy(big, file.raw("big").data(), sizeof(big));
  EXPECT_EQ(std::vector<int64_t>(big, big + 3), std::vector<int64_t>(d, d + 3));
  EXPECT_NE(error_of([&] { file.read_i32("big"); }).find("does not fit in int32"), std::string::npos);
  // -1e300 is beyond float: it rounded to -inf, and the callers' finiteness checks then said "is -inf" of a file
  // that holds no inf (twelfth bad-input pass); the read refuses it with the value.
  EXPECT_NE(error_of([&] { file.read_f32("wide", {1, 2}); }).find("tensor 'wide' [0, 1] is -1e+300 (F64), beyond "
                                                                  "float32's range"), std::string::npos);
  EXPECT_TRUE(file.read_f32("empty", {0, 4}).empty());
  EXPECT_EQ(file.info("empty").numel(), 0);
  EXPECT_EQ(file.read_f32("scalar", {}), std::vector<float>{2.5f});
  EXPECT_EQ(file.info("scalar").numel(), 1);
  EXPECT_EQ(file.raw("ids").size(), 20u);
}

TEST(SafetensorsTest, LayoutIsDeterministicAlignedAndContiguous) {
  const std::vector<float> x = {1, 2, 3}, y = {4, 5};
  SafetensorsWriter w1, w2;
  w1.add_f32("x", {3}, x);
  w1.add_f32("y", {2}, y, DType::bf16);
  w2.add_f32("y", {2}, y, DType::bf16);  // other insertion order, same bytes
  w2.add_f32("x", {3}, x);
  const std::vector<uint8_t> bytes = w1.serialize();
  EXPECT_EQ(bytes, w2.serialize());

  uint64_t header_len = 0;
  for (int i = 0; i < 8; ++i) header_len |= uint64_t(bytes[size_t(i)]) << (8 * i);
  EXPECT_EQ(header_len % 8, 0u);
  EXPECT_EQ(bytes.size(), 8 + header_len + 12 + 4);
  const SafetensorsFile file = SafetensorsFile::parse(bytes, "mem");
  EXPECT_EQ(file.info("x").begin, 0u);  // sorted by name: x first, then y right after
  EXPECT_EQ(file.info("x").end, 12u);
  EXPECT_EQ(file.info("y").begin, 12u);
  EXPECT_EQ(file.info("y").end, 16u);
}

TEST(SafetensorsTest, Bf16ConversionIsExactAndRoundsToNearestEven) {
  const float inf = std::numeric_limits<float>::infinity();
  // Exactly representable in bf16: unchanged.
  const std::vector<float> exact = {0.f, -0.f, 1.f, -2.5f, 0.15625f, 3.0f * 0x1p100f, 0x1p-130f, inf, -inf};
  // Halfway cases: 1 + 2^-8 lies between 1 (even) and 1 + 2^-7 (odd) -> 1; 1 + 3*2^-8 lies between
  // 1 + 2^-7 (odd) and 1 + 2^-6 (even) -> 1 + 2^-6; just above half rounds up.
  const std::vector<float> halfway = {1.f + 0x1p-8f, 1.f + 3 * 0x1p-8f, 1.f + 0x1p-8f + 0x1p-20f, -(1.f + 0x1p-8f)};
  const std::vector<float> expected = {1.f, 1.f + 0x1p-6f, 1.f + 0x1p-7f, -1.f};
  SafetensorsWriter w;
  w.add_f32("exact", {int64_t(exact.size())}, exact, DType::bf16);
  w.add_f32("halfway", {int64_t(halfway.size())}, halfway, DType::bf16);
  w.add_f32("nan", {1}, std::vector<float>{std::numeric_limits<float>::quiet_NaN()}, DType::bf16);
  const SafetensorsFile file = SafetensorsFile::parse(w.serialize(), "mem");
  const std::vector<float> got = file.read_f32("exact", {int64_t(exact.size())});
  for (size_t i = 0; i < exact.size(); ++i) {
    EXPECT_EQ(got[i], exact[i]) << i;
    EXPECT_EQ(std::signbit(got[i]), std::signbit(exact[i])) << i;
  }
  EXPECT_EQ(file.read_f32("halfway", {4}), expected);
  EXPECT_TRUE(std::isnan(file.read_f32("nan", {1})[0]));
  // Stored bits are the upper half of the float for exact values.
  const auto raw = file.raw("exact");
  uint16_t bits;
  std::memcpy(&bits, raw.data() + 2 * 3, 2);
  EXPECT_EQ(bits, 0xC020);  // -2.5f = 0xC0200000
}

TEST(SafetensorsTest, ReadsF16F64AndI64) {
  // F16: 1, -2, smallest subnormal 2^-24, max 65504, inf, -0.
  const uint16_t halves[6] = {0x3C00, 0xC000, 0x0001, 0x7BFF, 0x7C00, 0x8000};
  const int64_t longs[3] = {-7, 2147483647, 5};
  const int64_t too_big[2] = {1, 1ll << 31};
  std::string header =
      R"({"h":{"dtype":"F16","shape":[2,3],"data_offsets":[0,12]},)"
      R"("l":{"dtype":"I64","shape":[3],"data_offsets":[16,40]},)"
      R"("t":{"dtype":"I64","shape":[2],"data_offsets":[40,56]},)"
      R"("u":{"dtype":"U8","shape":[4],"data_offsets":[12,16]}})";
  std::vector<uint8_t> bytes = make_file(header, 56);
  std::memcpy(bytes.data() + 8 + header.size(), halves, 12);
  std::memcpy(bytes.data() + 8 + header.size() + 16, longs, 24);
  std::memcpy(bytes.data() + 8 + header.size() + 40, too_big, 16);
  const SafetensorsFile file = SafetensorsFile::parse(bytes, "mem");

  const std::vector<float> h = file.read_f32("h", {2, 3});
  EXPECT_EQ(h[0], 1.f);
  EXPECT_EQ(h[1], -2.f);
  EXPECT_EQ(h[2], 0x1p-24f);
  EXPECT_EQ(h[3], 65504.f);
  EXPECT_EQ(h[4], std::numeric_limits<float>::infinity());
  EXPECT_TRUE(h[5] == 0.f && std::signbit(h[5]));
  EXPECT_EQ(file.read_i32("l", {3}), (std::vector<int32_t>{-7, 2147483647, 5}));

  std::string msg = error_of([&] { file.read_i32("t", {2}); });
  EXPECT_NE(msg.find("'t'"), std::string::npos) << msg;
  EXPECT_NE(msg.find("2147483648"), std::string::npos) << msg;
  msg = error_of([&] { file.read_f32("u", {4}); });
  EXPECT_NE(msg.find("U8"), std::string::npos) << msg;
  msg = error_of([&] { file.read_i32("h", {2, 3}); });
  EXPECT_NE(msg.find("F16"), std::string::npos) << msg;
  // A known but unreadable dtype still opens, and its raw bytes are available.
  EXPECT_EQ(file.raw("u").size(), 4u);
}

TEST(SafetensorsTest, ShapeMismatchAndMissingNamesAreExplained) {
  SafetensorsWriter w;
  w.add_f32("model.layers.0.mlp.weight", {2, 3}, std::vector<float>(6, 1.f));
  w.add_f32("model.layers.0.attn.weight", {2}, std::vector<float>(2, 1.f));
  w.add_f32("other", {1}, std::vector<float>(1, 1.f));
  const SafetensorsFile file = SafetensorsFile::parse(w.serialize(), "ckpt.safetensors");

  std::string msg = error_of([&] { file.read_f32("model.layers.0.mlp.weight", {3, 2}); });
  EXPECT_NE(msg.find("model.layers.0.mlp.weight"), std::string::npos) << msg;
  EXPECT_NE(msg.find("shape [2, 3], expected [3, 2]"), std::string::npos) << msg;
  EXPECT_NE(msg.find("ckpt.safetensors"), std::string::npos) << msg;

  msg = error_of([&] { file.info("model.layers.0.mlp.wieght"); });
  EXPECT_NE(msg.find("no tensor 'model.layers.0.mlp.wieght'"), std::string::npos) << msg;
  EXPECT_NE(msg.find("closest: 'model.layers.0.mlp.weight'"), std::string::npos) << msg;
  EXPECT_FALSE(file.has("nope"));
  EXPECT_TRUE(file.has("other"));
}

TEST(SafetensorsTest, WriterRejectsBadInput) {
  SafetensorsWriter w;
  w.add_f32("a", {2}, std::vector<float>{1, 2});
  EXPECT_NE(error_of([&] { w.add_f32("a", {2}, std::vector<float>{1, 2}); }).find("already added"), std::string::npos);
  EXPECT_NE(error_of([&] { w.add_f32("__metadata__", {1}, std::vector<float>{1}); }).find("reserved"),
            std::string::npos);
  EXPECT_NE(error_of([&] { w.add_f32("b", {3}, std::vector<float>{1, 2}); }).find("needs 3 values, got 2"),
            std::string::npos);
  EXPECT_NE(error_of([&] { w.add_f32("c", {-1}, std::vector<float>{}); }).find("negative"), std::string::npos);
  EXPECT_NE(error_of([&] { w.add_f32("d", {1}, std::vector<float>{1}, DType::i32); }).find("cannot be stored"),
            std::string::npos);
  EXPECT_NE(error_of([&] { w.add_f32(std::string("\xff\xfe", 2), {1}, std::vector<float>{1}); }).find("UTF-8"),
            std::string::npos);
  EXPECT_EQ(w.size(), 1u);
  const std::string msg = error_of([&] { w.write("/nonexistent-dir/x.safetensors"); });
  EXPECT_NE(msg.find("/nonexistent-dir/x.safetensors"), std::string::npos) << msg;
}

TEST(SafetensorsTest, OpenMissingFileNamesIt) {
  const std::string msg = error_of([] { SafetensorsFile::open("/no/such/file.safetensors"); });
  EXPECT_NE(msg.find("/no/such/file.safetensors"), std::string::npos) << msg;
}

TEST(SafetensorsTest, CorruptFilesAreRejectedWithClearErrors) {
  const std::string ok_entry = R"("a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]})";
  // Sanity: the base case parses.
  EXPECT_NO_THROW(SafetensorsFile::parse(make_file("{" + ok_entry + "}", 8), "ok"));

  expect_parse_error({1, 2, 3, 4, 5}, {"5 bytes", "shorter than the 8-byte"});
  expect_parse_error({}, {"0 bytes"});
  {
    std::vector<uint8_t> b = make_file("{" + ok_entry + "}", 8);
    set_header_length(b, b.size());  // one past the end
    expect_parse_error(b, {"larger than the file", "truncated"});
    set_header_length(b, uint64_t(1) << 40);
    expect_parse_error(b, {"absurd"});
    set_header_length(b, std::numeric_limits<uint64_t>::max());
    expect_parse_error(b, {"absurd"});
  }
  expect_parse_error(make_file("{\"a\":", 0), {"not valid JSON"});
  expect_parse_error(make_file("", 0), {"not valid JSON"});
  expect_parse_error(make_file("{} trailing", 0), {"not valid JSON"});
  expect_parse_error(make_file("[1, 2]", 0), {"not a JSON object", "array"});
  expect_parse_error(make_file(R"({"a": 5})", 0), {"'a'", "not an object"});
  expect_parse_error(make_file(R"({"a":{"shape":[2],"data_offsets":[0,8]}})", 8), {"'a'", "no dtype"});
  expect_parse_error(make_file(R"({"a":{"dtype":4,"shape":[2],"data_offsets":[0,8]}})", 8),
                     {"dtype must be a string"});
  expect_parse_error(make_file(R"({"a":{"dtype":"F128","shape":[2],"data_offsets":[0,8]}})", 8),
                     {"unknown dtype 'F128'", "allowed", "BF16", "F32"});
  expect_parse_error(make_file(R"({"a":{"dtype":"F32","data_offsets":[0,8]}})", 8), {"no shape"});
  expect_parse_error(make_file(R"({"a":{"dtype":"F32","shape":"2","data_offsets":[0,8]}})", 8),
                     {"shape must be an array"});
  expect_parse_error(make_file(R"({"a":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})", 8),
                     {"non-negative integers"});
  expect_parse_error(make_file(R"({"a":{"dtype":"F32","shape":[2.0],"data_offsets":[0,8]}})", 8),
                     {"non-negative integers"});
  expect_parse_error(
      make_file(R"({"a":{"dtype":"F32","shape":[4294967296,4294967296,4],"data_offsets":[0,8]}})", 8),
      {"overflows"});
  expect_parse_error(
      make_file(R"({"a":{"dtype":"F64","shape":[4294967296,2147483648],"data_offsets":[0,8]}})", 8),
      {"overflows"});
  expect_parse_error(make_file(R"({"a":{"dtype":"F32","shape":[2]}})", 8), {"no data_offsets"});
  expect_parse_error(make_file(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[8]}})", 8),
                     {"data_offsets must be an array [begin, end]"});
  expect_parse_error(make_file(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[-1,8]}})", 8),
                     {"non-negative integers"});
  expect_parse_error(make_file(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[8,0]}})", 8),
                     {"begin 8 > end 0"});
  expect_parse_error(make_file(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", 7),
                     {"beyond the data region", "7 bytes"});
  expect_parse_error(
      make_file(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,18446744073709551615]}})", 8),
      {"beyond the data region"});
  expect_parse_error(make_file(R"({"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", 16),
                     {"byte size 8 does not match shape [3] of F32 (12 bytes)"});
  expect_parse_error(make_file("{" + ok_entry + "," + ok_entry + "}", 8), {"duplicate tensor name 'a'"});
  expect_parse_error(make_file(R"({"a":{"dtype":"F32","dtype":"I32","shape":[2],"data_offsets":[0,8]}})", 8),
                     {"duplicate key 'dtype'"});
  expect_parse_error(make_file("{" + ok_entry + R"(,"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})", 12),
                     {"'a' [0, 8)", "'b' [4, 12)", "overlap"});
  expect_parse_error(make_file(R"({"__metadata__":[1]})", 0), {"__metadata__ must be an object"});
  expect_parse_error(make_file(R"({"__metadata__":{"k":1}})", 0), {"'k' must be a string"});
  expect_parse_error(make_file("{\"\xff\":1}", 0), {"not valid JSON"});  // invalid UTF-8
  // Padding is spaces (0x20): NUL bytes after the JSON (nlohmann's lexer stopped at the first, so they were taken, and
  // so was anything after one) are refused with the file offset. The header below is 54 bytes; its NUL at 54 + 8.
  {
    const std::string whole = "{" + ok_entry + "}";
    ASSERT_EQ(whole.size(), 54u);
    expect_parse_error(make_file(whole + std::string(10, '\0'), 8),
                       {"byte 62 of the file", "byte 54 of the 64-byte header", "NUL (0x00)", "spaces (0x20)"});
    expect_parse_error(make_file(whole + std::string(1, '\0') + "garbage", 8), {"byte 62 of the file"});
    expect_parse_error(make_file(std::string("{\"a\0b\":1}", 9), 0), {"byte 11 of the file", "NUL"});
    expect_parse_error(make_file(std::string(1, '\0') + whole, 8), {"byte 8 of the file"});
  }
}

// Sixth bad-input pass (docs/faults.md, 2026-12-03): a header nesting 100000 arrays crashed the error message
// (describe() -> json::dump recursing once per level: SIGSEGV); nesting is refused at 128 levels as it is parsed.
TEST(SafetensorsTest, DeepNestingIsRefusedBeforeItCanCrashTheMessage) {
  const std::string ok_entry = R"("a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]})";
  const auto nested = [](size_t levels) { return std::string(levels, '[') + std::string(levels, ']'); };
  expect_parse_error(make_file("{" + ok_entry + ",\"z\":" + nested(100000) + "}", 8),
                     {"nest deeper than 128 levels", "object of tensor entries"});
  expect_parse_error(make_file("{" + ok_entry + ",\"__metadata__\":{\"k\":" + nested(200) + "}}", 8),
                     {"nest deeper than 128 levels"});
  // 128 levels (the object and 127 arrays) are parsed, and the entry is then refused for what it is.
  expect_parse_error(make_file("{" + ok_entry + ",\"z\":" + nested(127) + "}", 8), {"'z'", "not an object"});
}

// Sixth bad-input pass: json::parse with a callback (how duplicate keys were found) rescans the parent object at the
// end of every entry, so a header of n entries took O(n^2): 40000 tensors 23-41 s, 200000 past any time limit.
TEST(SafetensorsTest, ManyTensorsParseInLinearTime) {
  std::string header = R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]})";
  for (int i = 0; i < 50000; ++i)
    header += fmt::format(R"(,"t{}":{{"dtype":"U8","shape":[1],"data_offsets":[{},{}]}})", i, 8 + i, 9 + i);
  header += "}";
  const auto start = std::chrono::steady_clock::now();
  const SafetensorsFile f = SafetensorsFile::parse(make_file(header, 8 + 50000), "many.safetensors");
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_EQ(f.names().size(), 50001u);
  EXPECT_LT(seconds, 10.0) << "50000 entries (0.2 s in a release build; ~60 s when quadratic)";
}

TEST(SafetensorsTest, HeaderLengthShortOfItsPaddingAndAByteOrderMarkAreNamed) {
  // A length field 1-3 bytes short, cutting into the header's padding spaces, parsed and then read every tensor
  // shifted: refused only as "weights must be finite" later, or not at all (seventh bad-input pass).
  const std::string header = R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})" + std::string(5, ' ');
  for (uint64_t short_by = 1; short_by <= 3; ++short_by) {
    std::vector<uint8_t> b = make_file(header, 8);
    set_header_length(b, header.size() - short_by);
    expect_parse_error(b, {"header length field says " + std::to_string(header.size() - short_by) + " bytes",
                           "starts with " + std::to_string(short_by) + " space(s)",
                           "it would be " + std::to_string(header.size()) + ")"});
  }
  // A UTF-8 byte-order mark before the JSON (nlohmann skipped it; the reference reader refuses it).
  expect_parse_error(make_file("\xEF\xBB\xBF" + header, 8), {"byte-order mark"});
  // The right length, and trailing bytes that are not the header's spaces, still parse.
  EXPECT_NO_THROW(SafetensorsFile::parse(make_file(header, 8), "ok"));
  EXPECT_NO_THROW(SafetensorsFile::parse(make_file(header, 11), "trailing"));
}

TEST(SafetensorsTest, HolesAndEmptyTensorsAreAccepted) {
  // A gap between tensors, trailing bytes, empty tensors at any offset, padding spaces.
  const std::string header =
      R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)"
      R"("b":{"dtype":"BF16","shape":[2],"data_offsets":[8,12]},)"
      R"("e":{"dtype":"F32","shape":[0,5],"data_offsets":[2,2]},)"
      R"("f":{"dtype":"F32","shape":[0],"data_offsets":[2,2]}}     )";
  const SafetensorsFile file = SafetensorsFile::parse(make_file(header, 32), "holes");
  EXPECT_EQ(file.size(), 4u);
  EXPECT_TRUE(file.read_f32("e", {0, 5}).empty());
  EXPECT_TRUE(file.metadata().empty());
}

// ---- fuzz -----------------------------------------------------------------------------------------

// Parses bytes and, when that works, reads every tensor both ways. Anything but success or dmoe::Error
// is a failure. Returns whether the parse succeeded.
bool parse_survives(const std::vector<uint8_t>& bytes, const char* what, size_t case_idx) {
  try {
    const SafetensorsFile file = SafetensorsFile::parse(bytes, "fuzz");
    for (const std::string& name : file.names()) {
      try {
        (void)file.read_f32(name);
      } catch (const Error&) {
      }
      try {
        (void)file.read_i32(name);
      } catch (const Error&) {
      }
    }
    return true;
  } catch (const Error&) {
    return false;
  } catch (const std::exception& e) {
    ADD_FAILURE() << what << " case " << case_idx << ": non-dmoe exception: " << e.what();
  } catch (...) {
    ADD_FAILURE() << what << " case " << case_idx << ": unknown exception";
  }
  return false;
}

std::vector<uint8_t> fuzz_base() {
  SafetensorsWriter w;
  w.add_f32("w", {2, 3}, std::vector<float>{1, 2, 3, 4, 5, 6});
  w.add_f32("b", {4}, std::vector<float>{1, -1, 0.5f, 2}, DType::bf16);
  w.add_i32("i", {3}, std::vector<int32_t>{1, 2, 3});
  const int64_t longs[2] = {5, -5};
  w.add("l", DType::i64, {2}, longs);
  w.set_metadata("format", "pt");
  return w.serialize();
}

TEST(SafetensorsFuzz, MutationsEitherParseOrThrowDmoeError) {
  const std::vector<uint8_t> base = fuzz_base();
  ASSERT_TRUE(parse_survives(base, "base", 0));
  Rng rng(20240611);
  size_t parsed = 0, rejected = 0;
  auto run = [&](const std::vector<uint8_t>& bytes, const char* what, size_t idx) {
    (parse_survives(bytes, what, idx) ? parsed : rejected)++;
  };

  // Truncation at every length.
  for (size_t len = 0; len < base.size(); ++len)
    run(std::vector<uint8_t>(base.begin(), base.begin() + long(len)), "truncate", len);

  // Byte flips, mostly in the header, with characters that matter to JSON half of the time.
  const std::string interesting = "{}[]\":,-0123456789eE.\\ ";
  for (size_t c = 0; c < 2000; ++c) {
    std::vector<uint8_t> b = base;
    const int flips = 1 + int(rng.next() % 4);
    for (int f = 0; f < flips; ++f) {
      const size_t pos = rng.next() % 2 ? rng.next() % b.size() : 8 + rng.next() % (b.size() - 8);
      b[pos] = rng.next() % 2 ? uint8_t(rng.next()) : uint8_t(interesting[rng.next() % interesting.size()]);
    }
    run(b, "flip", c);
  }

  // Header length overwritten: random, near the true value, and extreme.
  const uint64_t extremes[] = {0,
                               1,
                               7,
                               SafetensorsFile::kMaxHeaderBytes,
                               SafetensorsFile::kMaxHeaderBytes + 1,
                               uint64_t(1) << 63,
                               std::numeric_limits<uint64_t>::max(),
                               std::numeric_limits<uint64_t>::max() - 7};
  for (size_t c = 0; c < 600; ++c) {
    std::vector<uint8_t> b = base;
    uint64_t n;
    if (c < std::size(extremes)) n = extremes[c];
    else if (c % 2) n = rng.next() >> (rng.next() % 64);
    else n = rng.next() % (b.size() + 16);
    set_header_length(b, n);
    run(b, "length", c);
  }

  // Garbage JSON from header-like tokens.
  const char* tokens[] = {"{", "}", "[", "]", ":", ",", "\"a\"", "\"b\"", "\"dtype\"", "\"shape\"",
                          "\"data_offsets\"", "\"__metadata__\"", "\"F32\"", "\"BF16\"", "\"I64\"", "\"U8\"",
                          "0", "4", "8", "-1", "1e400", "2.5", "18446744073709551615", "18446744073709551616",
                          "9223372036854775808", "null", "true", "\"\\u0000\"", "\"\\ud800\"", " "};
  for (size_t c = 0; c < 1000; ++c) {
    std::string header;
    const size_t count = 1 + rng.next() % 40;
    for (size_t t = 0; t < count; ++t) header += tokens[rng.next() % std::size(tokens)];
    run(make_file(header, rng.next() % 64), "garbage", c);
  }

  // Structurally plausible headers with random dtypes, shapes and offsets: exercises the validation.
  const char* dtypes[] = {"F32", "BF16", "F16", "F64", "I32", "I64", "U8", "BOOL", "F128", ""};
  const int64_t dims[] = {0, 1, 2, 3, 4, -1, 1ll << 31, 1ll << 62, std::numeric_limits<int64_t>::max()};
  for (size_t c = 0; c < 1000; ++c) {
    std::string header = "{";
    const size_t entries = 1 + rng.next() % 3;
    for (size_t e = 0; e < entries; ++e) {
      std::string shape;
      const size_t rank = rng.next() % 4;
      for (size_t r = 0; r < rank; ++r) shape += fmt::format("{}{}", r ? "," : "", dims[rng.next() % std::size(dims)]);
      const uint64_t begin = rng.next() % 40, end = rng.next() % 8 == 0 ? rng.next() : begin + rng.next() % 40;
      header += fmt::format(R"({}"t{}":{{"dtype":"{}","shape":[{}],"data_offsets":[{},{}]}})", e ? "," : "",
                            rng.next() % 3, dtypes[rng.next() % std::size(dtypes)], shape, begin, end);
    }
    header += "}";
    run(make_file(header, rng.next() % 96), "structured", c);
  }

  // Both outcomes must have occurred, or the fuzzing is not exercising anything.
  EXPECT_GT(parsed, 50u);
  EXPECT_GT(rejected, 1000u);
}

}  // namespace
}  // namespace dmoe
