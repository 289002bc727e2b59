"""The image captioner (src/models/captioner.cpp) in float64 with autograd, from octet's names.

Vision: CLIP's tower (ops_clip.vision_tokens), then the post-LayerNorm over every token.
Projector (LLaVA-1.5): linear_1 -> GELU (erf) -> linear_2, each with a bias: one prefix token per
image token. Decoder: [prefix; token embeddings of the caption] + learned positions -> causal
pre-norm layers -> final LayerNorm -> logits = hidden x embed_tokens^T (tied). Loss: the mean
cross-entropy of caption token j + 1 from the row of caption token j, over the tokens after the
[SOS] up to and with the [EOS] (j + 1 < length). Dropout is 0.

Op "captioner": the loss, the logits of the caption rows, and every parameter's gradient."""
import torch
import torch.nn.functional as F

from ops_clip import _layers, vision_tokens
from ops_transformer import _norm
from registry import op


def captioner_forward(p, pixels, ids, lengths, c):
    eps = c.get("layernorm_eps", 1e-5)
    x = vision_tokens(p, pixels, c)
    x = _norm(x, p["vision_model.post_layernorm.weight"], p["vision_model.post_layernorm.bias"],
              "layernorm", eps)
    h = F.gelu(F.linear(x, p["multi_modal_projector.linear_1.weight"],
                        p["multi_modal_projector.linear_1.bias"]))
    prefix = F.linear(h, p["multi_modal_projector.linear_2.weight"],
                      p["multi_modal_projector.linear_2.bias"])
    b, t = ids.shape
    tv = prefix.shape[1]
    y = torch.cat([prefix, p["language_model.embed_tokens"][ids]], 1)
    y = y + p["language_model.embed_positions"][:tv + t].unsqueeze(0)
    y = _layers(p, "language_model.layers.", y, c["text_layers"], c["text_heads"], "causal", c)
    y = _norm(y, p["language_model.norm.weight"], p["language_model.norm.bias"], "layernorm", eps)
    logits = y[:, tv:tv + t - 1] @ p["language_model.embed_tokens"].t()  # [B, T-1, V]
    targets = ids[:, 1:].clone()
    positions = torch.arange(1, t).unsqueeze(0).expand(b, t - 1)
    targets[positions >= lengths.unsqueeze(1)] = -100
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                           ignore_index=-100)
    return loss, logits


@op("captioner")
def captioner(t, args):
    params = {n: v.double().requires_grad_() for n, v in t.items()
              if n not in ("pixels", "text_ids", "text_lengths")}
    loss, logits = captioner_forward(params, t["pixels"].double(), t["text_ids"].long(),
                                     t["text_lengths"].long(), args["config"])
    loss.backward()
    out = {"loss": loss.reshape(1), "logits": logits.detach()}
    out.update({n + ".grad": p.grad.clone() for n, p in params.items()})
    return out
