"""The ViT of `octet bench train`'s peer (bench/peers/torch_train.py runs it), in eager PyTorch 1.13.

As octet's ViT (src/models/vit.cpp): P x P patches embedded by one linear layer, a class token,
learned positions, pre-norm blocks without a mask (torch_gpt.py's Block: LayerNorm, fused QKV
attention, GELU-tanh MLP, biases), the class token's final LayerNorm and a linear head trained
with cross-entropy."""
import torch
import torch.nn as nn
import torch.nn.functional as F

from torch_gpt import Block


class ViT(nn.Module):
    def __init__(self, config):
        super().__init__()
        for key, expected in {"normalization": "layernorm", "activation": "gelu"}.items():
            if config.get(key, expected) != expected:
                raise SystemExit(f"torch_vit.py: config {key}={config[key]!r} is not supported "
                                 f"(expected {expected!r})")
        hidden = config["hidden"]
        self.size, self.patch = config["image_size"], config["patch_size"]
        self.channels = config.get("channels", 1)
        ffn = config.get("ffn_hidden", 0) or 4 * hidden
        eps = config.get("layernorm_eps", 1e-6)
        std = config.get("init_std", 0.02)
        patches = (self.size // self.patch) ** 2
        self.patch_embed = nn.Linear(self.channels * self.patch * self.patch, hidden)
        self.cls_token = nn.Parameter(torch.randn(1, 1, hidden) * std)
        self.pos_embed = nn.Parameter(torch.randn(1, patches + 1, hidden) * std)
        self.blocks = nn.ModuleList(
            Block(hidden, config["num_heads"], ffn, eps) for _ in range(config["num_layers"]))
        self.norm = nn.LayerNorm(hidden, eps=eps)
        self.head = nn.Linear(hidden, config["num_classes"])
        for name, p in self.named_parameters():
            if p.dim() == 2:
                nn.init.normal_(p, 0.0, std)
            elif "ln" not in name and "norm" not in name and p.dim() == 1:
                nn.init.zeros_(p)

    def forward(self, pixels, labels):
        b, p = pixels.shape[0], self.patch
        img = pixels.view(b, self.channels, self.size, self.size)
        patches = img.unfold(2, p, p).unfold(3, p, p).permute(0, 2, 3, 1, 4, 5)
        x = self.patch_embed(patches.reshape(b, -1, self.channels * p * p))
        # The residual stream in FP32, as torch_gpt.py's (autocast casts each linear's input).
        x = torch.cat([self.cls_token.expand(b, 1, x.shape[-1]), x.float()], 1) + self.pos_embed
        for block in self.blocks:
            x = block(x, None)
        logits = self.head(self.norm(x[:, 0]))
        return F.cross_entropy(logits.float(), labels)


def mock_batch(config, batch, generator):
    """Uniform pixels in [-1, 1] and uniform labels."""
    pixels = torch.rand(batch, config.get("channels", 1) * config["image_size"] ** 2,
                        generator=generator) * 2 - 1
    labels = torch.randint(0, config["num_classes"], (batch,), generator=generator)
    return pixels, labels
