// fd_util.hpp — helpers shared by the unit tests: element-wise comparison with a printed report (within a
// tolerance, or bit for bit), and central finite differences of a scalar loss w.r.t. a float buffer.
//
// Finite differences: an element is perturbed in float by ±step and the denominator is the difference of
// the two float values actually stored; the loss is evaluated (and differenced) in fp64.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>

namespace dmoe::test {

// Bit-for-bit equality, with the index and values of the first difference.
template <typename T>
void expect_identical(const std::vector<T>& a, const std::vector<T>& b, const std::string& what) {
  ASSERT_EQ(a.size(), b.size()) << what;
  for (size_t i = 0; i < a.size(); ++i)
    ASSERT_EQ(std::memcmp(&a[i], &b[i], sizeof(T)), 0) << what << " differs at " << i << ": " << a[i] << " vs " << b[i];
}

// |got − want| <= atol + rtol·|want| element-wise; on failure prints max abs/rel error and the first misses.
inline void expect_close(const std::string& what, const std::vector<double>& got, const std::vector<double>& want,
                         double atol, double rtol) {
  ASSERT_EQ(got.size(), want.size()) << what;
  double max_abs = 0, max_rel = 0;
  std::string first;
  int bad = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double err = std::abs(got[i] - want[i]);
    max_abs = std::max(max_abs, err);
    if (std::abs(want[i]) > atol) max_rel = std::max(max_rel, err / std::abs(want[i]));
    if (!(err <= atol + rtol * std::abs(want[i]))) {
      if (bad < 5) first += fmt::format("\n  [{}] got {:.9g} want {:.9g}", i, got[i], want[i]);
      ++bad;
    }
  }
  EXPECT_EQ(bad, 0) << fmt::format("{}: {} of {} out of tolerance (atol {:.3g}, rtol {:.3g}); max abs err "
                                   "{:.3g}, max rel err {:.3g}{}",
                                   what, bad, got.size(), atol, rtol, max_abs, max_rel, first);
}

inline std::vector<double> to_double(const std::vector<float>& v) { return {v.begin(), v.end()}; }

// Central difference of loss() w.r.t. param[i] for every i in `indices` (all elements when empty).
inline std::vector<double> numeric_grad(float* param, size_t size, float step, const std::function<double()>& loss,
                                        const std::vector<size_t>& indices = {}) {
  std::vector<size_t> idx = indices;
  if (idx.empty())
    for (size_t i = 0; i < size; ++i) idx.push_back(i);
  std::vector<double> grad(idx.size());
  for (size_t n = 0; n < idx.size(); ++n) {
    float& x = param[idx[n]];
    const float saved = x, up = saved + step, down = saved - step;
    x = up;
    const double loss_up = loss();
    x = down;
    const double loss_down = loss();
    x = saved;
    grad[n] = (loss_up - loss_down) / (double(up) - double(down));
  }
  return grad;
}
inline std::vector<double> numeric_grad(std::vector<float>& param, float step, const std::function<double()>& loss) {
  return numeric_grad(param.data(), param.size(), step, loss);
}

// Σ a·b in fp64.
inline double dot(const std::vector<float>& a, const std::vector<float>& b) {
  double s = 0;
  for (size_t i = 0; i < a.size(); ++i) s += double(a[i]) * double(b[i]);
  return s;
}

}  // namespace dmoe::test
