"""The sequence-wise aux loss joins the loss the caller backpropagates (issue 11 items 1-2).

Its gradient is scaled exactly like the cross-entropy's: splitting a batch into
gradient-accumulation micro-batches, or multiplying the loss by s, gives the same
(s×) gradients, the routers' included. Before, the MoE layer gave the aux loss a
gradient of 1 in every backward, whatever factor was on the loss.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from dropless.config import ModelArgs
from dropless.model import Transformer
from dropless.moe import MoE
from dropless.train.config import compose
from dropless.train.trainer import Trainer

ALPHA = 0.05  # large enough that the aux loss moves the router gradient by a visible amount


def tiny_args(**kw) -> ModelArgs:
    d = dict(vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
             num_hidden_layers=3, first_k_dense_replace=1, num_attention_heads=2, q_lora_rank=0,
             kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
             n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=4, topk_group=2,
             max_position_embeddings=64, aux_loss_alpha=ALPHA, gemm="loop", seed=5)
    d.update(kw)
    return ModelArgs(**d)


def _model(**kw) -> Transformer:
    m = Transformer(tiny_args(**kw.pop("args", {})), **kw).double()
    m.init_weights()
    m.train()
    return m


def _grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _tokens(b=2, s=12, seed=0):
    t = torch.randint(0, 64, (b, s + 1), generator=torch.Generator().manual_seed(seed))
    return t[:, :-1], t[:, 1:]


def _router_grad_share(model, x, y) -> float:
    """How much of the router weights' gradient the aux loss contributes (relative)."""
    out = model.loss(x, y)
    g_all = torch.autograd.grad(out.loss, [moe.router.weight for moe in model.moe_layers()])
    model.zero_grad()
    out = model.loss(x, y)
    g_ce = torch.autograd.grad(out.ce, [moe.router.weight for moe in model.moe_layers()])
    return max(((a - b).norm() / a.norm()).item() for a, b in zip(g_all, g_ce))


def test_loss_is_ce_plus_the_layers_aux_losses():
    model = _model()
    x, y = _tokens()
    out = model.loss(x, y)
    logits = model(x)
    ce = torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())
    aux = sum(moe.aux_loss for moe in model.moe_layers())
    assert len(model.moe_layers()) == 2 and aux.item() > 0
    torch.testing.assert_close(out.ce, ce.to(out.ce.dtype), rtol=1e-12, atol=0)
    torch.testing.assert_close(out.aux, aux.to(out.aux.dtype), rtol=1e-12, atol=0)
    torch.testing.assert_close(out.loss, out.ce + out.aux, rtol=0, atol=0)
    # each layer's aux loss is α·E/k·Σ f P ≥ α (equality when balanced): the sum holds both layers'
    assert out.aux.item() >= 2 * ALPHA * 0.999
    assert _router_grad_share(model, x, y) > 0.05                 # the aux term is not negligible
    model.eval()
    with torch.no_grad():
        assert model.loss(x, y).aux.item() == 0.0                  # eval: no aux loss


@pytest.mark.parametrize("ckpt", [False, True])
def test_grad_accum_split_gives_the_same_gradients(ckpt):
    """1 micro-batch of 2 sequences == 2 micro-batches of 1 (each loss / 2), every gradient."""
    x, y = _tokens()
    whole = _model(activation_checkpointing=ckpt)
    whole.loss(x, y).loss.backward()
    split = _model(activation_checkpointing=ckpt)
    for i in range(2):
        (split.loss(x[i:i + 1], y[i:i + 1]).loss / 2).backward()
    want, got = _grads(whole), _grads(split)
    assert want.keys() == got.keys()
    routers = [n for n in want if n.endswith("router.weight")]
    assert len(routers) == 2
    for n in want:  # the router's logits are fp32 by design (docs/design.md#precision), the rest float64
        tol = 1e-5 if n in routers else 1e-9
        torch.testing.assert_close(got[n], want[n], rtol=tol, atol=tol * want[n].abs().max().item(), msg=n)
    # the routers counted each token once (counting rule of docs/design.md#the-router), also under recompute
    for a, b in zip(whole.moe_layers(), split.moe_layers()):
        assert a.router.tokens_per_expert.sum() == 2 * 12 * 2
        assert torch.equal(a.router.tokens_per_expert, b.router.tokens_per_expert)


def test_scaled_loss_scales_every_gradient():
    x, y = _tokens()
    s = 8.0
    m1 = _model()
    m1.loss(x, y).loss.backward()
    m2 = _model()
    (s * m2.loss(x, y).loss).backward()
    g1, g2 = _grads(m1), _grads(m2)
    for n in g1:
        torch.testing.assert_close(g2[n], s * g1[n], rtol=1e-10, atol=1e-14, msg=n)


def test_activation_checkpointing_keeps_the_aux_gradient():
    x, y = _tokens()
    a, b = _model(), _model(activation_checkpointing=True)
    la, lb = a.loss(x, y), b.loss(x, y)
    assert torch.equal(la.loss, lb.loss)
    la.loss.backward()
    lb.loss.backward()
    ga, gb = _grads(a), _grads(b)
    for n in ga:
        torch.testing.assert_close(gb[n], ga[n], rtol=0, atol=0, msg=n)


def _moe(alpha=ALPHA):
    args = ModelArgs(hidden_size=16, moe_intermediate_size=8, n_routed_experts=8, num_experts_per_tok=2,
                     n_group=4, topk_group=2, aux_loss_alpha=alpha, gemm="loop")
    m = MoE(args, 0).double()
    m.init_weights(1)
    return m


@pytest.mark.parametrize("reentrant", [None, False, True])
def test_standalone_layer_aux_loss_joins_the_users_loss(reentrant):
    """``loss = task + moe.aux_loss``: the router gradient is that of task + aux, once per backward,
    scaled with the loss; the same through torch.utils.checkpoint with ``return_aux=True``."""
    x = torch.randn(3, 10, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(2),
                    requires_grad=True)  # the reentrant checkpoint needs an input that requires grad
    w_out = torch.randn(3, 10, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(3))

    def router_grad(scale, m):
        if reentrant is None:
            y = m(x)
            aux = m.aux_loss
        else:
            y, aux = checkpoint(m, x, True, use_reentrant=reentrant)
        loss = (y * w_out).sum() + aux
        (scale * loss).backward()
        return m.router.weight.grad.clone()

    ref = _moe()
    y = ref(x)
    task = torch.autograd.grad((y * w_out).sum(), ref.router.weight, retain_graph=True)[0]
    aux = torch.autograd.grad(ref.aux_loss, ref.router.weight)[0]
    assert aux.norm() > 0.01 * task.norm()
    tol = dict(rtol=1e-5, atol=1e-6 * task.abs().max().item())   # fp32 router logits
    torch.testing.assert_close(router_grad(1.0, _moe()), task + aux, **tol)
    torch.testing.assert_close(router_grad(3.0, _moe()), 3 * (task + aux), **tol)


def test_module_with_an_aux_graph_tensor_deep_copies():
    m = _model()
    m.loss(*_tokens())
    assert m.moe_layers()[0].aux_loss.requires_grad
    c = copy.deepcopy(m)
    assert c.moe_layers()[0].aux_loss is None


# ------------------------------------------------------------------ the trainer
# device=cpu: the test patches the loader's next_batch and optimizer.step, which a CUDA run (pinned
# windows, the fused AdamW's guarded step) does not call
QUICK = ["device=cpu", "train.micro_batch_size=8", "train.seq_len=32", "train.val_every=0", "train.val_batches=1",
         "logging.progress=false", "logging.mode=disabled", "num_threads=1", "train.steps=1",
         f"model.aux_loss_alpha={ALPHA}", "model.hidden_size=32", "model.num_hidden_layers=3"]


def _trainer_step(tmp_path, name, mb, accum, batch):
    """One trainer step on the given [2, S+1] token windows; returns (grads, metrics record)."""
    tr = Trainer(compose(QUICK + [f"run_dir={tmp_path / name}", f"train.micro_batch_size={mb}",
                                  f"train.grad_accum={accum}"]))
    try:
        xs, ys = batch[:, :-1], batch[:, 1:]
        micro = iter([(xs[i * mb:(i + 1) * mb], ys[i * mb:(i + 1) * mb]) for i in range(accum)])
        tr.loader.next_batch = lambda: next(micro)
        seen = {}

        def capture():
            seen.update({n: p.grad.clone() for n, p in tr.model.named_parameters() if p.grad is not None})

        tr.optimizer.step = capture
        rec = tr.train_step()
        return seen, rec
    finally:
        tr.close()


def test_trainer_accumulation_gives_the_same_gradients_and_aux_mean(tmp_path):
    batch = torch.randint(0, 256, (2, 33), generator=torch.Generator().manual_seed(7))
    g1, r1 = _trainer_step(tmp_path, "a", 2, 1, batch)
    g2, r2 = _trainer_step(tmp_path, "b", 1, 2, batch)
    assert g1.keys() == g2.keys()
    assert any(n.endswith("router.weight") for n in g1)
    for n in g1:
        torch.testing.assert_close(g2[n], g1[n], rtol=2e-5, atol=1e-8, msg=n)
    # the logged aux loss is the mean over the step's micro-batches (the per-sequence mean)
    assert r1["aux_loss"] > 0
    assert r2["aux_loss"] == pytest.approx(r1["aux_loss"], rel=1e-5)
    assert r2["loss"] == pytest.approx(r1["loss"], rel=1e-5)
