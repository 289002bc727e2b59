// What the pipeline executor runs: the model chunks one pipeline rank holds, each with a
// forward and a backward per micro-batch. Declared with the pipeline (the parallel layer), so
// any model - a GPT, an encoder-decoder, a vision model - is staged by implementing it; the
// executor knows no model.
#pragma once

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "octet/module.h"
#include "octet/tensor.h"

namespace octet::pipeline {

// One micro-batch: the named tensors a model's stages read (a GPT: "ids" and "targets" [B,T]
// I32; other models add masks, images, encoder states ...). Every pipeline rank gets the whole
// map: the first stage reads its inputs, the last its targets, every stage their shapes.
using MicroBatch = std::map<std::string, Tensor>;
// batch[name], or an error naming what `who` expected and what the micro-batch holds.
const Tensor& batch_tensor(const MicroBatch& batch, const std::string& name, const char* who);

// Parameters of which several pipeline stages hold a copy (a word embedding tied to the
// output layer: the first and the last stage). The executor sums the copies' gradients over
// the ranks holding those stages after each step; the optimizer updates each copy alike.
struct TiedParameters {
  std::vector<int> stages;             // the stages holding a copy, in order
  std::vector<Parameter*> parameters;  // this rank's copies (empty where it holds none)
};

class StagedModel : public Module {
 public:
  // What backward needs of one (micro-batch, chunk) forward; each model extends it.
  struct Context {
    Context() = default;
    Context(const Context&) = default;
    Context(Context&&) = default;
    Context& operator=(const Context&) = default;
    Context& operator=(Context&&) = default;
    virtual ~Context() = default;
    float loss = 0.0f;  // last stage: the micro-batch's mean loss
  };
  virtual std::unique_ptr<Context> make_context() const = 0;

  virtual int chunks() const = 0;
  virtual int stages() const = 0;
  virtual int stage_of_chunk(int chunk) const = 0;
  // The activation (and its gradient) crossing a stage boundary for this micro-batch, in the
  // compute dtype.
  virtual Shape activation_shape(const MicroBatch& batch) const = 0;
  // The activation entering stage `stage` (1 .. stages-1; its gradient leaves it), for models
  // whose boundaries differ (the captioner: image tokens inside the vision tower, prefix and
  // caption tokens inside the decoder). By default every boundary's is activation_shape().
  virtual Shape boundary_shape(const MicroBatch& batch, int stage) const {
    (void)stage;
    return activation_shape(batch);
  }

  // First stage: the micro-batch's inputs (input unused); otherwise input activation_shape()
  // in dtype (F32 / BF16). Returns the chunk's output activation. On the last stage it also
  // runs the loss (ctx.loss, the micro-batch's mean) and the output layer's backward (its
  // gradients scaled by grad_scale), and returns an undefined tensor.
  virtual Tensor forward(int chunk, const Tensor& input, const MicroBatch& batch, DType dtype,
                         float grad_scale, Context& ctx) = 0;
  // doutput shaped like forward's output (ignored on the last stage, which kept its own) -> the
  // gradient of the chunk's input; on the first stage the input layers' gradients are
  // accumulated instead and the result is undefined. Weight gradients accumulate. Frees ctx.
  virtual Tensor backward(int chunk, const Tensor& doutput, Context& ctx) = 0;
  // Evaluation: forward's input and output, keeping nothing for backward and computing no
  // gradient; on the last stage *loss is the micro-batch's mean loss.
  virtual Tensor evaluate(int chunk, const Tensor& input, const MicroBatch& batch, DType dtype,
                          float* loss) = 0;

  // The model's groups of tied parameters (every group, also where this rank holds none).
  virtual std::vector<TiedParameters> tied_parameters() = 0;
  // This chunk's parameters.
  virtual std::vector<Parameter*> chunk_parameters(int chunk) = 0;
  // This rank's chunks by the stage they hold, first stage first.
  std::vector<int> chunks_in_stage_order() const;
  // This rank's copies of tied parameters, every group's.
  std::vector<Parameter*> tied_copies();
};

}  // namespace octet::pipeline
