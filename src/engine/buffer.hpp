// buffer.hpp — Buffer: grow-only memory owned by a Backend (host for the CPU backend, device for CUDA).
#pragma once

#include <cstddef>
#include <utility>

#include "engine/backend.hpp"

namespace dmoe {

class Buffer {
 public:
  Buffer() = default;
  explicit Buffer(Backend& backend) : backend_(&backend) {}
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  Buffer(Buffer&& o) noexcept { *this = std::move(o); }
  Buffer& operator=(Buffer&& o) noexcept {
    if (this != &o) {
      reset();
      backend_ = o.backend_;
      data_ = std::exchange(o.data_, nullptr);
      bytes_ = std::exchange(o.bytes_, 0);
    }
    return *this;
  }
  ~Buffer() { reset(); }

  void bind(Backend& backend) { backend_ = &backend; }
  // Makes the buffer at least `bytes` long. Contents are not kept when it grows.
  // Never returns null: an empty request still gets a small allocation, so kernels and collectives
  // see valid pointers when a rank has no rows.
  void* ensure(size_t bytes) {
    if (bytes < 256) bytes = 256;
    if (bytes > bytes_) {
      reset();
      data_ = backend_->allocate(bytes);
      bytes_ = bytes;
    }
    return data_;
  }
  void reset() {
    if (data_) backend_->release(data_);
    data_ = nullptr;
    bytes_ = 0;
  }
  void* data() const { return data_; }
  size_t bytes() const { return bytes_; }
  template <typename T>
  T* as() const { return static_cast<T*>(data_); }

 private:
  Backend* backend_ = nullptr;
  void* data_ = nullptr;
  size_t bytes_ = 0;
};

}  // namespace dmoe
