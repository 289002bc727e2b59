"""Cross-entropy reference: torch.nn.functional.cross_entropy in float64, with autograd."""
import torch
import torch.nn.functional as F

from registry import op


@op("cross_entropy")
def cross_entropy(t, args):
    """logits [N,V], targets [N] -> losses [N] (reduction='none'), mean [1]
    (reduction='mean') and dlogits = d(mean)/d(logits)."""
    logits = t["logits"].double().requires_grad_(True)
    targets = t["targets"].long()
    kwargs = dict(ignore_index=args.get("ignore_index", -100),
                  label_smoothing=args.get("label_smoothing", 0.0))
    losses = F.cross_entropy(logits, targets, reduction="none", **kwargs)
    mean = F.cross_entropy(logits, targets, reduction="mean", **kwargs)
    mean.backward()
    return {"losses": losses, "mean": mean.reshape(1), "dlogits": logits.grad}
