#include "examples/charlm/char_mlp.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <string>
#include <vector>

#include "examples/charlm/batch_sampler.hpp"
#include "examples/charlm/counter_rng.hpp"
#include "examples/charlm/text_corpus.hpp"
#include "zest/error.hpp"

namespace zest::charlm {
namespace {

// One buffer per tensor of a model, with the pointer list the model takes.
template <typename Real>
struct Tensors {
  std::vector<std::vector<Real>> data;
  std::vector<Real*> pointers;

  explicit Tensors(const std::vector<ParamInfo>& infos, Real fill = Real(0)) {
    for (const ParamInfo& info : infos) data.emplace_back(info.numel(), fill);
    for (auto& tensor : data) pointers.push_back(tensor.data());
  }
  template <typename Other>
  void copy_from(const Tensors<Other>& other) {
    for (std::size_t t = 0; t < data.size(); ++t) {
      std::transform(other.data[t].begin(), other.data[t].end(), data[t].begin(),
                     [](Other x) { return static_cast<Real>(x); });
    }
  }
};

std::vector<Token> random_windows(std::size_t count, std::size_t window, std::size_t vocab,
                                  std::uint64_t seed) {
  std::vector<Token> tokens(count * window);
  for (std::size_t i = 0; i < tokens.size(); ++i) {
    tokens[i] = static_cast<Token>(below(counter_hash(seed, i, 0, 0), vocab));
  }
  return tokens;
}

// Init, then move every element (biases included, which init leaves at 0) by a random amount, so
// the gradient check sees a generic point where no term vanishes.
template <typename Real>
Tensors<Real> generic_point(const BasicCharMlp<Real>& model, std::uint64_t seed) {
  Tensors<Real> params(model.parameters());
  model.init(params.pointers, seed);
  for (std::size_t t = 0; t < params.data.size(); ++t) {
    for (std::size_t j = 0; j < params.data[t].size(); ++j) {
      params.data[t][j] += static_cast<Real>(0.3 * (unit_interval(counter_hash(seed, t, j, 1)) - 0.5));
    }
  }
  return params;
}

CharMlpShape small_shape(Activation activation, std::size_t layers) {
  CharMlpShape shape;
  shape.vocab = 7;
  shape.context = 3;
  shape.embed = 4;
  shape.hidden = 5;
  shape.layers = layers;
  shape.activation = activation;
  return shape;
}

TEST(CharMlp, ParameterListAndCountFormula) {
  CharMlpShape shape = small_shape(Activation::gelu, 2);
  const CharMlp model(shape, 4, 1);
  const auto& params = model.parameters();
  ASSERT_EQ(params.size(), 7u);
  const std::vector<std::string> names{"embed.weight", "hidden0.weight", "hidden0.bias",
                                       "hidden1.weight", "hidden1.bias", "output.weight",
                                       "output.bias"};
  const std::vector<std::vector<std::size_t>> shapes{{7, 4}, {5, 12}, {5}, {5, 5}, {5}, {7, 5}, {7}};
  const std::vector<int> groups{0, 1, 1, 2, 2, 3, 3};
  for (std::size_t t = 0; t < params.size(); ++t) {
    EXPECT_EQ(params[t].name, names[t]);
    EXPECT_EQ(params[t].shape, shapes[t]);
    EXPECT_EQ(params[t].group, groups[t]);
  }
  EXPECT_EQ(model.group_count(), 4);
  // 28 + (60 + 5) + (25 + 5) + (35 + 7), written out by hand.
  EXPECT_EQ(CharMlp::parameter_count(shape), 165u);

  for (const std::size_t layers : {0u, 1u, 3u}) {
    for (const std::size_t hidden : {1u, 9u}) {
      shape.layers = layers;
      shape.hidden = hidden;
      const CharMlp sized(shape, 1, 1);
      std::size_t total = 0;
      for (const ParamInfo& info : sized.parameters()) total += info.numel();
      EXPECT_EQ(CharMlp::parameter_count(shape), total) << layers << " layers, H=" << hidden;
      EXPECT_EQ(sized.group_count(), static_cast<int>(layers) + 2);
    }
  }
}

// Every element of every tensor against a central difference of the double-precision loss.
// With h = 1e-5 the truncation error is ~h^2 * |f'''| ~ 1e-10 and the rounding error
// ~1e-16 / h ~ 1e-11, so agreement to 1e-8 absolute + 1e-6 relative is a strict test.
void check_gradients(const CharMlpShape& shape) {
  constexpr std::size_t kBatch = 6;
  constexpr double kNormalizer = 10.0;  // a global batch larger than this rank's share
  BasicCharMlp<double> model(shape, kBatch, 1);
  Tensors<double> params = generic_point(model, 5);
  Tensors<double> grads(model.parameters(), std::numeric_limits<double>::quiet_NaN());
  const auto windows = random_windows(kBatch, model.window(), shape.vocab, 77);
  const double loss = model.forward_backward(params.pointers, grads.pointers, windows, kNormalizer);
  EXPECT_NEAR(loss, model.forward(params.pointers, windows, kNormalizer), 1e-14);

  constexpr double kStep = 1e-5;
  for (std::size_t t = 0; t < params.data.size(); ++t) {
    double max_grad = 0.0;
    for (std::size_t j = 0; j < params.data[t].size(); ++j) {
      double& x = params.data[t][j];
      const double saved = x;
      x = saved + kStep;
      const double up = model.forward(params.pointers, windows, kNormalizer);
      x = saved - kStep;
      const double down = model.forward(params.pointers, windows, kNormalizer);
      x = saved;
      const double numeric = (up - down) / (2 * kStep);
      const double analytic = grads.data[t][j];
      EXPECT_NEAR(analytic, numeric, 1e-8 + 1e-6 * std::abs(numeric))
          << model.parameters()[t].name << "[" << j << "]";
      max_grad = std::max(max_grad, std::abs(analytic));
    }
    EXPECT_GT(max_grad, 1e-4) << model.parameters()[t].name << " has a vanishing gradient";
  }
}

TEST(CharMlp, GradientsMatchFiniteDifferencesGelu) { check_gradients(small_shape(Activation::gelu, 2)); }
TEST(CharMlp, GradientsMatchFiniteDifferencesTanh) { check_gradients(small_shape(Activation::tanh, 2)); }
TEST(CharMlp, GradientsMatchFiniteDifferencesNoHiddenLayer) {
  check_gradients(small_shape(Activation::gelu, 0));
}

// The float model is the same code as the double one; this pins the float instantiation to the
// checked double gradients within fp32 rounding (1e-4 of each tensor's largest gradient).
TEST(CharMlp, FloatAgreesWithDouble) {
  const CharMlpShape shape = small_shape(Activation::gelu, 2);
  BasicCharMlp<double> reference(shape, 8, 1);
  CharMlp model(shape, 8, 1);
  const Tensors<double> params64 = generic_point(reference, 3);
  Tensors<float> params32(model.parameters());
  params32.copy_from(params64);
  Tensors<double> grads64(reference.parameters());
  Tensors<float> grads32(model.parameters());
  const auto windows = random_windows(8, model.window(), shape.vocab, 9);
  const double loss64 = reference.forward_backward(params64.pointers, grads64.pointers, windows, 8);
  const double loss32 = model.forward_backward(params32.pointers, grads32.pointers, windows, 8);
  EXPECT_NEAR(loss32, loss64, 1e-5 * loss64);
  for (std::size_t t = 0; t < grads64.data.size(); ++t) {
    double scale = 0.0;
    for (const double g : grads64.data[t]) scale = std::max(scale, std::abs(g));
    for (std::size_t j = 0; j < grads64.data[t].size(); ++j) {
      EXPECT_NEAR(grads32.data[t][j], grads64.data[t][j], 1e-4 * scale)
          << model.parameters()[t].name << "[" << j << "]";
    }
  }
}

// Summing (loss, grads) of the rank slices gives the whole batch's (loss, grads): the property
// that makes the loss at step n independent of the rank count. fp32 sums in another order, so
// the tolerance is 2e-6 of each tensor's largest gradient (~16 float ulps) and 1e-6 of the loss.
TEST(CharMlp, SplitBatchSumsToWholeBatch) {
  const CharMlpShape shape = small_shape(Activation::tanh, 2);
  constexpr std::size_t kGlobal = 12;
  CharMlp model(shape, kGlobal, 1);
  const Tensors<float> params = generic_point(model, 11);
  const auto windows = random_windows(kGlobal, model.window(), shape.vocab, 21);
  Tensors<float> whole(model.parameters());
  const double whole_loss = model.forward_backward(params.pointers, whole.pointers, windows, kGlobal);
  for (const int world : {2, 4, 5}) {
    Tensors<double> sum(model.parameters());
    double loss = 0.0;
    for (int rank = 0; rank < world; ++rank) {
      const ExampleRange slice = rank_slice(kGlobal, rank, world);
      const auto part = std::span<const Token>(windows).subspan(slice.first * model.window(),
                                                                slice.count * model.window());
      Tensors<float> grads(model.parameters(), std::numeric_limits<float>::quiet_NaN());
      loss += model.forward_backward(params.pointers, grads.pointers, part, kGlobal);
      for (std::size_t t = 0; t < grads.data.size(); ++t) {
        for (std::size_t j = 0; j < grads.data[t].size(); ++j) sum.data[t][j] += grads.data[t][j];
      }
    }
    EXPECT_NEAR(loss, whole_loss, 1e-6 * whole_loss) << world << " ranks";
    for (std::size_t t = 0; t < whole.data.size(); ++t) {
      float scale = 0.0f;
      for (const float g : whole.data[t]) scale = std::max(scale, std::abs(g));
      ASSERT_GT(scale, 0.0f);
      for (std::size_t j = 0; j < whole.data[t].size(); ++j) {
        EXPECT_NEAR(sum.data[t][j], whole.data[t][j], 2e-6 * scale)
            << world << " ranks, " << model.parameters()[t].name << "[" << j << "]";
      }
    }
  }
}

TEST(CharMlp, GradientsAreOverwrittenAndAnEmptyShareGivesZeros) {
  const CharMlpShape shape = small_shape(Activation::gelu, 1);
  CharMlp model(shape, 4, 1);
  const Tensors<float> params = generic_point(model, 1);
  const auto windows = random_windows(4, model.window(), shape.vocab, 2);
  Tensors<float> fresh(model.parameters());
  Tensors<float> dirty(model.parameters(), 123.0f);
  const double a = model.forward_backward(params.pointers, fresh.pointers, windows, 4);
  const double b = model.forward_backward(params.pointers, dirty.pointers, windows, 4);
  EXPECT_EQ(a, b);
  EXPECT_EQ(fresh.data, dirty.data);

  int hooks_fired = 0;
  GroupHooks hooks{[&](int) { ++hooks_fired; }, [&](int) { ++hooks_fired; }};
  Tensors<float> empty(model.parameters(), std::numeric_limits<float>::quiet_NaN());
  EXPECT_EQ(model.forward_backward(params.pointers, empty.pointers, {}, 4, &hooks), 0.0);
  for (const auto& tensor : empty.data) {
    for (const float g : tensor) EXPECT_EQ(g, 0.0f);
  }
  EXPECT_EQ(hooks_fired, 3 * model.group_count()) << "a rank with no example still takes part";
}

TEST(CharMlp, HooksFireInTheDocumentedOrder) {
  const CharMlpShape shape = small_shape(Activation::gelu, 2);  // groups 0..3
  CharMlp model(shape, 4, 1);
  const Tensors<float> params = generic_point(model, 1);
  Tensors<float> grads(model.parameters());
  const auto windows = random_windows(4, model.window(), shape.vocab, 2);
  std::string order;
  GroupHooks hooks{[&](int g) { order.append("N").append(std::to_string(g)).append(" "); },
                   [&](int g) { order.append("R").append(std::to_string(g)).append(" "); }};
  (void)model.forward_backward(params.pointers, grads.pointers, windows, 4, &hooks);
  EXPECT_EQ(order, "N0 N1 N2 N3 N3 R3 N2 R2 N1 R1 N0 R0 ");
  order.clear();
  (void)model.forward(params.pointers, windows, 4, &hooks);
  EXPECT_EQ(order, "N0 N1 N2 N3 ");
  GroupHooks only_ready{{}, hooks.grads_ready};
  order.clear();
  (void)model.forward_backward(params.pointers, grads.pointers, windows, 4, &only_ready);
  EXPECT_EQ(order, "R3 R2 R1 R0 ");
}

// A stage-3 trainer holds one group at a time: params_needed(g) gathers group g into its buffers
// and poisons every other group's, grads_ready(g) takes group g's gradients and poisons them.
// If the model read a group outside its window, or wrote a gradient after grads_ready, the
// results would be NaN or differ from the plain call.
TEST(CharMlp, OneGroupAtATimeGivesTheSameResult) {
  const CharMlpShape shape = small_shape(Activation::tanh, 3);
  CharMlp model(shape, 5, 1);
  const Tensors<float> master = generic_point(model, 4);
  const auto windows = random_windows(5, model.window(), shape.vocab, 6);
  Tensors<float> expected(model.parameters());
  const double expected_loss = model.forward_backward(master.pointers, expected.pointers, windows, 5);

  const auto& infos = model.parameters();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  Tensors<float> working(infos, nan);
  Tensors<float> grads(infos, nan);
  Tensors<float> collected(infos, nan);
  GroupHooks hooks;
  hooks.params_needed = [&](int group) {
    for (std::size_t t = 0; t < infos.size(); ++t) {
      if (infos[t].group == group) {
        working.data[t] = master.data[t];
      } else {
        std::fill(working.data[t].begin(), working.data[t].end(), nan);
      }
    }
  };
  hooks.grads_ready = [&](int group) {
    for (std::size_t t = 0; t < infos.size(); ++t) {
      if (infos[t].group != group) continue;
      collected.data[t] = grads.data[t];
      std::fill(grads.data[t].begin(), grads.data[t].end(), nan);
    }
  };
  const double loss = model.forward_backward(working.pointers, grads.pointers, windows, 5, &hooks);
  EXPECT_EQ(loss, expected_loss);
  EXPECT_EQ(collected.data, expected.data);
}

TEST(CharMlp, InitIsDeterministicAndShardable) {
  const CharMlpShape shape = small_shape(Activation::gelu, 2);
  const CharMlp a(shape, 1, 1);
  const CharMlp b(shape, 1, 1);
  Tensors<float> pa(a.parameters()), pb(b.parameters()), pc(a.parameters());
  a.init(pa.pointers, 17);
  b.init(pb.pointers, 17);
  a.init(pc.pointers, 18);
  EXPECT_EQ(pa.data, pb.data);
  EXPECT_NE(pa.data[0], pc.data[0]);
  // A shard initialized alone equals the same slice of the whole tensor.
  std::vector<float> shard(20);
  a.init_tensor(1, 33, shard, 17);
  EXPECT_TRUE(std::equal(shard.begin(), shard.end(), pa.data[1].begin() + 33));
  EXPECT_THROW(a.init_tensor(1, 50, shard, 17), Error);  // 50 + 20 > 60 elements
  // Biases start at zero; weights do not.
  EXPECT_TRUE(std::all_of(pa.data[2].begin(), pa.data[2].end(), [](float x) { return x == 0.0f; }));
  EXPECT_TRUE(std::any_of(pa.data[1].begin(), pa.data[1].end(), [](float x) { return x != 0.0f; }));
}

struct GplFixture : ::testing::Test {
  static const TextCorpus& corpus() {
    static const TextCorpus loaded = TextCorpus::load();
    return loaded;
  }
};

TEST_F(GplFixture, InitialLossIsNearLogVocab) {
  CharMlpShape shape;  // defaults: context 8, embed 16, hidden 128, 2 layers
  shape.vocab = corpus().vocab_size();
  constexpr std::size_t kBatch = 64;
  CharMlp model(shape, kBatch, 1);
  Tensors<float> params(model.parameters());
  model.init(params.pointers, 1);
  const BatchSampler sampler(corpus().tokens().size(), shape.context, kBatch, 1);
  std::vector<Token> windows(kBatch * model.window());
  sampler.gather(corpus().tokens(), 0, {0, kBatch}, windows);
  const double loss = model.forward(params.pointers, windows, kBatch);
  EXPECT_NEAR(loss, std::log(static_cast<double>(shape.vocab)), 0.05);
}

// The entropy of the corpus's byte frequencies: the best loss a model that ignores its context
// can reach (about 3.17 nats for the GPL).
double unigram_entropy(const TextCorpus& corpus) {
  std::vector<double> counts(corpus.vocab_size(), 0.0);
  for (const Token t : corpus.tokens()) counts[static_cast<std::size_t>(t)] += 1.0;
  double entropy = 0.0;
  const auto n = static_cast<double>(corpus.tokens().size());
  for (const double c : counts) entropy -= c / n * std::log(c / n);
  return entropy;
}

// Plain SGD written here, on the GPL text. Evaluated on a fixed held-out draw (another seed), the
// loss must start at about log(V) and end clearly below the unigram entropy: the model learned
// to use its context, not just the byte frequencies.
TEST_F(GplFixture, SgdLowersTheLossBelowTheUnigramEntropy) {
  CharMlpShape shape;
  shape.vocab = corpus().vocab_size();
  shape.context = 4;
  shape.embed = 8;
  shape.hidden = 48;
  shape.layers = 1;
  constexpr std::size_t kBatch = 32;
  constexpr std::size_t kEvalBatch = 512;
  constexpr int kSteps = 300;
  constexpr float kLearningRate = 0.5f;
  CharMlp model(shape, kEvalBatch, 1);
  Tensors<float> params(model.parameters());
  Tensors<float> grads(model.parameters());
  model.init(params.pointers, 3);
  const BatchSampler sampler(corpus().tokens().size(), shape.context, kBatch, 3);
  const BatchSampler eval_sampler(corpus().tokens().size(), shape.context, kEvalBatch, 1000);
  std::vector<Token> eval_windows(kEvalBatch * model.window());
  eval_sampler.gather(corpus().tokens(), 0, {0, kEvalBatch}, eval_windows);
  const double initial = model.forward(params.pointers, eval_windows, kEvalBatch);

  std::vector<Token> windows(kBatch * model.window());
  for (int step = 0; step < kSteps; ++step) {
    sampler.gather(corpus().tokens(), static_cast<std::uint64_t>(step), {0, kBatch}, windows);
    (void)model.forward_backward(params.pointers, grads.pointers, windows, kBatch);
    for (std::size_t t = 0; t < params.data.size(); ++t) {
      for (std::size_t j = 0; j < params.data[t].size(); ++j) {
        params.data[t][j] -= kLearningRate * grads.data[t][j];
      }
    }
  }
  const double final_loss = model.forward(params.pointers, eval_windows, kEvalBatch);
  const double unigram = unigram_entropy(corpus());
  EXPECT_NEAR(initial, std::log(static_cast<double>(shape.vocab)), 0.05);
  EXPECT_LT(final_loss, unigram - 0.4) << "initial " << initial << ", unigram entropy " << unigram;
  std::printf("SGD, %d steps: held-out loss %.3f -> %.3f (log V %.3f, unigram entropy %.3f)\n",
              kSteps, initial, final_loss, std::log(static_cast<double>(shape.vocab)), unigram);
}

TEST(CharMlp, ErrorsSayWhatIsWrong) {
  const CharMlpShape shape = small_shape(Activation::gelu, 1);
  CharMlp model(shape, 2, 1);
  Tensors<float> params(model.parameters());
  Tensors<float> grads(model.parameters());
  auto message_of = [](auto&& action) -> std::string {
    try {
      action();
    } catch (const Error& error) {
      return error.what();
    }
    return "no error";
  };
  const auto three = random_windows(3, model.window(), shape.vocab, 0);
  EXPECT_NE(message_of([&] { model.forward_backward(params.pointers, grads.pointers, three, 3); })
                .find("a batch of 3 examples exceeds the max_batch of 2"),
            std::string::npos);
  auto bad = random_windows(2, model.window(), shape.vocab, 0);
  bad[5] = 7;
  EXPECT_NE(message_of([&] { model.forward(params.pointers, bad, 2); })
                .find("token 7 at index 5 is outside the vocabulary [0, 7)"),
            std::string::npos);
  const std::vector<Token> partial(5, 0);
  EXPECT_NE(message_of([&] { model.forward(params.pointers, partial, 2); }).find("context + 1 = 4"),
            std::string::npos);
  const std::vector<Token> one(4, 0);
  EXPECT_NE(message_of([&] { model.forward(params.pointers, one, 0.0); }).find("normalizer"),
            std::string::npos);
  const std::vector<float*> too_few(2, nullptr);
  EXPECT_NE(message_of([&] { model.forward(too_few, one, 1.0); }).find("given 2 parameter tensors, the model has 5"),
            std::string::npos);
  EXPECT_NE(message_of([&] { model.forward_backward(params.pointers, too_few, one, 1.0); })
                .find("given 2 gradient tensors"),
            std::string::npos);
  CharMlpShape no_vocab = shape;
  no_vocab.vocab = 0;
  EXPECT_NE(message_of([&] { CharMlp(no_vocab, 1, 1); }).find("vocab is 0"), std::string::npos);
  EXPECT_NE(message_of([&] { CharMlp(shape, 0, 1); }).find("max_batch is 0"), std::string::npos);
}

}  // namespace
}  // namespace zest::charlm
