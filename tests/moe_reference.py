"""A float64 reference MoE layer that loops over tokens and their k experts (tests only)."""

from __future__ import annotations

import torch


def reference_moe(x_TH, router_w_EH, topk_idx_Tk, w13_EHI2, w2_EIH, shared, *, scaling: float,
                  norm_topk_prob: bool = True, scoring: str = "sigmoid"):
    """y[t] = Σ_j w[t,j]·expert_{idx[t,j]}(x[t]) + shared(x[t]), everything float64.

    The selection ``topk_idx_Tk`` is taken as given (a discrete choice); the combine weights
    are recomputed from the router weight so its gradient is checked too.
    ``shared``: None or (w1 [F,H], w3 [F,H], w2 [H,F]) of the shared-expert MLP.
    """
    x = x_TH.double()
    logits = x @ router_w_EH.double().t()
    scores = torch.sigmoid(logits) if scoring == "sigmoid" else torch.softmax(logits, -1)
    t_count, k = topk_idx_Tk.shape
    out = []
    for t in range(t_count):
        sel = [int(i) for i in topk_idx_Tk[t]]
        s = torch.stack([scores[t, i] for i in sel])
        w = s / s.sum() if norm_topk_prob else s
        w = w * scaling
        acc = torch.zeros(x.shape[1], dtype=torch.float64)
        for j, e in enumerate(sel):
            h = x[t] @ w13_EHI2[e].double()
            gate, up = h.chunk(2)
            acc = acc + w[j] * ((torch.nn.functional.silu(gate) * up) @ w2_EIH[e].double())
        if shared is not None:
            w1, w3, w2 = (p.double() for p in shared)
            acc = acc + w2 @ (torch.nn.functional.silu(w1 @ x[t]) * (w3 @ x[t]))
        out.append(acc)
    return torch.stack(out)
