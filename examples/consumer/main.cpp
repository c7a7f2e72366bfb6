// dmoe_consumer — uses the installed dmoe library the way an application would: builds a random MoE layer,
// runs the CPU reference engine forward and backward on one rank and on two simulated ranks, saves the
// weights as safetensors and loads them back, and checks what the library promises:
//   - y, dx and every gradient are finite, and y is not trivially zero;
//   - dropless routing on W = 2 ranks gives the W = 1 result bit for bit (y, expert ids, dx, expert
//     gradients; the gate's gradient, summed over ranks in a different association, to 1e-6);
//   - weights reloaded from the file give the same y;
//   - an impossible config is refused with a dmoe::Error of the bad-input kind.
// Exits 0 when all hold, 1 with a message for the first that does not.
#include <dmoe/dmoe.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <string>
#include <unistd.h>
#include <vector>

namespace {

int failures = 0;

void check(bool ok, const std::string& what) {
  std::printf("%s %s\n", ok ? "ok  " : "FAIL", what.c_str());
  if (!ok) ++failures;
}

bool all_finite(const std::vector<float>& v) {
  return std::all_of(v.begin(), v.end(), [](float f) { return std::isfinite(f); });
}

bool bitwise_equal(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0);
}

double max_rel_diff(const std::vector<float>& a, const std::vector<float>& b) {
  if (a.size() != b.size()) return INFINITY;
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    num = std::max(num, std::abs(double(a[i]) - double(b[i])));
    den = std::max(den, std::abs(double(b[i])));
  }
  return den > 0 ? num / den : num;
}

dmoe::MoeConfig layer(int64_t tokens_per_rank, int32_t world) {
  dmoe::MoeConfig c;
  c.tokens = tokens_per_rank;
  c.hidden = 32;
  c.ffn = 48;
  c.experts = 8;
  c.top_k = 2;
  c.activation = dmoe::Activation::swiglu;
  c.capacity_factor = 0;  // dropless
  c.world = world;
  c.aux_loss_coef = 0.01;
  c.validate();
  return c;
}

}  // namespace

int main() {
  try {
    const int64_t tokens = 32;  // in all
    const dmoe::MoeConfig one = layer(tokens, 1), two = layer(tokens / 2, 2);
    std::printf("layer: %s, and the same tokens on two ranks\n", one.summary().c_str());

    const dmoe::MoeWeights w = dmoe::random_moe_weights(one, 42);
    const std::vector<float> x = dmoe::hashed_activations(1, tokens, one.hidden, false);
    const std::vector<float> dy = dmoe::hashed_activations(2, tokens, one.hidden, false);

    const dmoe::LayerResult a = dmoe::run_cpu_layer(one, w, x, &dy);
    const dmoe::LayerResult b = dmoe::run_cpu_layer(two, w, x, &dy);

    check(all_finite(a.y) && all_finite(a.dx) && all_finite(a.grads.gate) && all_finite(a.grads.w1) &&
              all_finite(a.grads.w2) && all_finite(a.grads.w3),
          "W = 1: y, dx and the gradients are finite");
    check(std::any_of(a.y.begin(), a.y.end(), [](float f) { return f != 0; }), "W = 1: y is not all zeros");
    check(a.dropped() == 0, "dropless: no assignment dropped");
    check(a.expert_ids == b.expert_ids, "W = 2 routes every token to the same experts as W = 1");
    check(bitwise_equal(a.y, b.y), "W = 2: y equals W = 1 bit for bit");
    check(bitwise_equal(a.dx, b.dx), "W = 2: dx equals W = 1 bit for bit");
    check(bitwise_equal(a.grads.w1, b.grads.w1) && bitwise_equal(a.grads.w2, b.grads.w2) &&
              bitwise_equal(a.grads.w3, b.grads.w3),
          "W = 2: the experts' gradients equal W = 1 bit for bit");
    check(max_rel_diff(b.grads.gate, a.grads.gate) <= 1e-6, "W = 2: the gate's gradient equals W = 1 to 1e-6");

    // safetensors round trip under the checkpoint names (model.layers.0.block_sparse_moe.*).
    namespace fs = std::filesystem;
    const fs::path file = fs::temp_directory_path() / ("dmoe_consumer_" + std::to_string(::getpid()) + ".safetensors");
    dmoe::SafetensorsWriter writer;
    dmoe::save_moe_weights(writer, w, dmoe::layer_prefix(0), one.dtype);
    writer.write(file.string());
    const dmoe::SafetensorsFile read = dmoe::SafetensorsFile::open(file.string());
    const dmoe::MoeWeights w2 = dmoe::load_moe_weights(read, one, dmoe::layer_prefix(0));
    fs::remove(file);
    const dmoe::LayerResult c = dmoe::run_cpu_layer(one, w2, x, nullptr);
    check(read.size() == size_t(1 + 3 * one.experts), "the safetensors file has the gate and 3 matrices per expert");
    check(bitwise_equal(a.y, c.y), "weights saved and loaded again give the same y");

    // Bad input is a dmoe::Error that says what is wrong.
    dmoe::MoeConfig bad = one;
    bad.top_k = bad.experts + 1;
    try {
      bad.validate();
      check(false, "top_k > experts is refused");
    } catch (const dmoe::Error& e) {
      check(e.is_input() && std::string(e.what()).find("top_k") != std::string::npos,
            std::string("top_k > experts is refused: ") + e.what());
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "dmoe_consumer: unexpected error: %s\n", e.what());
    return 1;
  }
  if (failures) {
    std::fprintf(stderr, "dmoe_consumer: %d check(s) failed\n", failures);
    return 1;
  }
  std::printf("dmoe_consumer: all checks passed\n");
  return 0;
}
