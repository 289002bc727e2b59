"""Mixture-of-experts routing in float64 with autograd, as Megatron-Core computes it: the router
(softmax or sigmoid scores, top-k on the scores plus an optional expert bias, optional
normalization of the chosen scores with Megatron's 1e-20 guard, a scaling factor, the
switch-style auxiliary loss and the z-loss) and the permutation of tokens by expert and back."""
import torch

from registry import op


@op("moe_router")
def router(t, args):
    logits = t["logits"].double().requires_grad_()
    n, e = logits.shape
    k = args["topk"]
    if args["score"] == "softmax":
        scores = torch.softmax(logits, dim=-1)
    else:
        scores = torch.sigmoid(logits)
    # The choice on float32 keys, as octet makes it (score rounded to float32, plus the bias),
    # equal keys by the lower index (a stable sort; torch.topk leaves ties' order open, and
    # saturated scores tie: large logits round many softmax scores to 0).
    keys = scores.detach().float()
    if "expert_bias" in t:
        keys = keys + t["expert_bias"].float()
    experts = torch.sort(keys, dim=-1, descending=True, stable=True).indices[:, :k]
    probs = scores.gather(1, experts)
    if args["normalize"]:
        probs = probs / (probs.sum(dim=-1, keepdim=True) + 1e-20)
    probs = probs * args["scaling"]
    counts = torch.bincount(experts.flatten(), minlength=e).double()
    total = (probs * t["dprobs"].double()).sum()
    aux = torch.zeros((), dtype=torch.float64)
    if args["aux_coeff"] > 0:
        weights = scores if args["score"] == "softmax" else \
            scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)
        aux = args["aux_coeff"] * e / (k * n * n) * (weights.sum(dim=0) * counts).sum()
    z = torch.zeros((), dtype=torch.float64)
    if args["z_coeff"] > 0:
        z = args["z_coeff"] * (torch.logsumexp(logits, dim=-1) ** 2).mean()
    (total + aux + z).backward()
    return {"scores": scores, "probs": probs, "experts": experts.double(), "counts": counts,
            "aux": aux.reshape(1), "z": z.reshape(1), "dlogits": logits.grad}


@op("moe_permute")
def permute(t, args):
    """tokens [N,C], experts [N,k], probs [N,k], y_weights [N*k,C] (the experts stand-in: each
    permuted row times its weights), dout [N,C] -> permuted rows (expert-major, token order),
    out = sum_j probs * expert(row), and the gradients of tokens and probs."""
    x = t["tokens"].double().requires_grad_()
    experts = t["experts"].long()
    probs = t["probs"].double().requires_grad_()
    n, k = experts.shape
    flat = experts.flatten()
    order = torch.sort(flat * (n * k) + torch.arange(n * k), stable=True).indices
    permuted = x.repeat_interleave(k, dim=0)[order]
    y = permuted * t["y_weights"].double()
    rows = torch.empty_like(order)
    rows[order] = torch.arange(n * k)
    out = (y[rows].view(n, k, -1) * probs.unsqueeze(-1)).sum(dim=1)
    out.backward(t["dout"].double())
    return {"permuted": permuted, "row_map": rows.view(n, k).double(), "out": out,
            "dtokens": x.grad, "dprobs": probs.grad}


_ACT = {"gelu": lambda a: torch.nn.functional.gelu(a, approximate="tanh"),
        "relu": torch.nn.functional.relu, "silu": torch.nn.functional.silu}
_GATED = {"swiglu": torch.nn.functional.silu,
          "geglu": lambda a: torch.nn.functional.gelu(a, approximate="tanh")}


def _mlp(x, w1, b1, w2, b2, kind):
    h = torch.nn.functional.linear(x, w1, b1)
    if kind in _GATED:
        a, b = h.chunk(2, dim=-1)
        h = _GATED[kind](a) * b
    else:
        h = _ACT[kind](h)
    return torch.nn.functional.linear(h, w2, b2)


@op("moe_layer")
def moe_layer(t, args):
    """Megatron-Core's MoELayer in float64: norm, FP32 router, the k experts each token chose
    (given: octet's choice, tested on its own by moe_router; with a capacity, octet's dispatch,
    tested by moe_capacity_drop's own tests), their outputs weighted by the
    probabilities, plus the shared expert; the auxiliary losses scaled by loss_scale join the
    loss (out * dy).sum(). Returns y, x.grad and every parameter's .grad."""
    leaves = {name: v.double().requires_grad_() for name, v in t.items()
              if name not in ("dy", "experts", "expert_bias", "dispatch")}
    x = leaves["x"]
    n, c = x.shape
    e = args["experts"]
    k = args["topk"]
    kind = args["activation"]
    xn = torch.nn.functional.layer_norm(x, (c,), leaves["norm.weight"], leaves["norm.bias"],
                                        args["eps"])
    logits = xn @ leaves["router.weight"].t()
    scores = torch.softmax(logits, -1) if args["score"] == "softmax" else torch.sigmoid(logits)
    experts = t["experts"].long()
    probs = scores.gather(1, experts)
    if args["normalize"]:
        probs = probs / (probs.sum(-1, keepdim=True) + 1e-20)
    probs = probs * args["scaling"]
    # With a capacity, the pairs it dropped (dispatch == E) reach no expert.
    dispatch = t["dispatch"].long() if "dispatch" in t else experts
    out = torch.zeros_like(x)
    for j in range(k):
        for ex in range(e):
            rows = (dispatch[:, j] == ex).nonzero().flatten()
            if rows.numel() == 0:
                continue
            y = _mlp(xn[rows], leaves[f"experts.fc1.weight{ex}"], leaves.get(f"experts.fc1.bias{ex}"),
                     leaves[f"experts.fc2.weight{ex}"], leaves.get(f"experts.fc2.bias{ex}"), kind)
            out = out.index_add(0, rows, y * probs[rows, j:j + 1])
    if "shared_experts.fc1.weight" in leaves:
        out = out + _mlp(xn, leaves["shared_experts.fc1.weight"],
                         leaves.get("shared_experts.fc1.bias"),
                         leaves["shared_experts.fc2.weight"],
                         leaves.get("shared_experts.fc2.bias"), kind)
    counts = torch.bincount(experts.flatten(), minlength=e).double()
    loss = (out * t["dy"].double()).sum()
    if args["aux_coeff"] > 0:
        weights = scores if args["score"] == "softmax" else \
            scores / (scores.sum(-1, keepdim=True) + 1e-20)
        aux = args["aux_coeff"] * e / (k * n * n) * (weights.sum(0) * counts).sum()
        loss = loss + args["loss_scale"] * aux
    if args["z_coeff"] > 0:
        loss = loss + args["loss_scale"] * args["z_coeff"] * \
            (torch.logsumexp(logits, -1) ** 2).mean()
    loss.backward()
    result = {"y": out}
    for name, leaf in leaves.items():
        result[name + ".grad"] = leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
    return result
