// The model families the trainer runs: GPT, BERT and T5 on token shards, ViT on labelled images,
// CLIP and the captioner on captioned images.
#include "train/model_family.h"

#include <unistd.h>
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>

#include "octet/bert.h"
#include "octet/captioner.h"
#include "octet/clip.h"
#include "octet/data.h"
#include "octet/files.h"
#include "octet/model.h"
#include "octet/t5.h"
#include "octet/vit.h"
#include "train/bert_batcher.h"
#include "train/clip_captions.h"
#include "train/t5_batcher.h"

namespace octet::train_detail {

namespace {

// Whether any --moe-* flag was given (each overrides a GPT mixture-of-experts config's field).
bool any_moe_flag(const TrainOptions& o) {
  return o.moe_router_topk || o.moe_aux_loss_coeff || o.moe_z_loss_coeff ||
         o.moe_router_enable_expert_bias || o.moe_router_bias_update_rate ||
         o.moe_expert_capacity_factor || o.moe_token_drop_policy || o.moe_dispatch_fp8;
}

class GptFamily : public ModelFamily {
 public:
  explicit GptFamily(const TrainOptions& o) : config_(GPTConfig::load(o.config_path)) {
    OCTET_CHECK(!o.image_augment, "--image-augment is for image models; the config '",
                o.config_path, "' is a GPT");
    if (!o.vocab_dir.empty()) {
      // The tokenizer the shards were made with: its size is the model's unless --vocab-size
      // says otherwise, and it travels in every checkpoint so that generation decodes with it.
      const Gpt2Tokenizer tokenizer = Gpt2Tokenizer::load(o.vocab_dir);
      const int64_t size = o.vocab_size ? o.vocab_size : tokenizer.vocab_size();
      OCTET_CHECK(size >= tokenizer.vocab_size(), "--vocab-size ", size,
                  " expected at least the tokenizer's ", tokenizer.vocab_size(), " (--vocab-dir ",
                  o.vocab_dir, ")");
      config_.vocab_size = size;
    } else if (o.vocab_size) {
      config_.vocab_size = o.vocab_size;
    }
    OCTET_CHECK(!any_moe_flag(o) || config_.moe(),
                "--moe-* flags need a mixture-of-experts config "
                "(num_experts > 0); '",
                o.config_path, "' is dense");
    if (o.moe_router_topk) config_.moe_router_topk = *o.moe_router_topk;
    if (o.moe_aux_loss_coeff) config_.moe_aux_loss_coeff = *o.moe_aux_loss_coeff;
    if (o.moe_z_loss_coeff) config_.moe_z_loss_coeff = *o.moe_z_loss_coeff;
    if (o.moe_router_enable_expert_bias) {
      config_.moe_router_enable_expert_bias = *o.moe_router_enable_expert_bias;
    }
    if (o.moe_router_bias_update_rate) {
      config_.moe_router_bias_update_rate = *o.moe_router_bias_update_rate;
    }
    if (o.moe_expert_capacity_factor) {
      config_.moe_expert_capacity_factor = *o.moe_expert_capacity_factor;
    }
    if (o.moe_token_drop_policy) config_.moe_token_drop_policy = *o.moe_token_drop_policy;
    config_.check_moe();
    const int64_t ep = o.expert_model_parallel_size;
    OCTET_CHECK(ep == 1 || config_.moe(), "--expert-model-parallel-size ", ep,
                " splits a mixture of experts' experts; '", o.config_path,
                "' is dense (num_experts = 0)");
    OCTET_CHECK(!config_.moe() || (ep >= 1 && config_.num_experts % ep == 0), "num_experts (",
                config_.num_experts, ") expected a multiple of --expert-model-parallel-size (", ep,
                ")");
    const int64_t cp = o.context_parallel_size, T = seq_len(o);
    OCTET_CHECK(cp >= 1 && T % (2 * cp) == 0, "--context-parallel-size ", cp,
                " splits each sequence into 2 x CP = ", 2 * cp, " chunks: the sequence length ", T,
                " expected a multiple of ", 2 * cp);
    const int64_t heads = config_.num_heads / o.tensor_model_parallel_size;
    const int64_t kv_heads =
        (config_.num_gqa_groups > 0 ? config_.num_gqa_groups : config_.num_heads) /
        o.tensor_model_parallel_size;
    OCTET_CHECK(cp == 1 || o.cp_comm_type != "a2a" || (heads % cp == 0 && kv_heads % cp == 0),
                "--cp-comm-type a2a splits each rank's attention heads over CP: ", heads,
                " query and ", kv_heads,
                " key/value heads per tensor rank are not divisible by "
                "--context-parallel-size ",
                cp, " (use --cp-comm-type p2p)");
    OCTET_CHECK(cp == 1 || config_.dropout == 0.0f, "--context-parallel-size needs dropout 0 ('",
                o.config_path, "' has ", config_.dropout, ")");
  }
  std::string name() const override { return config_.name; }
  nlohmann::json config_json() const override { return config_.to_json(); }
  int64_t num_parameters() const override { return config_.num_parameters(); }
  int64_t num_active_parameters() const override { return config_.num_active_parameters(); }
  int64_t num_layers() const override { return config_.num_layers; }
  int64_t seq_len(const TrainOptions& o) const override {
    const int64_t seq_len = o.seq_length ? o.seq_length : config_.max_seq_len;
    OCTET_CHECK(seq_len > 0 && seq_len <= config_.max_seq_len, "--seq-length ", seq_len,
                " expected in [1, ", config_.max_seq_len, "]");
    return seq_len;
  }
  double train_flops_per_token(int64_t seq_len) const override {
    return config_.train_flops_per_token(seq_len);
  }
  bool classifies() const override { return false; }
  std::string data_hint() const override {
    return "--train-data SHARD (from `octet tokenize -o`) or --mock-data";
  }
  std::unique_ptr<TrainableModel> make_model(ModelLayout layout,
                                             const TrainOptions& o) const override {
    auto model = std::make_unique<GPT>(config_, o.seed, std::move(layout), o.recompute_activations);
    model->set_tp_comm_overlap(o.tp_comm_overlap);
    if (o.first_last_layers_bf16) {
      model->set_high_precision_layers(o.num_layers_at_start_in_bf16, o.num_layers_at_end_in_bf16);
    }
    return model;
  }
  std::unique_ptr<DataSource> open_data(const TrainOptions& o, bool train,
                                        int64_t seq_len) const override {
    if (train) {
      return std::make_unique<Batcher>(o.train_data, o.mock_data, config_.vocab_size, seq_len,
                                       o.seed, 1);
    }
    if (!o.mock_data && o.valid_data.empty()) return nullptr;
    return std::make_unique<Batcher>(o.mock_data ? "" : o.valid_data, o.mock_data,
                                     config_.vocab_size, seq_len, o.seed, 2);
  }
  double baseline_loss(const TrainOptions& o) const override {
    return o.mock_data ? NAN : unigram_entropy(o.train_data);
  }

 private:
  GPTConfig config_;
};

// Labelled images for an image model of `channels` x `size` x `size` pixels and at least
// `classes` classes: --mock-data, or the IDX directory of --train-data (its training split) /
// --valid-data (its test split, normalized with the training split's statistics); null for
// validation without --valid-data.
std::unique_ptr<ImageBatcher> open_images(const TrainOptions& o, bool train, int64_t channels,
                                          int64_t size, int64_t classes) {
  if (o.mock_data) {
    return std::make_unique<ImageBatcher>(channels * size * size, classes, o.seed, train ? 1 : 2);
  }
  if (!train && o.valid_data.empty()) return nullptr;
  ImageDataset data = load_fashion_mnist(train ? o.train_data : o.valid_data, train);
  OCTET_CHECK(channels == 1 && data.rows == size && data.cols == size, "image data '",
              train ? o.train_data : o.valid_data, "' holds ", data.rows, "x", data.cols,
              " grey images; the config expects ", channels, "x", size, "x", size);
  OCTET_CHECK(data.num_classes <= classes, "image data has ", data.num_classes,
              " classes; the config has ", classes);
  if (train) {
    return std::make_unique<ImageBatcher>(std::move(data), true, o.seed, 1, o.image_augment);
  }
  // Validation images normalized with the training split's statistics, as training saw them.
  const ImageBatcher::PixelStats stats =
      o.train_data.empty() ? ImageBatcher::pixel_stats(data)
                           : ImageBatcher::pixel_stats(load_fashion_mnist(o.train_data, true));
  return std::make_unique<ImageBatcher>(std::move(data), false, o.seed, 2, false, stats);
}

std::string image_data_hint() {
  return "--train-data DIR (IDX images and labels, e.g. " + default_fashion_mnist_dir() +
         " from Debian's dataset-fashion-mnist) or --mock-data";
}

class VitFamily : public ModelFamily {
 public:
  explicit VitFamily(const TrainOptions& o) : config_(ViTConfig::load(o.config_path)) {
    OCTET_CHECK(o.vocab_dir.empty() && o.vocab_size == 0,
                "--vocab-dir and --vocab-size are a language model's: the config '", o.config_path,
                "' is a ViT");
    OCTET_CHECK(!o.image_augment || !o.mock_data,
                "--image-augment transforms real images: give --train-data DIR, not --mock-data");
  }
  std::string name() const override { return config_.name; }
  nlohmann::json config_json() const override { return config_.to_json(); }
  int64_t num_parameters() const override { return config_.num_parameters(); }
  int64_t num_layers() const override { return config_.num_layers; }
  int64_t seq_len(const TrainOptions& o) const override {
    OCTET_CHECK(o.seq_length == 0 || o.seq_length == config_.seq_len(), "--seq-length ",
                o.seq_length, ": a ViT's sequence is its ", config_.num_patches(),
                " patches and the class token (", config_.seq_len(), "); leave it out");
    return config_.seq_len();
  }
  double train_flops_per_token(int64_t) const override { return config_.train_flops_per_token(); }
  bool classifies() const override { return true; }
  std::string data_hint() const override { return image_data_hint(); }
  std::unique_ptr<TrainableModel> make_model(ModelLayout layout,
                                             const TrainOptions& o) const override {
    auto model = std::make_unique<ViT>(config_, o.seed, std::move(layout), o.recompute_activations);
    if (o.first_last_layers_bf16) {
      model->set_high_precision_layers(o.num_layers_at_start_in_bf16, o.num_layers_at_end_in_bf16);
    }
    return model;
  }
  std::unique_ptr<DataSource> open_data(const TrainOptions& o, bool train, int64_t) const override {
    return open_images(o, train, config_.channels, config_.image_size, config_.num_classes);
  }
  double baseline_loss(const TrainOptions&) const override {
    return std::log(static_cast<double>(config_.num_classes));  // a uniform guess
  }

 private:
  ViTConfig config_;
};

// The vocabulary of a model whose special tokens follow the tokenizer's ids (BERT, T5): the
// tokenizer's size plus `specials` with --vocab-dir (or --vocab-size, at least that), else
// --vocab-size (above `specials`) or the config's.
int64_t vocab_with_specials(const TrainOptions& o, int64_t config_vocab, int64_t specials,
                            const std::string& names) {
  if (!o.vocab_dir.empty()) {
    const Gpt2Tokenizer tokenizer = Gpt2Tokenizer::load(o.vocab_dir);
    const int64_t needed = tokenizer.vocab_size() + specials;
    const int64_t size = o.vocab_size ? o.vocab_size : needed;
    OCTET_CHECK(size >= needed, "--vocab-size ", size, " expected at least the tokenizer's ",
                tokenizer.vocab_size(), " + ", specials, " special tokens (", names, ") = ", needed,
                " (--vocab-dir ", o.vocab_dir, ")");
    return size;
  }
  if (o.vocab_size == 0) return config_vocab;
  OCTET_CHECK(o.vocab_size > specials, "--vocab-size ", o.vocab_size, " expected at least ",
              specials + 1, " (text ids, then ", names, ")");
  return o.vocab_size;
}

// BERT pretraining (masked tokens and next-sentence pairs) on a token shard; validation
// reports masked-token accuracy.
class BertFamily : public ModelFamily {
 public:
  explicit BertFamily(const TrainOptions& o) : config_(BertConfig::load(o.config_path)) {
    OCTET_CHECK(!o.image_augment, "--image-augment is for image models; the config '",
                o.config_path, "' is a BERT");
    // The tokenizer's ids, then the four special tokens [PAD] [CLS] [SEP] [MASK].
    config_.vocab_size = vocab_with_specials(o, config_.vocab_size, 4, "[PAD] [CLS] [SEP] [MASK]");
  }
  std::string name() const override { return config_.name; }
  nlohmann::json config_json() const override { return config_.to_json(); }
  int64_t num_parameters() const override { return config_.num_parameters(); }
  int64_t num_layers() const override { return config_.num_layers; }
  int64_t seq_len(const TrainOptions& o) const override {
    const int64_t seq_len = o.seq_length ? o.seq_length : config_.max_seq_len;
    OCTET_CHECK(seq_len >= BertBatcher::kMinLength && seq_len <= config_.max_seq_len,
                "--seq-length ", seq_len, " expected in [", BertBatcher::kMinLength, ", ",
                config_.max_seq_len, "] for a BERT ([CLS] A [SEP] B [SEP])");
    return seq_len;
  }
  double train_flops_per_token(int64_t seq_len) const override {
    return config_.train_flops_per_token(seq_len);
  }
  bool classifies() const override { return true; }
  std::string accuracy_name() const override { return "masked-token accuracy"; }
  std::string baseline_name() const override { return "unigram entropy + ln 2"; }
  std::string data_hint() const override {
    return "--train-data SHARD (from `octet tokenize -o`) or --mock-data";
  }
  std::unique_ptr<TrainableModel> make_model(ModelLayout layout,
                                             const TrainOptions& o) const override {
    auto model =
        std::make_unique<Bert>(config_, o.seed, std::move(layout), o.recompute_activations);
    if (o.first_last_layers_bf16) {
      model->set_high_precision_layers(o.num_layers_at_start_in_bf16, o.num_layers_at_end_in_bf16);
    }
    return model;
  }
  std::unique_ptr<DataSource> open_data(const TrainOptions& o, bool train,
                                        int64_t seq_len) const override {
    if (!train && !o.mock_data && o.valid_data.empty()) return nullptr;
    return std::make_unique<BertBatcher>(train ? o.train_data : o.valid_data, o.mock_data, config_,
                                         seq_len, o.seed, train ? 1 : 2);
  }
  double baseline_loss(const TrainOptions& o) const override {
    // Masked tokens guessed from their frequencies, and a coin for the next sentence.
    return o.mock_data ? NAN : unigram_entropy(o.train_data) + std::log(2.0);
  }

 private:
  BertConfig config_;
};

// T5 span-corruption pretraining on a token shard: --seq-length sets the encoder's input length
// (the config's max_seq_len by default), the config's max_target_len the decoder's; tokens/s
// count input tokens. Validation reports target-token accuracy.
class T5Family : public ModelFamily {
 public:
  explicit T5Family(const TrainOptions& o) : config_(T5Config::load(o.config_path)) {
    OCTET_CHECK(!o.image_augment, "--image-augment is for image models; the config '",
                o.config_path, "' is a T5");
    // The tokenizer's ids, then [PAD], [EOS] and the sentinels.
    config_.vocab_size = vocab_with_specials(
        o, config_.vocab_size, 2 + config_.num_sentinels,
        "[PAD], [EOS] and " + std::to_string(config_.num_sentinels) + " sentinels");
  }
  std::string name() const override { return config_.name; }
  nlohmann::json config_json() const override { return config_.to_json(); }
  int64_t num_parameters() const override { return config_.num_parameters(); }
  int64_t num_layers() const override { return config_.num_layers + config_.decoder_layers(); }
  int64_t seq_len(const TrainOptions& o) const override {
    const int64_t seq_len = o.seq_length ? o.seq_length : config_.max_seq_len;
    OCTET_CHECK(seq_len >= 2 && seq_len <= config_.max_seq_len, "--seq-length ", seq_len,
                " expected in [2, ", config_.max_seq_len, "] for a T5 (its encoder's inputs)");
    return seq_len;
  }
  double train_flops_per_token(int64_t seq_len) const override {
    return config_.train_flops_per_token(seq_len, config_.max_target_len);
  }
  bool classifies() const override { return true; }
  std::string accuracy_name() const override { return "target-token accuracy"; }
  std::string baseline_name() const override { return "unigram entropy"; }
  std::string data_hint() const override {
    return "--train-data SHARD (from `octet tokenize -o`) or --mock-data";
  }
  std::unique_ptr<TrainableModel> make_model(ModelLayout layout,
                                             const TrainOptions& o) const override {
    auto model = std::make_unique<T5>(config_, o.seed, std::move(layout), o.recompute_activations);
    if (o.first_last_layers_bf16) {
      model->set_high_precision_layers(o.num_layers_at_start_in_bf16, o.num_layers_at_end_in_bf16);
    }
    return model;
  }
  std::unique_ptr<DataSource> open_data(const TrainOptions& o, bool train,
                                        int64_t seq_len) const override {
    if (!train && !o.mock_data && o.valid_data.empty()) return nullptr;
    return std::make_unique<T5Batcher>(train ? o.train_data : o.valid_data, o.mock_data, config_,
                                       seq_len, config_.max_target_len, o.seed, train ? 1 : 2);
  }
  double baseline_loss(const TrainOptions& o) const override {
    return o.mock_data ? NAN : unigram_entropy(o.train_data);
  }

 private:
  T5Config config_;
};

// CLIP's contrastive training on labelled images, each paired with a caption made from its
// class (train/clip_captions.h); validation reports the loss and zero-shot accuracy.
// The image-text models on Fashion-MNIST images with their class captions (ClipBatcher): the
// config's checks against the captions' vocabulary, sizes, data and FLOPs.
template <class Config>
class CaptionedImagesFamily : public ModelFamily {
 public:
  CaptionedImagesFamily(const TrainOptions& o, const char* kind)
      : config_(Config::load(o.config_path)), kind_(kind) {
    OCTET_CHECK(o.vocab_dir.empty() && o.vocab_size == 0,
                "--vocab-dir and --vocab-size are a language model's: the config '", o.config_path,
                "' is a ", kind, " (its captions' words are its vocabulary)");
    const auto words = static_cast<int64_t>(clip_vocabulary().size());
    OCTET_CHECK(config_.vocab_size >= words, "config '", o.config_path, "': vocab_size ",
                config_.vocab_size, " expected at least the captions' ", words, " words");
    OCTET_CHECK(!o.image_augment || !o.mock_data,
                "--image-augment transforms real images: give --train-data DIR, not --mock-data");
  }
  std::string name() const override { return config_.name; }
  nlohmann::json config_json() const override { return config_.to_json(); }
  int64_t num_parameters() const override { return config_.num_parameters(); }
  int64_t num_layers() const override { return config_.num_layers(); }
  int64_t seq_len(const TrainOptions& o) const override {
    OCTET_CHECK(o.seq_length == 0, "--seq-length: a ", kind_, "'s sequences are its image's ",
                config_.vision_seq_len(), " patch tokens and its caption's ", config_.max_text_len,
                " tokens; leave it out");
    return config_.vision_seq_len();
  }
  // Tokens/s count image tokens (patches and the class token); the text's work is in the
  // FLOPs of each.
  double train_flops_per_token(int64_t) const override {
    return config_.train_flops_per_pair() / static_cast<double>(config_.vision_seq_len());
  }
  bool classifies() const override { return true; }
  std::string data_hint() const override { return image_data_hint(); }
  std::unique_ptr<DataSource> open_data(const TrainOptions& o, bool train, int64_t) const override {
    std::unique_ptr<DataSource> images =
        open_images(o, train, config_.channels, config_.image_size, kClipClasses);
    if (!images) return nullptr;
    return std::make_unique<ClipBatcher>(std::move(images), config_.max_text_len, o.seed,
                                         train ? 3 : 4);
  }

 protected:
  // The model with --first-last-layers-bf16 applied.
  template <class Model>
  std::unique_ptr<TrainableModel> build(ModelLayout layout, const TrainOptions& o) const {
    auto model =
        std::make_unique<Model>(config_, o.seed, std::move(layout), o.recompute_activations);
    if (o.first_last_layers_bf16) {
      model->set_high_precision_layers(o.num_layers_at_start_in_bf16, o.num_layers_at_end_in_bf16);
    }
    return model;
  }

  Config config_;
  const char* kind_;
};

class ClipFamily : public CaptionedImagesFamily<CLIPConfig> {
 public:
  explicit ClipFamily(const TrainOptions& o) : CaptionedImagesFamily(o, "CLIP") {
    OCTET_CHECK(config_.num_classes == kClipClasses, "config '", o.config_path, "': num_classes ",
                config_.num_classes, " expected ", kClipClasses, " (the captioned classes)");
  }
  std::string accuracy_name() const override { return "zero-shot accuracy"; }
  std::string baseline_name() const override { return "uniform guess (ln micro-batch)"; }
  std::unique_ptr<TrainableModel> make_model(ModelLayout layout,
                                             const TrainOptions& o) const override {
    return build<CLIP>(std::move(layout), o);
  }
  // Each caption's image guessed among the micro-batch's.
  double baseline_loss(const TrainOptions& o) const override {
    return std::log(static_cast<double>(o.micro_batch_size));
  }
};

// The words of generated ids ("?" for an id outside the captions' vocabulary).
std::string caption_words(const std::vector<int32_t>& ids) {
  const auto words = static_cast<int32_t>(clip_vocabulary().size());
  std::vector<int32_t> known;
  std::string unknown;
  for (const int32_t id : ids) {
    if (id < words) known.push_back(id);
    if (id >= words) unknown += " ?";
  }
  return clip_decode(known) + unknown;
}

// Images (rows of pixels [N, C*S*S], shown in gray, each scaled to its own range) with a line of
// text beside each: an SVG written to a temporary name, then renamed.
void write_captions_svg(const std::string& path, const Tensor& pixels, int64_t channels,
                        int64_t size, const std::vector<std::string>& lines) {
  const int64_t cell = 3, side = size * cell, row_height = side + 12;
  const auto n = static_cast<int64_t>(lines.size());
  const std::string temp = path + ".tmp." + std::to_string(getpid());
  {
    std::ofstream out(temp);
    OCTET_CHECK(out.good(), "cannot write ", temp);
    out << "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"760\" height=\""
        << n * row_height + 10 << "\" font-family=\"sans-serif\" font-size=\"14\">\n"
        << "<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n";
    const float* p = pixels.data<float>();
    const int64_t plane = size * size;
    for (int64_t i = 0; i < n; ++i) {
      const float* image = p + i * channels * plane;
      const auto [lo, hi] = std::minmax_element(image, image + channels * plane);
      const float range = std::max(*hi - *lo, 1e-6f);
      const int64_t top = 5 + i * row_height;
      for (int64_t y = 0; y < size; ++y) {
        for (int64_t x = 0; x < size; ++x) {
          float v = 0;
          for (int64_t ch = 0; ch < channels; ++ch) v += image[ch * plane + y * size + x];
          const int gray = static_cast<int>(255.0f * (v / channels - *lo) / range + 0.5f);
          out << "<rect x=\"" << 5 + x * cell << "\" y=\"" << top + y * cell << "\" width=\""
              << cell << "\" height=\"" << cell << "\" fill=\"rgb(" << gray << ',' << gray << ','
              << gray << ")\"/>\n";
        }
      }
      out << "<text x=\"" << side + 20 << "\" y=\"" << top + side / 2 + 5 << "\">" << lines[i]
          << "</text>\n";
    }
    out << "</svg>\n";
    OCTET_CHECK(out.good(), "cannot write ", temp);
  }
  std::filesystem::rename(temp, path);
}

class CaptionerFamily : public CaptionedImagesFamily<CaptionerConfig> {
 public:
  explicit CaptionerFamily(const TrainOptions& o) : CaptionedImagesFamily(o, "captioner") {
    OCTET_CHECK(config_.sos_id == kClipSos && config_.eos_id == kClipEos, "config '", o.config_path,
                "': sos_id and eos_id expected ", kClipSos, " and ", kClipEos,
                " (the captions' [SOS] and [EOS]), got ", config_.sos_id, " and ", config_.eos_id);
  }
  std::string accuracy_name() const override { return "caption token accuracy"; }
  std::string baseline_name() const override { return "uniform guess (ln words)"; }
  std::unique_ptr<TrainableModel> make_model(ModelLayout layout,
                                             const TrainOptions& o) const override {
    return build<ImageCaptioner>(std::move(layout), o);
  }
  double baseline_loss(const TrainOptions&) const override {
    return std::log(static_cast<double>(clip_vocabulary().size()));
  }
  // Greedy captions of the first validation images: how many name the image's class, a few
  // printed, and (with --plot) the images beside their captions.
  void report(TrainableModel& model, const DataSource& valid, DType dtype, const TrainOptions& o,
              bool print) const override {
    auto* captioner = dynamic_cast<ImageCaptioner*>(&model);
    if (captioner == nullptr) return;
    const int64_t count = 256, shown = 8;
    const pipeline::MicroBatch batch = valid.batch(0, count);
    const Tensor& pixels = pipeline::batch_tensor(batch, "pixels", "captioner");
    const int32_t* labels = pipeline::batch_tensor(batch, "labels", "captioner").data<int32_t>();
    const std::vector<std::vector<int32_t>> captions = captioner->generate(pixels, dtype);
    int64_t named = 0;
    std::vector<std::string> lines;
    for (int64_t i = 0; i < pixels.dim(0); ++i) {
      const std::string text = caption_words(captions[static_cast<size_t>(i)]);
      named += clip_named_class(text) == labels[i];
      if (i < shown) {
        lines.push_back(text + "   (" + fashion_mnist_classes()[static_cast<size_t>(labels[i])] +
                        ")");
      }
    }
    if (!print) return;
    std::printf("greedy captions naming the image's class: %.1f%% of %lld validation images\n",
                100.0 * static_cast<double>(named) / static_cast<double>(pixels.dim(0)),
                static_cast<long long>(pixels.dim(0)));
    for (const std::string& line : lines) std::printf("  %s\n", line.c_str());
    if (!o.plot.empty()) {
      const size_t dot = o.plot.rfind('.');
      const std::string path =
          (dot == std::string::npos ? o.plot : o.plot.substr(0, dot)) + "-captions.svg";
      write_captions_svg(path, pixels, config_.channels, config_.image_size, lines);
      std::printf("captions drawn: %s\n", path.c_str());
    }
  }
};

}  // namespace

std::unique_ptr<ModelFamily> ModelFamily::from_options(const TrainOptions& o) {
  const std::string family = config_model_family(o.config_path);
  OCTET_CHECK(!any_moe_flag(o) || family == "gpt",
              "--moe-* flags are for GPT mixture-of-experts "
              "configs; '",
              o.config_path, "' is a ", family);
  OCTET_CHECK(o.expert_model_parallel_size == 1 || family == "gpt",
              "--expert-model-parallel-size splits a GPT mixture of experts' experts; '",
              o.config_path, "' is a ", family);
  OCTET_CHECK(o.context_parallel_size == 1 || family == "gpt",
              "--context-parallel-size splits a GPT's sequences; '", o.config_path, "' is a ",
              family);
  if (family == "vit") return std::make_unique<VitFamily>(o);
  if (family == "bert") return std::make_unique<BertFamily>(o);
  if (family == "t5") return std::make_unique<T5Family>(o);
  if (family == "clip") return std::make_unique<ClipFamily>(o);
  if (family == "captioner") return std::make_unique<CaptionerFamily>(o);
  return std::make_unique<GptFamily>(o);
}

}  // namespace octet::train_detail
