// What the trainer needs of the model family a config describes (GPT, ViT, BERT): the config, the
// model part a layout holds, the data, and the counts the progress lines report. The trainer
// and the factory ask nothing else about the model they train.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include <nlohmann/json.hpp>

#include "octet/train.h"
#include "octet/trainable_model.h"
#include "train/batcher.h"

namespace octet::train_detail {

class ModelFamily {
 public:
  virtual ~ModelFamily() = default;
  // From --config (its "model" key: "gpt" when absent, or "vit") and the options that
  // change the config (--vocab-dir, --vocab-size).
  static std::unique_ptr<ModelFamily> from_options(const TrainOptions& o);

  virtual std::string name() const = 0;
  virtual nlohmann::json config_json() const = 0;  // kept in checkpoints
  virtual int64_t num_parameters() const = 0;
  // Those one token meets (a mixture of experts: its k experts of E); all of them otherwise.
  virtual int64_t num_active_parameters() const { return num_parameters(); }
  virtual int64_t num_layers() const = 0;
  // Tokens per sample (checked against the options), and training FLOPs per token.
  virtual int64_t seq_len(const TrainOptions& o) const = 0;
  virtual double train_flops_per_token(int64_t seq_len) const = 0;
  // Classifiers report validation accuracy (TrainableModel::take_eval_counts), under this
  // name in progress lines and plots.
  virtual bool classifies() const = 0;
  virtual std::string accuracy_name() const { return "accuracy"; }
  // What baseline_loss() is, in plots.
  virtual std::string baseline_name() const {
    return classifies() ? "uniform guess" : "unigram entropy";
  }
  // Names what the data options expect, for the error when none is given.
  virtual std::string data_hint() const = 0;
  virtual std::unique_ptr<TrainableModel> make_model(ModelLayout layout,
                                                     const TrainOptions& o) const = 0;
  // The training data, or the validation data (null when there is none).
  virtual std::unique_ptr<DataSource> open_data(const TrainOptions& o, bool train,
                                                int64_t seq_len) const = 0;
  // Nats a model that ignores its input would reach on the training data (NaN: not known).
  virtual double baseline_loss(const TrainOptions& o) const = 0;
  // After the run (every rank of a model without pipeline stages: its forwards may be
  // collective; `print` on the chief): what the family shows of the trained model beyond its loss
  // and accuracy, e.g. the captioner's greedy captions. Nothing by default.
  virtual void report(TrainableModel& /*model*/, const DataSource& /*valid*/, DType /*dtype*/,
                      const TrainOptions& /*o*/, bool /*print*/) const {}
};

}  // namespace octet::train_detail
