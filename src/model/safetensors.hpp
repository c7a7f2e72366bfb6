// safetensors.hpp — read and write the safetensors tensor file format (the Hugging Face format).
//
// Layout: u64 little-endian N | N bytes of UTF-8 JSON header | data region. The header maps each tensor
// name to {"dtype": "F32"|"BF16"|…, "shape": [..], "data_offsets": [begin, end]} (byte offsets into the
// data region) and may hold "__metadata__": {str: str}.
//
// Reading validates the whole header before any tensor is touched, so a truncated, corrupt or hostile
// file is a dmoe::Error naming the file and the problem — never a crash, a hang or a huge allocation.
// Writing is deterministic: tensors sorted by name, contiguous, header padded to a multiple of 8 bytes.
#pragma once

#include <cstdint>
#include <map>
#include <span>
#include <string>
#include <vector>

#include "core/dtype.hpp"

namespace dmoe {

// One tensor of a safetensors file, as its header describes it.
struct TensorInfo {
  std::string name;
  std::string dtype;            // safetensors spelling: "F32", "BF16", "I64", …
  std::vector<int64_t> shape;   // empty = scalar (one element)
  uint64_t begin = 0;           // byte range [begin, end) in the data region
  uint64_t end = 0;

  int64_t numel() const;
  uint64_t nbytes() const { return end - begin; }
};

// Values read from a file together with their shape (row-major).
template <typename T>
struct HostTensor {
  std::vector<int64_t> shape;
  std::vector<T> values;
};

// Bytes per element of a safetensors dtype name; 0 when the name is unknown.
size_t safetensors_dtype_size(const std::string& dtype);
// The safetensors spelling of a dmoe DType: f32 -> "F32", bf16 -> "BF16", …
const char* safetensors_dtype_name(DType t);
// "[2, 3]" — for error messages.
std::string shape_string(const std::vector<int64_t>& shape);

class SafetensorsFile {
 public:
  // Header lengths above this are rejected before anything is allocated for the header.
  static constexpr uint64_t kMaxHeaderBytes = 100ull << 20;

  // Reads the whole file into memory and parses it; errors name `path`.
  static SafetensorsFile open(const std::string& path);
  // Parses bytes already in memory; errors name `source_name`.
  static SafetensorsFile parse(std::vector<uint8_t> bytes, std::string source_name);

  const std::string& source() const { return source_; }
  size_t size() const { return tensors_.size(); }
  uint64_t file_bytes() const { return bytes_.size(); }  // the whole file as read
  uint64_t data_start() const { return data_start_; }    // 8 + the header's length: where the data region begins
  bool has(const std::string& name) const { return tensors_.count(name) != 0; }
  // Throws, listing the closest available names, when there is no tensor `name`.
  const TensorInfo& info(const std::string& name) const;
  std::vector<std::string> names() const;  // sorted
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  // The stored bytes of a tensor (little-endian, unaligned).
  std::span<const uint8_t> raw(const std::string& name) const;

  // F32, BF16, F16 or F64 converted to float. The shape must equal expected_shape; the error names the
  // tensor, the expected and the found shape. A finite F64 value beyond float's range is an input error naming it
  // (it would be inf); F64 values just past FLT_MAX that round to it are taken.
  std::vector<float> read_f32(const std::string& name, const std::vector<int64_t>& expected_shape) const;
  HostTensor<float> read_f32(const std::string& name) const;
  // As read_f32, into out[0 .. numel) (saves a copy when filling a bigger buffer).
  void read_f32_into(const std::string& name, const std::vector<int64_t>& expected_shape, float* out) const;

  // I32, or I64 whose values all fit in int32.
  std::vector<int32_t> read_i32(const std::string& name, const std::vector<int64_t>& expected_shape) const;
  HostTensor<int32_t> read_i32(const std::string& name) const;

 private:
  void check_shape(const TensorInfo& t, const std::vector<int64_t>& expected_shape) const;
  const uint8_t* data_of(const TensorInfo& t) const { return bytes_.data() + data_start_ + t.begin; }
  void read_i32_into(const TensorInfo& t, int32_t* out) const;

  std::string source_;
  std::vector<uint8_t> bytes_;  // the whole file
  uint64_t data_start_ = 0;     // 8 + header length
  std::map<std::string, TensorInfo> tensors_;
  std::map<std::string, std::string> metadata_;
};

// Collects tensors in memory, then writes one safetensors file.
// The file's tensor names joined by ", " for an error message; "none (the file holds no tensors)" when empty (the
// message ended in "tensors present: " and nothing).
std::string tensor_list(const SafetensorsFile& file);

class SafetensorsWriter {
 public:
  // Copies numel(shape) elements of `dtype` from data. Rejects duplicate names, "__metadata__", negative
  // dimensions and names that are not valid UTF-8.
  void add(const std::string& name, DType dtype, const std::vector<int64_t>& shape, const void* data);
  // Stores float values as stored_as (f32, bf16 rounded to nearest even, or f64).
  void add_f32(const std::string& name, const std::vector<int64_t>& shape, const float* values,
               DType stored_as = DType::f32);
  void add_f32(const std::string& name, const std::vector<int64_t>& shape, const std::vector<float>& values,
               DType stored_as = DType::f32);
  void add_i32(const std::string& name, const std::vector<int64_t>& shape, const std::vector<int32_t>& values);
  void set_metadata(const std::string& key, const std::string& value);

  bool has(const std::string& name) const { return tensors_.count(name) != 0; }
  size_t size() const { return tensors_.size(); }

  // The complete file: length, padded header, tensors in name order with contiguous offsets.
  std::vector<uint8_t> serialize() const;
  // Writes serialize() with write_file_atomically (core/output_file.hpp: temporary + rename, every write
  // checked, only regular files replaced).
  void write(const std::string& path) const;

 private:
  struct Entry {
    DType dtype;
    std::vector<int64_t> shape;
    std::vector<uint8_t> bytes;
  };
  std::map<std::string, Entry> tensors_;
  std::map<std::string, std::string> metadata_;
};

}  // namespace dmoe
