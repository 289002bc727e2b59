// Captions for CLIP training on Fashion-MNIST: a fixed word vocabulary, captions drawn per
// sample from templates, class names and attributes, the zero-shot prompts of every class, and
// ClipBatcher, which adds the captions and prompts to an ImageBatcher's micro-batches. Every
// draw comes from Philox(seed, stream, sample position), so the same batch number always gives
// the same captions and a resumed run sees exactly the data an uninterrupted one would.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "train/batcher.h"
#include "train/sample_draws.h"

namespace octet::train_detail {

constexpr int64_t kClipPad = 0, kClipSos = 1, kClipEos = 2;
constexpr int64_t kClipClasses = 10;

// "[PAD]" "[SOS]" "[EOS]" (ids kClipPad, kClipSos, kClipEos), then every word a caption or a
// prompt can use, sorted, each once. Words are lower case; a caption is words split by single
// spaces.
const std::vector<std::string>& clip_vocabulary();

// [SOS] w1 .. wn [EOS] as ids; throws octet::Error naming a word outside the vocabulary.
std::vector<int32_t> clip_encode(const std::string& caption);
// The words of `ids` joined by single spaces, [PAD] [SOS] [EOS] left out (for printing).
std::string clip_decode(const std::vector<int32_t>& ids);

// The display names of Fashion-MNIST's classes 0 .. 9 ("T-shirt/top" .. "Ankle boot").
const std::vector<std::string>& fashion_mnist_classes();
// The names a caption may call class `label` by: its main name first, then its synonyms.
const std::vector<std::string>& clip_class_names(int64_t label);

// The class a caption names: the class of the longest class name found in it as whole words
// ("a dress shirt" names Shirt, not Dress); -1 when it names none.
int64_t clip_named_class(const std::string& caption);

// One caption of an image of class `label` in [0, 10): a template, a name and an attribute,
// each drawn uniformly from `draws` (always three draws, in that order).
std::string clip_caption(int64_t label, SampleDraws& draws);

// Zero-shot classification: M prompts per class, one per prompt template, with the main name.
int64_t clip_prompts_per_class();
std::vector<std::string> clip_class_prompts(int64_t label);  // M prompts of class `label`

// Tokens of the longest encoded caption or prompt ([SOS] and [EOS] included), over every
// template, name and attribute: the least max_text_len that holds them all.
int64_t clip_max_caption_tokens();

// The micro-batches of CLIP (clip_micro_batch): the image batch of `images` ("pixels"
// [B, C*H*W] F32, "labels" [B] I32 in [0, 10)) with, for Tt = max_text_len and M prompts:
//   "text_ids" [B, Tt] I32: the caption of each image, [SOS] w1 .. wn [EOS] then kClipPad;
//   "text_lengths" [B] I32: n + 2 (the [EOS], the pooled token, at text_lengths - 1);
//   "class_ids" [10*M, Tt] I32 and "class_lengths" [10*M] I32: the prompts of every class,
//   rows k*M .. k*M+M-1 class k's, laid out as the captions (the same in every batch).
// The caption of the sample at stream position p = index * size + i is clip_caption(label,
// SampleDraws(seed, p, stream)).
class ClipBatcher : public DataSource {
 public:
  // Throws octet::Error when max_text_len < clip_max_caption_tokens().
  ClipBatcher(std::unique_ptr<DataSource> images, int64_t max_text_len, uint64_t seed,
              uint64_t stream);
  pipeline::MicroBatch batch(int64_t index, int64_t size) const override;

 private:
  std::unique_ptr<DataSource> images_;
  int64_t max_text_len_;
  uint64_t seed_, stream_;
  std::vector<int32_t> class_ids_, class_lengths_;  // [10*M, Tt] and [10*M], padded
};

}  // namespace octet::train_detail
