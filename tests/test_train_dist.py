"""Trainer gradient sync on 2 gloo ranks equals one process on the whole batch.

Each rank takes half of a fixed global batch; after ``sync_gradients`` every gradient
(non-expert: replicated; expert: this rank's shard under a2a/agrs with EP = 2) and the global
grad norm must equal those of a single process that runs the whole batch through the same
model with the local dispatcher (fp32; tolerance 1e-5 relative to the largest entry).
After one AdamW step the router biases, updated from counts summed over the ranks, must
equal the single-process ones exactly.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from dropless.train.config import compose, model_args
from dropless.train.dist import DistEnv
from tests.grad_reference import grad_norm_and_clip, sync_gradients

WORLD = 2
B, S = 4, 32


def _batch(vocab: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1234)
    return torch.randint(0, vocab, (B, S + 1), generator=g)


def _model(args, factory=None):
    from dropless.model import Transformer
    m = Transformer(args, dispatcher_factory=factory)
    m.init_weights(0)
    return m


def _step(model, x, env):
    from dropless.routing import update_router_biases
    logits = model(x[:, :-1])
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))
    loss.backward()
    params = list(model.parameters())
    expert_ids = {id(p) for p in model.expert_parameters()}
    sync_gradients(params, expert_ids, env)
    norm = grad_norm_and_clip(params, expert_ids, env, None)
    update_router_biases(model)
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    biases = {n: b.clone() for n, b in model.named_buffers() if n.endswith("e_score_correction_bias")}
    return grads, norm, biases


def _worker(rank, tmp, dispatcher, q):
    os.environ.update(MASTER_ADDR="127.0.0.1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank, world_size=WORLD)
    try:
        from dropless.dispatch import build_dispatcher
        from dropless.dispatch.mesh import build_mesh
        ep = WORLD if dispatcher in ("a2a", "agrs") else 1
        mesh = build_mesh(WORLD, ep, "cpu")
        env = DistEnv(rank, WORLD, rank, WORLD, torch.device("cpu"), ep, WORLD // ep, mesh,
                      mesh.get_group("ep") if ep > 1 else None, mesh.get_group("dp"))
        args = model_args(compose())
        factory = None if dispatcher == "local" else (
            lambda i: build_dispatcher(dispatcher, args, ep_group=env.ep_group))
        model = _model(args, factory)
        x = _batch(args.vocab_size)[rank * (B // WORLD):(rank + 1) * (B // WORLD)]
        grads, norm, biases = _step(model, x, env)
        offset = model.moe_layers()[0].experts.expert_offset
        # numpy arrays pickle by value (torch tensors would need this process alive to be read)
        q.put((rank, {k: v.numpy() for k, v in grads.items()}, norm, {k: v.numpy() for k, v in biases.items()},
               offset))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("dispatcher", ["local", "a2a"])
def test_two_rank_gradients_equal_one_process(tmp_path, dispatcher):
    args = model_args(compose())
    ref_model = _model(args)
    one = DistEnv(0, 1, 0, 1, torch.device("cpu"), 1, 1)
    ref_grads, ref_norm, ref_bias = _step(ref_model, _batch(args.vocab_size), one)
    expert_names = {n for n, p in ref_model.named_parameters() if any(p is q for q in ref_model.expert_parameters())}

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, str(tmp_path), dispatcher, q)) for r in range(WORLD)]
    for p in procs:
        p.start()
    results = [q.get(timeout=240) for _ in range(WORLD)]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    for rank, grads, norm, biases, offset in results:
        grads = {k: torch.from_numpy(v) for k, v in grads.items()}
        biases = {k: torch.from_numpy(v) for k, v in biases.items()}
        assert norm == pytest.approx(ref_norm, rel=1e-5)
        for name, g in grads.items():
            want = ref_grads[name]
            if name in expert_names and dispatcher == "a2a":
                want = want[offset:offset + g.shape[0]]          # this rank's experts
            assert g.shape == want.shape, name
            err = (g - want).abs().max() / want.abs().max().clamp_min(1e-30)
            assert err < 1e-5, (rank, name, float(err))
        for name, b in biases.items():
            assert torch.equal(b, ref_bias[name]), name


# ------------------------------------------------------------------ bucketed, overlapped all-reduce
def _bucket_worker(rank, world, tmp, dispatcher, ep, q):
    """One backward through GradBuckets (tiny buckets, all-reduce launched from the hooks)."""
    from dropless.train.grads import GradBuckets, grad_norm

    os.environ.update(MASTER_ADDR="127.0.0.1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank, world_size=world)
    try:
        from dropless.dispatch import build_dispatcher
        from dropless.dispatch.mesh import build_mesh
        mesh = build_mesh(world, ep, "cpu")
        env = DistEnv(rank, world, rank, world, torch.device("cpu"), ep, world // ep, mesh,
                      mesh.get_group("ep") if ep > 1 else None, mesh.get_group("dp"))
        args = model_args(compose())
        factory = None if dispatcher == "local" else (
            lambda i: build_dispatcher(dispatcher, args, ep_group=env.ep_group))
        model = _model(args, factory)
        per = B // world
        x = _batch(args.vocab_size)[rank * per:(rank + 1) * per]
        params = list(model.parameters())
        sharded = {id(p) for p in model.expert_parameters()} if ep > 1 else set()
        launched = []
        gb = GradBuckets(params, sharded, True, world, dist.new_group(list(range(world))), env.dp_group,
                         env.dp_size, bucket_elems=4096)
        orig = gb._launch
        gb._launch = lambda b: (launched.append(b.launched), orig(b))
        gb.zero_()
        gb.start(sync=True)
        logits = model(x[:, :-1])
        F.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1)).backward()
        in_backward = len(launched)            # buckets whose all-reduce started inside backward
        gb.finish()
        norm = float(grad_norm(gb, [], env))
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        offset = model.moe_layers()[0].experts.expert_offset
        q.put((rank, {k: v.numpy() for k, v in grads.items()}, norm, offset, in_backward, len(gb.buckets)))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("world,dispatcher,ep", [(2, "local", 1), (2, "a2a", 2), (4, "local", 1), (4, "a2a", 2)])
def test_overlapped_bucket_all_reduce_equals_one_process(tmp_path, world, dispatcher, ep):
    """The hooks' bucketed all-reduce (launched during backward) gives the one-process gradients
    and norm on 2 and 4 ranks, replicated (local) and dp x ep = 2 x 2 / 1 x 2 (a2a)."""
    args = model_args(compose())
    ref_model = _model(args)
    one = DistEnv(0, 1, 0, 1, torch.device("cpu"), 1, 1)
    ref_grads, ref_norm, _ = _step(ref_model, _batch(args.vocab_size), one)
    expert_names = {n for n, p in ref_model.named_parameters() if any(p is q for q in ref_model.expert_parameters())}
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_bucket_worker, args=(r, world, str(tmp_path), dispatcher, ep, q))
             for r in range(world)]
    for p in procs:
        p.start()
    results = [q.get(timeout=240) for _ in range(world)]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    for rank, grads, norm, offset, in_backward, n_buckets in results:
        assert n_buckets > 10 and in_backward > n_buckets // 2, (in_backward, n_buckets)   # really overlapped
        assert norm == pytest.approx(ref_norm, rel=1e-5)
        for name, g in grads.items():
            g = torch.from_numpy(g)
            want = ref_grads[name]
            if name in expert_names and ep > 1:
                want = want[offset:offset + g.shape[0]]
            err = (g - want).abs().max() / want.abs().max().clamp_min(1e-30)
            assert err < 1e-5, (rank, name, float(err))
