// Norm module: LayerNorm or RMSNorm over the last dimension (ops in src/ops/normalization).
#include "modules/common.h"
#include "octet/ops/elementwise.h"
#include "octet/ops/normalization.h"

namespace octet {

Norm::Norm(const NormOptions& options)
    : weight(modules_detail::constant_parameter(options.name + ".weight", {options.hidden},
                                                options.zero_centered_gamma ? 0.0f : 1.0f)),
      options_(options) {
  OCTET_CHECK(options.hidden > 0, options.name, ": hidden must be positive, got ", options.hidden);
  if (options.kind == NormKind::LayerNorm) {
    bias = modules_detail::constant_parameter(options.name + ".bias", {options.hidden}, 0.0f);
  }
}

void Norm::collect_parameters(std::vector<Parameter*>& out) {
  out.push_back(&weight);
  if (options_.kind == NormKind::LayerNorm) out.push_back(&bias);
}

namespace {

void run_norm_forward(const NormOptions& o, Norm& norm, const Tensor& x, Norm::Context& ctx,
                      Tensor& y, ops::Fp8Store* store) {
  OCTET_CHECK(x.ndim() >= 1 && x.cols() == o.hidden, o.name,
              ": input expected [..., hidden=", o.hidden, "], got ", shape_str(x.shape()));
  ctx.input = x;
  ctx.rstd = Tensor::empty({x.rows()}, DType::F32);
  if (o.kind == NormKind::LayerNorm) {
    ctx.mean = Tensor::empty({x.rows()}, DType::F32);
    ops::layernorm_forward(x, norm.weight.value, &norm.bias.value, o.eps, o.zero_centered_gamma, y,
                           ctx.mean, ctx.rstd, store);
  } else {
    ops::rmsnorm_forward(x, norm.weight.value, o.eps, o.zero_centered_gamma, y, ctx.rstd, store);
  }
}

}  // namespace

Tensor Norm::forward(const Tensor& x, Context& ctx) {
  Tensor y = Tensor::empty(x.shape(), x.dtype());
  run_norm_forward(options_, *this, x, ctx, y, nullptr);
  return y;
}

void Norm::forward_fp8(const Tensor& x, Context& ctx, ops::Fp8Store& store) {
  Tensor none;
  run_norm_forward(options_, *this, x, ctx, none, &store);
}

Tensor Norm::backward(const Tensor& dy, Context& ctx) {
  OCTET_CHECK(ctx.input.defined(), options_.name, ": backward called without a forward context");
  Tensor dx = Tensor::empty(ctx.input.shape(), dy.dtype());
  Tensor dgamma = Tensor::empty({options_.hidden}, DType::F32);
  Tensor dy_shaped = dy.reshape(ctx.input.shape());
  if (options_.kind == NormKind::LayerNorm) {
    Tensor dbeta = Tensor::empty({options_.hidden}, DType::F32);
    ops::layernorm_backward(dy_shaped, ctx.input, ctx.mean, ctx.rstd, weight.value,
                            options_.zero_centered_gamma, dx, dgamma, &dbeta);
    ops::add_scaled(dbeta, 1.0f, bias.grad);
  } else {
    ops::rmsnorm_backward(dy_shaped, ctx.input, ctx.rstd, weight.value,
                          options_.zero_centered_gamma, dx, dgamma);
  }
  ops::add_scaled(dgamma, 1.0f, weight.grad);
  ctx = Context{};
  return dx;
}

}  // namespace octet
