// tuner.cpp — Gaussian process, expected improvement and the (Sp, R) tuner (formulas in tuner.hpp).
#include "flow/tuner.hpp"

#include <algorithm>
#include <cmath>

#include "core/error.hpp"
#include "core/random.hpp"

namespace dmoe::flow {

namespace {
constexpr double kSqrt5 = 2.23606797749978969641;
constexpr double kLog2Pi = 1.83787706640934548356;  // log(2π)
}  // namespace

double matern52(double r) { return (1.0 + kSqrt5 * r + 5.0 / 3.0 * r * r) * std::exp(-kSqrt5 * r); }

double expected_improvement(double mean, double stddev, double best, double xi) {
  const double improvement = best - mean - xi;
  if (!(stddev > 1e-12)) return std::max(0.0, improvement);
  const double z = improvement / stddev;
  const double cdf = 0.5 * std::erfc(-z / std::sqrt(2.0));
  const double pdf = std::exp(-0.5 * z * z) / std::sqrt(2.0 * M_PI);
  return std::max(0.0, improvement * cdf + stddev * pdf);
}

// ---- Gaussian process -----------------------------------------------------------------------------------

double GaussianProcess::kernel(const std::vector<double>& a, const std::vector<double>& b, const GpHyper& h) const {
  double r2 = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    const double d = (a[i] - b[i]) / h.length[i];
    r2 += d * d;
  }
  return h.signal_var * matern52(std::sqrt(r2));
}

bool GaussianProcess::factor(const GpHyper& h) {
  const size_t n = x_.size();
  std::vector<double> L(n * n, 0.0);
  for (size_t i = 0; i < n; ++i)
    for (size_t j = 0; j <= i; ++j) {
      double s = kernel(x_[i], x_[j], h) + (i == j ? h.noise_var : 0.0);
      for (size_t k = 0; k < j; ++k) s -= L[i * n + k] * L[j * n + k];
      if (i == j) {
        if (!(s > 0)) return false;
        L[i * n + i] = std::sqrt(s);
      } else {
        L[i * n + j] = s / L[j * n + j];
      }
    }
  // alpha = L⁻ᵀ L⁻¹ y
  std::vector<double> z(n), a(n);
  for (size_t i = 0; i < n; ++i) {
    double s = y_[i];
    for (size_t k = 0; k < i; ++k) s -= L[i * n + k] * z[k];
    z[i] = s / L[i * n + i];
  }
  for (size_t i = n; i-- > 0;) {
    double s = z[i];
    for (size_t k = i + 1; k < n; ++k) s -= L[k * n + i] * a[k];
    a[i] = s / L[i * n + i];
  }
  double quad = 0, logdet = 0;
  for (size_t i = 0; i < n; ++i) {
    quad += y_[i] * a[i];
    logdet += std::log(L[i * n + i]);
  }
  hyper_ = h;
  chol_ = std::move(L);
  alpha_ = std::move(a);
  lml_ = -0.5 * quad - logdet - 0.5 * double(n) * kLog2Pi;
  return true;
}

void GaussianProcess::fit_fixed(const std::vector<std::vector<double>>& x, const std::vector<double>& y,
                                const GpHyper& hyper) {
  DMOE_REQUIRE(!x.empty() && x.size() == y.size(), "GP: {} points and {} values (need the same number, >= 1)",
               x.size(), y.size());
  const size_t d = x[0].size();
  DMOE_REQUIRE(d >= 1 && hyper.length.size() == d, "GP: points of dimension {} and {} length scales", d,
               hyper.length.size());
  for (size_t i = 0; i < x.size(); ++i) {
    DMOE_REQUIRE(x[i].size() == d, "GP: point {} has dimension {}, the first {}", i, x[i].size(), d);
    DMOE_REQUIRE(std::isfinite(y[i]), "GP: value {} is {} (must be finite)", i, y[i]);
  }
  for (double l : hyper.length) DMOE_REQUIRE(l > 0, "GP: length scale {} (must be > 0)", l);
  DMOE_REQUIRE(hyper.signal_var > 0 && hyper.noise_var >= 0, "GP: signal variance {} (> 0), noise variance {} (>= 0)",
               hyper.signal_var, hyper.noise_var);
  x_ = x;
  double mean = 0, var = 0;
  for (double v : y) mean += v;
  mean /= double(y.size());
  for (double v : y) var += (v - mean) * (v - mean);
  var /= double(y.size());
  y_mean_ = mean;
  y_scale_ = var > 1e-24 ? std::sqrt(var) : 1.0;
  y_.resize(y.size());
  for (size_t i = 0; i < y.size(); ++i) y_[i] = (y[i] - y_mean_) / y_scale_;
  if (factor(hyper)) return;
  GpHyper jittered = hyper;  // duplicate points with no noise: add the least jitter that factors
  for (double jitter = 1e-10; jitter <= 1e-2; jitter *= 10) {
    jittered.noise_var = hyper.noise_var + jitter;
    if (factor(jittered)) return;
  }
  DMOE_FAIL("GP: the kernel matrix is not positive definite even with jitter 1e-2");
}

void GaussianProcess::fit(const std::vector<std::vector<double>>& x, const std::vector<double>& y,
                          const GpHyperGrid& grid) {
  DMOE_REQUIRE(!x.empty(), "GP: no points to fit");
  DMOE_REQUIRE(!grid.length.empty() && !grid.signal_var.empty() && !grid.noise_var.empty(),
               "GP: the hyperparameter grid has an empty list");
  const size_t d = x[0].size();
  GpHyper best;
  double best_lml = -INFINITY;
  std::vector<size_t> idx(d, 0);  // a counter over length^d
  for (bool more = true; more;) {
    GpHyper h;
    for (size_t i = 0; i < d; ++i) h.length.push_back(grid.length[idx[i]]);
    for (double s : grid.signal_var)
      for (double nv : grid.noise_var) {
        h.signal_var = s;
        h.noise_var = nv;
        fit_fixed(x, y, h);
        if (lml_ > best_lml) {
          best_lml = lml_;
          best = hyper_;
        }
      }
    more = false;
    for (size_t i = 0; i < d && !more; ++i) {
      if (++idx[i] < grid.length.size()) more = true;
      else idx[i] = 0;
    }
  }
  fit_fixed(x, y, best);
}

GaussianProcess::Prediction GaussianProcess::predict(const std::vector<double>& x) const {
  DMOE_REQUIRE(!x_.empty(), "GP: predict before fit");
  DMOE_REQUIRE(x.size() == x_[0].size(), "GP: point of dimension {}, the model's is {}", x.size(), x_[0].size());
  const size_t n = x_.size();
  std::vector<double> k(n), v(n);
  double mean = 0;
  for (size_t i = 0; i < n; ++i) {
    k[i] = kernel(x, x_[i], hyper_);
    mean += k[i] * alpha_[i];
  }
  double vv = 0;
  for (size_t i = 0; i < n; ++i) {
    double s = k[i];
    for (size_t j = 0; j < i; ++j) s -= chol_[i * n + j] * v[j];
    v[i] = s / chol_[i * n + i];
    vv += v[i] * v[i];
  }
  return {y_mean_ + y_scale_ * mean, std::max(0.0, hyper_.signal_var - vv) * y_scale_ * y_scale_};
}

// ---- the tuner ------------------------------------------------------------------------------------------

int64_t TunePoint::chunk_bytes() const { return int64_t(std::llround(std::exp2(log2_chunk_bytes))); }

FlowTuner::FlowTuner(TunerOptions options) : options_(std::move(options)) {
  const TunerOptions& o = options_;
  DMOE_REQUIRE(o.log2_chunk_min >= 0 && o.log2_chunk_max <= 40 && o.log2_chunk_min <= o.log2_chunk_max,
               "tuner log2_chunk range [{}, {}]: must satisfy 0 <= min <= max <= 40", o.log2_chunk_min, o.log2_chunk_max);
  DMOE_REQUIRE(o.log2_chunk_step > 0, "tuner log2_chunk_step {}: must be > 0", o.log2_chunk_step);
  DMOE_REQUIRE(!o.micro_batches.empty(), "tuner micro_batches: empty (allowed: powers of two in [1, 4096])");
  for (int32_t r : o.micro_batches)
    DMOE_REQUIRE(r >= 1 && r <= 4096 && (r & (r - 1)) == 0, "tuner micro_batches {}: must be a power of two in [1, 4096]", r);
  DMOE_REQUIRE(o.initial_samples >= 1, "tuner initial_samples {}: must be >= 1", o.initial_samples);
  std::sort(options_.micro_batches.begin(), options_.micro_batches.end());
  options_.micro_batches.erase(std::unique(options_.micro_batches.begin(), options_.micro_batches.end()),
                               options_.micro_batches.end());
  const int64_t steps = std::llround((o.log2_chunk_max - o.log2_chunk_min) / o.log2_chunk_step);
  DMOE_REQUIRE(steps <= 10000, "tuner log2_chunk_step {}: {} grid points, more than 10000", o.log2_chunk_step, steps + 1);
  for (int32_t r : options_.micro_batches)
    for (int64_t j = 0; j <= steps; ++j)
      candidates_.push_back({std::min(o.log2_chunk_max, o.log2_chunk_min + double(j) * o.log2_chunk_step), r});
  observed_.assign(candidates_.size(), 0);
  // Initial design: the paper's default (Sp = 1 MiB, R = 2) when on the grid, then seeded draws.
  Rng rng(o.seed);
  TunePoint def{20.0, 2};
  if (def.log2_chunk_bytes >= o.log2_chunk_min && def.log2_chunk_bytes <= o.log2_chunk_max &&
      std::binary_search(options_.micro_batches.begin(), options_.micro_batches.end(), 2)) {
    const size_t i = candidate_index(def);
    if (i < candidates_.size()) initial_.push_back(i);
  }
  const size_t want = std::min(size_t(o.initial_samples), candidates_.size());
  while (initial_.size() < want) {
    const size_t i = size_t(rng.next() % candidates_.size());
    if (std::find(initial_.begin(), initial_.end(), i) == initial_.end()) initial_.push_back(i);
  }
}

size_t FlowTuner::candidate_index(const TunePoint& p) const {
  const auto& rs = options_.micro_batches;
  const auto it = std::lower_bound(rs.begin(), rs.end(), p.micro_batches);
  if (it == rs.end() || *it != p.micro_batches) return candidates_.size();
  const double j = (p.log2_chunk_bytes - options_.log2_chunk_min) / options_.log2_chunk_step;
  const int64_t jr = std::llround(j);
  const int64_t per_r = int64_t(candidates_.size() / rs.size());
  if (std::abs(j - double(jr)) > 1e-9 || jr < 0 || jr >= per_r) return candidates_.size();
  return size_t(it - rs.begin()) * size_t(per_r) + size_t(jr);
}

std::vector<double> FlowTuner::encode(const TunePoint& p) const {
  const double span = options_.log2_chunk_max - options_.log2_chunk_min;
  const double rmax = std::log2(double(options_.micro_batches.back()));
  return {span > 0 ? (p.log2_chunk_bytes - options_.log2_chunk_min) / span : 0.0,
          rmax > 0 ? std::log2(double(p.micro_batches)) / rmax : 0.0};
}

void FlowTuner::observe(const TunePoint& p, double y) {
  DMOE_REQUIRE(std::isfinite(y), "tuner observe: step time {} (must be finite)", y);
  DMOE_REQUIRE(p.log2_chunk_bytes >= options_.log2_chunk_min - 1e-12 && p.log2_chunk_bytes <= options_.log2_chunk_max + 1e-12,
               "tuner observe: log2_chunk_bytes {} outside [{}, {}]", p.log2_chunk_bytes, options_.log2_chunk_min,
               options_.log2_chunk_max);
  DMOE_REQUIRE(std::binary_search(options_.micro_batches.begin(), options_.micro_batches.end(), p.micro_batches),
               "tuner observe: micro_batches {} is not one of the tuner's choices", p.micro_batches);
  const size_t i = candidate_index(p);
  if (i < candidates_.size()) observed_[i] = 1;
  observed_index_.push_back(i);
  x_.push_back(encode(p));
  y_.push_back(y);
  gp_.fit(x_, y_, options_.grid);
}

std::vector<double> FlowTuner::expected_improvements() const {
  std::vector<double> ei(candidates_.size(), 0.0);
  if (y_.empty()) return ei;
  const double best = *std::min_element(y_.begin(), y_.end());
  // xi is in standardised units: scale it by the spread of the observations.
  double mean = 0, var = 0;
  for (double v : y_) mean += v;
  mean /= double(y_.size());
  for (double v : y_) var += (v - mean) * (v - mean);
  const double scale = var > 0 ? std::sqrt(var / double(y_.size())) : 1.0;
  for (size_t i = 0; i < candidates_.size(); ++i) {
    const GaussianProcess::Prediction p = gp_.predict(encode(candidates_[i]));
    ei[i] = expected_improvement(p.mean, std::sqrt(p.variance), best, options_.xi * scale);
  }
  return ei;
}

TunePoint FlowTuner::suggest() {
  for (size_t i : initial_)
    if (y_.size() < size_t(options_.initial_samples) && !observed_[i]) return candidates_[i];
  const std::vector<double> ei = expected_improvements();
  size_t pick = candidates_.size();
  for (size_t i = 0; i < candidates_.size(); ++i)
    if (!observed_[i] && (pick == candidates_.size() || ei[i] > ei[pick])) pick = i;
  return pick < candidates_.size() ? candidates_[pick] : best();
}

TunePoint FlowTuner::best() const {
  DMOE_REQUIRE(!y_.empty(), "tuner: no observations yet");
  const size_t i = size_t(std::min_element(y_.begin(), y_.end()) - y_.begin());
  const std::vector<double>& x = x_[i];
  TunePoint p;
  p.log2_chunk_bytes = options_.log2_chunk_min + x[0] * (options_.log2_chunk_max - options_.log2_chunk_min);
  const double rmax = std::log2(double(options_.micro_batches.back()));
  p.micro_batches = int32_t(std::llround(std::exp2(x[1] * rmax)));
  if (observed_index_[i] < candidates_.size()) p = candidates_[observed_index_[i]];
  return p;
}

double FlowTuner::best_value() const {
  DMOE_REQUIRE(!y_.empty(), "tuner: no observations yet");
  return *std::min_element(y_.begin(), y_.end());
}

}  // namespace dmoe::flow
