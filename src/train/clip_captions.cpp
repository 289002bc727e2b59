// Fashion-MNIST captions for CLIP: the templates, names and attributes of every class, the word
// vocabulary they span, and the micro-batches pairing images with captions (see
// clip_captions.h).
#include "train/clip_captions.h"

#include <algorithm>
#include <functional>
#include <set>
#include <utility>

#include "octet/error.h"
#include "octet/pipeline_stage.h"

namespace octet::train_detail {
namespace {

// The words of one class: its display name, the names a caption may call it by (the main name
// first, used by the prompts) and the attributes a caption may give it.
struct ClassWords {
  std::string display;
  std::vector<std::string> names, attributes;
};

const std::vector<ClassWords>& class_words() {
  static const std::vector<ClassWords> classes = {
      {"T-shirt/top",
       {"t-shirt", "top", "tee", "tank top"},
       {"short-sleeved", "casual", "plain", "cotton", "summer"}},
      {"Trouser",
       {"trouser", "pair of trousers", "pair of pants", "pair of jeans"},
       {"long", "slim", "denim", "casual", "dark"}},
      {"Pullover",
       {"pullover", "sweater", "jumper", "knit sweater"},
       {"long-sleeved", "warm", "knitted", "woolen", "cozy"}},
      {"Dress",
       {"dress", "gown", "sundress", "frock"},
       {"elegant", "summer", "long", "short", "sleeveless"}},
      {"Coat",
       {"coat", "jacket", "overcoat", "parka"},
       {"warm", "winter", "long", "heavy", "buttoned"}},
      {"Sandal",
       {"sandal", "flip-flop", "summer shoe", "open shoe"},
       {"strappy", "flat", "open-toed", "leather", "summer"}},
      {"Shirt",
       {"shirt", "button-up shirt", "blouse", "dress shirt"},
       {"collared", "formal", "long-sleeved", "button-down", "checked"}},
      {"Sneaker",
       {"sneaker", "trainer", "running shoe", "sports shoe"},
       {"athletic", "low-top", "canvas", "sporty", "casual"}},
      {"Bag",
       {"bag", "handbag", "purse", "tote bag"},
       {"leather", "large", "small", "shoulder", "stylish"}},
      {"Ankle boot",
       {"ankle boot", "boot", "bootie", "short boot"},
       {"leather", "heeled", "winter", "laced", "chunky"}},
  };
  return classes;
}

// Captions: {name} and {attr} stand for a class name and an attribute.
const std::vector<std::string>& caption_templates() {
  static const std::vector<std::string> templates = {
      "a photo of a {name}",
      "a {attr} {name}",
      "a picture of a {attr} {name}",
      "a grayscale photo of the {name}",
      "a low resolution photo of a {attr} {name}",
      "a photo of the {attr} {name}",
      "a small image of a {attr} {name}",
      "a {name} that is {attr}",
  };
  return templates;
}

// Zero-shot prompts, with the main name.
const std::vector<std::string>& prompt_templates() {
  static const std::vector<std::string> templates = {
      "a photo of a {name}",
      "a picture of a {name}",
      "a {name}",
      "a grayscale photo of the {name}",
  };
  return templates;
}

std::vector<std::string> split_words(const std::string& text) {
  std::vector<std::string> words;
  size_t begin = 0;
  while (true) {
    const size_t end = text.find(' ', begin);
    words.push_back(text.substr(begin, end == std::string::npos ? std::string::npos : end - begin));
    if (end == std::string::npos) return words;
    begin = end + 1;
  }
}

// The template with {name} and {attr} filled in, "a" becoming "an" before a vowel.
std::string fill_template(const std::string& text_template, const std::string& name,
                          const std::string& attribute) {
  std::vector<std::string> words;
  for (const std::string& word : split_words(text_template)) {
    const std::string& part = word == "{name}" ? name : word == "{attr}" ? attribute : word;
    for (std::string& piece : split_words(part)) words.push_back(std::move(piece));
  }
  std::string caption;
  for (size_t i = 0; i < words.size(); ++i) {
    const bool vowel_next = i + 1 < words.size() && !words[i + 1].empty() &&
                            std::string("aeiou").find(words[i + 1].front()) != std::string::npos;
    if (i > 0) caption += ' ';
    caption += words[i] == "a" && vowel_next ? "an" : words[i];
  }
  return caption;
}

const ClassWords& class_of(int64_t label, const char* who) {
  OCTET_CHECK(label >= 0 && label < kClipClasses, who, ": class label expected in [0, ",
              kClipClasses, ") (Fashion-MNIST's classes), got ", label);
  return class_words()[static_cast<size_t>(label)];
}

// Every caption and prompt the data can hold, each passed to `visit`.
void for_each_text(const std::function<void(const std::string&)>& visit) {
  for (int64_t label = 0; label < kClipClasses; ++label) {
    const ClassWords& words = class_words()[static_cast<size_t>(label)];
    for (const std::string& text_template : caption_templates()) {
      for (const std::string& name : words.names) {
        for (const std::string& attribute : words.attributes) {
          visit(fill_template(text_template, name, attribute));
        }
      }
    }
    for (const std::string& prompt : clip_class_prompts(label)) visit(prompt);
  }
}

// ids as a row of `length`: the ids, then kClipPad.
void write_row(const std::vector<int32_t>& ids, int64_t length, int32_t* row) {
  std::copy(ids.begin(), ids.end(), row);
  std::fill(row + ids.size(), row + length, static_cast<int32_t>(kClipPad));
}

}  // namespace

const std::vector<std::string>& clip_vocabulary() {
  static const std::vector<std::string> vocabulary = [] {
    std::set<std::string> words;  // sorted as std::sort sorts std::string
    for_each_text([&](const std::string& text) {
      for (std::string& word : split_words(text)) words.insert(std::move(word));
    });
    std::vector<std::string> all = {"[PAD]", "[SOS]", "[EOS]"};
    all.insert(all.end(), words.begin(), words.end());
    return all;
  }();
  return vocabulary;
}

std::vector<int32_t> clip_encode(const std::string& caption) {
  const std::vector<std::string>& vocabulary = clip_vocabulary();
  const auto words_begin = vocabulary.begin() + 3;  // after the specials
  std::vector<int32_t> ids = {static_cast<int32_t>(kClipSos)};
  for (const std::string& word : split_words(caption)) {
    const auto found = std::lower_bound(words_begin, vocabulary.end(), word);
    OCTET_CHECK(found != vocabulary.end() && *found == word, "CLIP captions: unknown word '", word,
                "' in caption '", caption, "': expected words of the ", vocabulary.size() - 3,
                "-word caption vocabulary separated by single spaces (clip_vocabulary())");
    ids.push_back(static_cast<int32_t>(found - vocabulary.begin()));
  }
  ids.push_back(static_cast<int32_t>(kClipEos));
  return ids;
}

std::string clip_decode(const std::vector<int32_t>& ids) {
  const std::vector<std::string>& vocabulary = clip_vocabulary();
  std::string text;
  for (const int32_t id : ids) {
    OCTET_CHECK(id >= 0 && static_cast<size_t>(id) < vocabulary.size(),
                "CLIP captions: token id expected in [0, ", vocabulary.size(), "), got ", id);
    if (id == kClipPad || id == kClipSos || id == kClipEos) continue;
    if (!text.empty()) text += ' ';
    text += vocabulary[static_cast<size_t>(id)];
  }
  return text;
}

const std::vector<std::string>& fashion_mnist_classes() {
  static const std::vector<std::string> names = [] {
    std::vector<std::string> all;
    for (const ClassWords& words : class_words()) all.push_back(words.display);
    return all;
  }();
  return names;
}

const std::vector<std::string>& clip_class_names(int64_t label) {
  return class_of(label, "clip_class_names").names;
}

int64_t clip_named_class(const std::string& caption) {
  const std::string padded = " " + caption + " ";
  int64_t named = -1;
  size_t longest = 0;
  for (size_t k = 0; k < class_words().size(); ++k) {
    for (const std::string& name : class_words()[k].names) {
      if (name.size() > longest && padded.find(" " + name + " ") != std::string::npos) {
        longest = name.size();
        named = static_cast<int64_t>(k);
      }
    }
  }
  return named;
}

std::string clip_caption(int64_t label, SampleDraws& draws) {
  const ClassWords& words = class_of(label, "clip_caption");
  const std::vector<std::string>& templates = caption_templates();
  const auto pick = [&](const std::vector<std::string>& choices) -> const std::string& {
    return choices[static_cast<size_t>(draws.below(static_cast<int64_t>(choices.size())))];
  };
  const std::string& text_template = pick(templates);
  const std::string& name = pick(words.names);
  const std::string& attribute = pick(words.attributes);
  return fill_template(text_template, name, attribute);
}

int64_t clip_prompts_per_class() {
  return static_cast<int64_t>(prompt_templates().size());
}

std::vector<std::string> clip_class_prompts(int64_t label) {
  const ClassWords& words = class_of(label, "clip_class_prompts");
  std::vector<std::string> prompts;
  for (const std::string& text_template : prompt_templates()) {
    prompts.push_back(fill_template(text_template, words.names.front(), ""));
  }
  return prompts;
}

int64_t clip_max_caption_tokens() {
  static const int64_t longest = [] {
    size_t tokens = 0;
    for_each_text(
        [&](const std::string& text) { tokens = std::max(tokens, clip_encode(text).size()); });
    return static_cast<int64_t>(tokens);
  }();
  return longest;
}

ClipBatcher::ClipBatcher(std::unique_ptr<DataSource> images, int64_t max_text_len, uint64_t seed,
                         uint64_t stream)
    : images_(std::move(images)), max_text_len_(max_text_len), seed_(seed), stream_(stream) {
  OCTET_CHECK(images_ != nullptr, "CLIP data: expected an image source, got none");
  OCTET_CHECK(max_text_len_ >= clip_max_caption_tokens(),
              "CLIP data: the config's max_text_len expected at least ", clip_max_caption_tokens(),
              " (the longest caption or prompt, [SOS] and [EOS] included), got ", max_text_len_);
  const int64_t prompts = clip_prompts_per_class();
  class_ids_.resize(static_cast<size_t>(kClipClasses * prompts * max_text_len_));
  class_lengths_.resize(static_cast<size_t>(kClipClasses * prompts));
  int64_t row = 0;
  for (int64_t label = 0; label < kClipClasses; ++label) {
    for (const std::string& prompt : clip_class_prompts(label)) {
      const std::vector<int32_t> ids = clip_encode(prompt);
      write_row(ids, max_text_len_, class_ids_.data() + row * max_text_len_);
      class_lengths_[static_cast<size_t>(row)] = static_cast<int32_t>(ids.size());
      ++row;
    }
  }
}

pipeline::MicroBatch ClipBatcher::batch(int64_t index, int64_t size) const {
  OCTET_CHECK(index >= 0 && size > 0, "CLIP data: batch expected index >= 0 and size > 0, got ",
              "index ", index, ", size ", size);
  pipeline::MicroBatch micro_batch = images_->batch(index, size);
  const Tensor& labels = pipeline::batch_tensor(micro_batch, "labels", "CLIP data");
  check_dtype(labels, DType::I32, "CLIP data: labels");
  check_shape(labels, {size}, "CLIP data: labels", "B");
  const int64_t T = max_text_len_;
  Tensor text_ids = Tensor::empty({size, T}, DType::I32);
  Tensor text_lengths = Tensor::empty({size}, DType::I32);
  for (int64_t b = 0; b < size; ++b) {
    const int64_t label = labels.data<int32_t>()[b];
    OCTET_CHECK(label >= 0 && label < kClipClasses, "CLIP data: image label expected in [0, ",
                kClipClasses, ") (Fashion-MNIST's classes), got ", label, " at sample ", b,
                " of batch ", index);
    SampleDraws draws(seed_, static_cast<uint64_t>(index * size + b), stream_);
    const std::vector<int32_t> ids = clip_encode(clip_caption(label, draws));
    write_row(ids, T, text_ids.data<int32_t>() + b * T);
    text_lengths.data<int32_t>()[b] = static_cast<int32_t>(ids.size());
  }
  const int64_t rows = static_cast<int64_t>(class_lengths_.size());
  Tensor class_ids = Tensor::empty({rows, T}, DType::I32);
  Tensor class_lengths = Tensor::empty({rows}, DType::I32);
  std::copy(class_ids_.begin(), class_ids_.end(), class_ids.data<int32_t>());
  std::copy(class_lengths_.begin(), class_lengths_.end(), class_lengths.data<int32_t>());
  micro_batch["text_ids"] = text_ids;
  micro_batch["text_lengths"] = text_lengths;
  micro_batch["class_ids"] = class_ids;
  micro_batch["class_lengths"] = class_lengths;
  return micro_batch;
}

}  // namespace octet::train_detail
