"""Multi-head Latent Attention (MLA), DeepSeek-V2 paper section 2.1 / DeepSeek-V3.

Training form (keys and values are materialised per head; no KV cache):

```
q   = wq(x)                             if q_lora_rank == 0
    = wq_b(q_norm(wq_a(x)))             otherwise            [B, S, N*Dq]
q   = [q_nope (Dn) | q_pe (Dr)] per head; q_pe <- RoPE(q_pe)
c, k_pe = split(wkv_a(x), [C, Dr])                             c: [B,S,C]; k_pe: [B,S,Dr]
k_pe <- RoPE(k_pe)                      one rope key shared by all N heads
[k_nope (Dn) | v (Dv)] per head = wkv_b(kv_norm(c))
k   = [k_nope | k_pe]                   per head
o   = causal softmax(q k^T / sqrt(Dq)) v                        [B, S, N, Dv]
out = wo(o)                                                     [B, S, H]
```

Shape letters: B batch, S sequence, H ``hidden_size``, N ``num_attention_heads``,
Dn ``qk_nope_head_dim``, Dr ``qk_rope_head_dim``, Dq = Dn + Dr (``qk_head_dim``),
Dv ``v_head_dim``, C ``kv_lora_rank``, Q ``q_lora_rank``.

The softmax scale is ``Dq ** -0.5``, multiplied by ``mscale**2`` when YaRN
``rope_scaling`` extends the context (``mscale = 0.1·mscale_all_dim·ln(factor) + 1``,
as DeepSeek-V3's reference ``MLA.__init__``; see :mod:`dropless.model.rope`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dropless.config import ModelArgs
from dropless.model.norm import RMSNorm
from dropless.model.rope import rope_tail
from dropless.ops.keys_values import keys_values


class _SplitLast(torch.autograd.Function):
    """``x.split(sizes, dim=-1)`` whose backward writes each gradient into its slice of one buffer.

    Autograd's own split backward concatenates the part gradients with ``CatArrayBatchedCopy``;
    here one ``copy_`` per part into an uninitialised buffer (:func:`_join_last`). A part with no
    gradient gets zeros. Forward returns views of ``x``, as ``split`` does. MLA uses it for
    ``wkv_a``'s output ``[c | k_pe]``; with the copies that then build the keys
    (:func:`~dropless.ops.keys_values.keys_values`) no ``CatArrayBatchedCopy`` over MLA's parts is
    left in an eager step.
    """

    @staticmethod
    def forward(ctx, x, sizes):
        ctx.sizes = sizes
        ctx.set_materialize_grads(False)  # an unused part's gradient arrives as None: no zeros tensor
        return tuple(x.split(sizes, dim=-1))

    @staticmethod
    def backward(ctx, *grads):
        return _join_last(grads, ctx.sizes), None


def _join_last(parts: tuple[torch.Tensor | None, ...], sizes: list[int]) -> torch.Tensor | None:
    """``cat(parts, -1)`` by one ``copy_`` per part into a new buffer; a None part is zeros.

    None when every part is None (no gradient reached the node). With grad mode on (a backward
    run with ``create_graph=True``) the plain, differentiable ``cat``.
    """
    first = next((p for p in parts if p is not None), None)
    if first is None:
        return None
    if torch.is_grad_enabled():
        return torch.cat([first.new_zeros(*first.shape[:-1], n) if p is None else p for p, n in zip(parts, sizes)],
                         dim=-1)
    out = torch.empty(*first.shape[:-1], sum(sizes), dtype=first.dtype, device=first.device)
    for dst, p in zip(out.split(sizes, dim=-1), parts):
        if p is None:
            dst.zero_()
        else:
            dst.copy_(p)
    return out


def split_last(x: torch.Tensor, sizes: list[int]) -> tuple[torch.Tensor, ...]:
    """``torch.split(x, sizes, dim=-1)``; eagerly through :class:`_SplitLast` (copy-based backward).

    Args:
        x: [..., sum(sizes)], any dtype.
        sizes: widths of the parts along the last dimension.
    Returns:
        the parts, views of ``x`` (``[..., sizes[i]]``). Differentiable twice.

    Under ``torch.compile``, without grad mode or when ``x`` needs no gradient, the plain split
    (compiled, the compiler writes the backward's concatenation as one fused kernel of its own).
    """
    if torch.compiler.is_compiling() or not torch.is_grad_enabled() or not x.requires_grad:
        return torch.split(x, sizes, dim=-1)
    return _SplitLast.apply(x, sizes)


class MLA(nn.Module):
    """Multi-head Latent Attention with causal masking.

    Args:
        args: model config; reads ``hidden_size``, ``num_attention_heads``,
            ``q_lora_rank`` (0 / None: a direct ``wq``), ``kv_lora_rank``,
            ``qk_nope_head_dim``, ``qk_rope_head_dim``, ``v_head_dim``, ``rms_norm_eps``,
            ``rope_scaling`` (the YaRN softmax-scale factor).

    Parameters (all ``nn.Linear`` without bias; weight shape is [out, in]):
        wq:    [N*Dq, H]                (only when q_lora_rank == 0)
        wq_a:  [Q, H], q_norm: RMSNorm(Q), wq_b: [N*Dq, Q]   (q_lora_rank > 0)
        wkv_a: [C + Dr, H], kv_norm: RMSNorm(C), wkv_b: [N*(Dn+Dv), C]
        wo:    [H, N*Dv]

    Raises:
        ValueError: a dimension is not positive, or ``qk_rope_head_dim`` is odd.
    """

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.dim = args.hidden_size
        self.n_heads = args.num_attention_heads
        self.q_lora_rank = int(args.q_lora_rank or 0)
        self.kv_lora_rank = args.kv_lora_rank
        self.qk_nope_head_dim = args.qk_nope_head_dim
        self.qk_rope_head_dim = args.qk_rope_head_dim
        self.qk_head_dim = args.qk_nope_head_dim + args.qk_rope_head_dim
        self.v_head_dim = args.v_head_dim
        for name, value in (("hidden_size", self.dim), ("num_attention_heads", self.n_heads),
                            ("kv_lora_rank", self.kv_lora_rank),
                            ("qk_rope_head_dim", self.qk_rope_head_dim),
                            ("v_head_dim", self.v_head_dim)):
            if value <= 0:
                raise ValueError(f"MLA: {name}={value} must be positive")
        if self.q_lora_rank < 0:
            raise ValueError(f"MLA: q_lora_rank={self.q_lora_rank} must be >= 0 "
                             "(0 or null: no query compression)")
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"MLA: qk_rope_head_dim={self.qk_rope_head_dim} must be even")
        yarn = args.yarn()
        self.softmax_scale = self.qk_head_dim ** -0.5 * (yarn.softmax_mscale ** 2 if yarn else 1.0)

        if self.q_lora_rank == 0:
            self.wq = nn.Linear(self.dim, self.n_heads * self.qk_head_dim, bias=False)
        else:
            self.wq_a = nn.Linear(self.dim, self.q_lora_rank, bias=False)
            self.q_norm = RMSNorm(self.q_lora_rank, eps=args.rms_norm_eps)
            self.wq_b = nn.Linear(self.q_lora_rank, self.n_heads * self.qk_head_dim, bias=False)
        self.wkv_a = nn.Linear(self.dim, self.kv_lora_rank + self.qk_rope_head_dim, bias=False)
        self.kv_norm = RMSNorm(self.kv_lora_rank, eps=args.rms_norm_eps)
        self.wkv_b = nn.Linear(self.kv_lora_rank,
                               self.n_heads * (self.qk_nope_head_dim + self.v_head_dim), bias=False)
        self.wo = nn.Linear(self.n_heads * self.v_head_dim, self.dim, bias=False)

    def forward(self, x_BSH: torch.Tensor, rope_cos_SP: torch.Tensor,
                rope_sin_SP: torch.Tensor) -> torch.Tensor:
        """Causal MLA over the whole sequence.

        Args:
            x_BSH: [B, S, H] normalised hidden states.
            rope_cos_SP, rope_sin_SP: [S, Dr/2] tables from
                :func:`dropless.model.rope.rope_cos_sin`.

        Returns:
            [B, S, H] in ``x``'s dtype.
        """
        B, S, _ = x_BSH.shape
        N, Dn, Dr, Dv = self.n_heads, self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim

        # Queries: [B, S, N, Dq] = nope part | rope part.
        if self.q_lora_rank == 0:
            q_BSX = self.wq(x_BSH)
        else:
            q_BSX = self.wq_b(self.q_norm(self.wq_a(x_BSH)))
        # RoPE on each head's last Dr features, written with the nope part into one new tensor
        # (no split + concatenation, nothing saved but the tables)
        q_BSND = rope_tail(q_BSX.view(B, S, N, self.qk_head_dim), rope_cos_SP, rope_sin_SP)

        # Compressed KV latent c [B, S, C] and the shared rope key k_pe [B, S, 1, Dr].
        kv_BSX = self.wkv_a(x_BSH)
        c_BSC, k_pe_BSr = split_last(kv_BSX, [self.kv_lora_rank, Dr])
        k_pe_BS1r = rope_tail(k_pe_BSr.unsqueeze(2), rope_cos_SP, rope_sin_SP)

        # Per-head keys and values up-projected from the normalised latent.
        kv_BSNX = self.wkv_b(self.kv_norm(c_BSC)).view(B, S, N, Dn + Dv)
        k_BSND, v_BSNv = keys_values(kv_BSNX, k_pe_BS1r, Dn)  # k = [k_nope | k_pe] per head

        # SDPA wants [B, N, S, D].
        o_BNSv = F.scaled_dot_product_attention(
            q_BSND.transpose(1, 2), k_BSND.transpose(1, 2), v_BSNv.transpose(1, 2),
            is_causal=True, scale=self.softmax_scale,
        )
        o_BSX = o_BNSv.transpose(1, 2).reshape(B, S, N * Dv)
        return self.wo(o_BSX)

    @torch.no_grad()
    def init_weights(self, std: float = 0.02, generator: torch.Generator | None = None) -> None:
        """Normal(0, std) on every projection, ones on ``q_norm`` / ``kv_norm``."""
        for lin in self.linears():
            lin.weight.normal_(0.0, std, generator=generator)
        for norm in self.norms():
            norm.init_weights()

    def linears(self) -> list[nn.Linear]:
        """The projections in forward order (``wq`` or ``wq_a``/``wq_b``, ``wkv_a``, ``wkv_b``, ``wo``)."""
        q = [self.wq] if self.q_lora_rank == 0 else [self.wq_a, self.wq_b]
        return q + [self.wkv_a, self.wkv_b, self.wo]

    def norms(self) -> list[RMSNorm]:
        return ([] if self.q_lora_rank == 0 else [self.q_norm]) + [self.kv_norm]

    def extra_repr(self) -> str:
        return (f"n_heads={self.n_heads}, q_lora_rank={self.q_lora_rank}, "
                f"kv_lora_rank={self.kv_lora_rank}, qk_nope={self.qk_nope_head_dim}, "
                f"qk_rope={self.qk_rope_head_dim}, v={self.v_head_dim}")


Attention = MLA
