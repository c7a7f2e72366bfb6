// tuner.hpp — Flow's online tuner of the AR chunk size Sp and the micro-batch count R: Bayesian optimisation
// with a Gaussian process (Matérn-5/2 kernel) and expected improvement (issue 15, after FlowMoE).
//
// Search space: log2(Sp) ∈ [17, 24] (128 KiB … 16 MiB) on a grid of step 1/8, R ∈ {1, 2, 4, 8}. The GP sees
// both on [0, 1]: u = (log2 Sp − 17) / 7, v = log2(R) / 3. Objective: the step time to minimise, each
// sample the mean of a few training iterations at that (Sp, R) (or the simulator's prediction).
//
//   k(x, x') = s² (1 + √5 r + 5/3 r²) exp(−√5 r),  r = sqrt(Σ_i ((x_i − x'_i) / ℓ_i)²)
//   y standardised (mean 0, standard deviation 1) before the fit; K + σn² I = L Lᵀ (Cholesky, fp64)
//   log p(y) = −½ yᵀ (K + σn² I)⁻¹ y − Σ log L_ii − n/2 log 2π     (hyperparameters: the best on a grid)
//   mean μ(x) = k*ᵀ (K + σn² I)⁻¹ y,  variance s² − k*ᵀ (K + σn² I)⁻¹ k*
//   EI(x) = (f* − μ − ξ) Φ(z) + σ φ(z),  z = (f* − μ − ξ) / σ,  f* = the best observation (minimisation)
//
// suggest(): the first samples are an initial design (the paper's default Sp = 1 MiB, R = 2, then points
// drawn with the seed); after that, the grid point of largest EI not yet observed (ties: the lowest grid
// index). Deterministic for a given seed and sequence of observations.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <vector>

namespace dmoe::flow {

double matern52(double r);
// EI for minimisation; stddev <= 0 gives max(0, best − mean − xi).
double expected_improvement(double mean, double stddev, double best, double xi = 0.0);

struct GpHyper {
  std::vector<double> length;  // ℓ_i per input dimension
  double signal_var = 1.0;     // s²
  double noise_var = 1e-6;     // σn² (on the standardised y)
};

struct GpHyperGrid {
  std::vector<double> length = {0.05, 0.1, 0.2, 0.4, 0.8, 1.6};  // tried in every dimension
  std::vector<double> signal_var = {0.5, 1.0, 2.0};
  std::vector<double> noise_var = {1e-6, 1e-4, 1e-2};
};

class GaussianProcess {
 public:
  // x: n points of dimension d (all the same d >= 1), y: n finite values. fit() picks the hyperparameters of
  // largest marginal likelihood on the grid; fit_fixed() uses the given ones.
  void fit(const std::vector<std::vector<double>>& x, const std::vector<double>& y, const GpHyperGrid& grid = {});
  void fit_fixed(const std::vector<std::vector<double>>& x, const std::vector<double>& y, const GpHyper& hyper);

  struct Prediction {
    double mean = 0, variance = 0;  // in y's units
  };
  Prediction predict(const std::vector<double>& x) const;
  double log_marginal_likelihood() const { return lml_; }
  const GpHyper& hyper() const { return hyper_; }
  size_t size() const { return x_.size(); }

 private:
  // Factorises K + σn² I for hyper on the standardised y; returns false when not positive definite.
  bool factor(const GpHyper& hyper);
  double kernel(const std::vector<double>& a, const std::vector<double>& b, const GpHyper& h) const;

  std::vector<std::vector<double>> x_;
  std::vector<double> y_;           // standardised
  double y_mean_ = 0, y_scale_ = 1;
  GpHyper hyper_;
  std::vector<double> chol_;        // [n, n] lower triangle, row-major
  std::vector<double> alpha_;       // (K + σn² I)⁻¹ y
  double lml_ = 0;
};

struct TunePoint {
  double log2_chunk_bytes = 20;  // log2(Sp)
  int32_t micro_batches = 2;     // R
  int64_t chunk_bytes() const;   // round(2^log2_chunk_bytes)
};

struct TunerOptions {
  uint64_t seed = 1;
  int32_t initial_samples = 3;             // the default point, then initial_samples − 1 seeded draws
  double log2_chunk_min = 17, log2_chunk_max = 24;
  double log2_chunk_step = 0.125;
  std::vector<int32_t> micro_batches = {1, 2, 4, 8};
  double xi = 0.0;                         // EI's exploration margin, in standardised units of y
  GpHyperGrid grid;
};

class FlowTuner {
 public:
  explicit FlowTuner(TunerOptions options = {});

  TunePoint suggest();
  // y: the measured (or simulated) step time at x. Bad x or y throw dmoe::Error naming the field.
  void observe(const TunePoint& x, double y);

  size_t num_observations() const { return y_.size(); }
  // Every candidate observed: suggest() can only repeat the best one from here on.
  bool exhausted() const { return std::find(observed_.begin(), observed_.end(), uint8_t(0)) == observed_.end(); }
  TunePoint best() const;       // the best observation so far
  double best_value() const;
  const GaussianProcess& model() const { return gp_; }
  const std::vector<TunePoint>& candidates() const { return candidates_; }
  std::vector<double> encode(const TunePoint& p) const;  // the GP's input in [0, 1]²
  // EI of every candidate under the current model (after the last observe()).
  std::vector<double> expected_improvements() const;

 private:
  size_t candidate_index(const TunePoint& p) const;  // throws if p is not on the grid

  TunerOptions options_;
  std::vector<TunePoint> candidates_;  // grid: R-major, then log2 Sp ascending
  std::vector<uint8_t> observed_;
  std::vector<std::vector<double>> x_;
  std::vector<double> y_;
  std::vector<size_t> observed_index_;
  std::vector<size_t> initial_;        // candidate indices of the initial design
  GaussianProcess gp_;
};

}  // namespace dmoe::flow
