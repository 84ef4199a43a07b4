"""CUDA graphs of a training step's micro-batches (``train.cuda_graph=true``).

Why: an eager step launches a few thousand kernels from Python, and the GPU waits whenever the host
falls behind (``benchmarks/train_step.py`` reports it as ``gpu_idle_ms_per_step``). A CUDA graph
launches one micro-batch's forward, loss and backward as one call, so the GPU runs back to back.
The pipelined steps (``Trainer.iter_steps``) already hide most of the launch time, so the gain is
small at ``recipe=h200_single`` (docs/performance.md#the-training-step) and larger for a model
with less work per launch.

What is captured, per *kind* of micro-batch (``"first"``: the step's first micro-batch, whose
gradients are copied into the fp32 main-gradient buckets; ``"rest"``: later ones, which add into
them; :class:`~dropless.train.grads.GradBuckets`): everything :class:`MicroBatchGraphs`'s function
launches, i.e. the forward, the loss, the backward, the main-gradient hooks' copies and the routers'
count updates. The optimizer step, the gradient norm, the all-reduces and the metrics stay eager
(a few dozen launches a step).

How it starts: each kind runs eagerly for its first ``warmup`` calls (3 in the trainer), on a side
stream as torch's whole-network capture recipe does, so that lazy initialisation, cuBLAS
workspaces, Triton's first-call tuning and ``torch.compile`` happen outside the capture; its next call captures it
(``torch.cuda.graph``; the capture runs nothing on the GPU) and replays the graph at once, and every
later call copies its window into the graph's static input and replays. All kinds share one memory
pool (they replay one after the other, never at once).

What it needs: CUDA; every shape fixed from step to step (the dropless MoE layer's buffers are
sized by capacity, their live rows ride on the device, so routing never changes a shape);
nothing in forward or backward that syncs with the host or reads host state that changes between
steps (``tests/test_train_gpu.py`` runs the step under ``torch.cuda.set_sync_debug_mode``); no
collective inside (``dispatcher=local``, no FSDP2; the gradient all-reduce runs after the last
micro-batch). The trainer refuses other configurations with a :class:`ConfigError` before any
step and before the run directory is made: :func:`check_capturable` (the dispatcher, ``model.gemm``
other than ``torch``, ``train.shard_dense``: every one at fault named in one error) from the config,
:func:`check_graph_device` (a CPU device) once the device is known, and
:func:`~dropless.model.loss.resolve_loss_impl` (``train.loss_impl=liger``; ``auto`` resolves to torch
under a graph).
What the host does inside the captured function (Python bookkeeping such as the hooks' record of
which main gradients were written) happens at capture only: :meth:`MicroBatchGraphs.__call__`
says whether the call replayed, so the caller repeats that bookkeeping itself. Likewise the
layers' records of their last forward (``Router.stats()``, ``MoE.last_stats``) point at tensors
of the capture, not of later replays: the trainer reads neither (its metrics come from the
function's outputs and the routers' count buffers).

The kinds are captured in the order their warm-up ends (with ``grad_accum`` >= 3 the later
micro-batches' kind is captured in step 2, the first one's in step 4) and share one pool, so
one kind's replay may reuse memory that held another kind's outputs: the outputs of a call are
valid until the next call of *any* kind (the trainer adds them into its step sums at once).

Memory: the graph's pool holds one micro-batch's activation peak for good (as the eager caching
allocator does); ``torch.cuda.max_memory_allocated`` counts the pool's blocks while they are
allocated during the capture, so the recorded peak is the capture's, equal to an eager step's.
"""

from __future__ import annotations

from typing import Callable

import torch

from dropless.config import ConfigError
from dropless.dispatch.base import Dispatcher

__all__ = ["MicroBatchGraphs", "check_capturable", "check_graph_device"]


def check_capturable(kind: type[Dispatcher], gemm: str, shard_dense: bool) -> None:
    """ConfigError naming every setting whose work a captured forward and backward cannot hold.

    Args:
        kind: the dispatcher class (``dispatcher.kind``): it must run no collective
            (:attr:`~dropless.dispatch.base.Dispatcher.collectives` empty: ``local``).
        gemm: ``model.gemm``: ``torch`` only (``loop`` reads the expert offsets on the host; the FP8
            backends keep their weight cache in host logic that a replay would skip).
        shard_dense: ``train.shard_dense``: FSDP2 all-gathers parameters inside forward and backward.
    Raises:
        ConfigError: ``train.cuda_graph=true: ...`` naming each offending setting and its fix.
    """
    problems = []
    if kind.collectives:
        problems.append(f"dispatcher={kind.name}: {kind.collectives} (use dispatcher=local)")
    if gemm != "torch":
        problems.append(f"model.gemm={gemm} is not gemm=torch (gemm=loop reads the expert offsets on the host, "
                        "the FP8 backends keep their weight cache in host logic that a replay would skip; use "
                        "gemm=torch)")
    if shard_dense:
        problems.append("train.shard_dense=true all-gathers parameters inside forward and backward (FSDP2; set "
                        "train.shard_dense=false)")
    if problems:
        raise ConfigError("train.cuda_graph=true: captures forward and backward without collectives or host "
                          f"reads, but {'; '.join(problems)}; or set train.cuda_graph=false")


def check_graph_device(device: torch.device) -> None:
    """ConfigError unless ``device`` is a CUDA device (CUDA graphs need one)."""
    if device.type != "cuda":
        raise ConfigError(f"train.cuda_graph=true: CUDA graphs need a CUDA GPU, but the run's device is "
                          f"{device}; set train.cuda_graph=false (or device=cuda on a GPU machine)")


class MicroBatchGraphs:
    """Warm up, capture and replay a micro-batch function per kind (see the module docstring).

    Args:
        fn: ``fn(window) -> tuple of tensors``: runs one micro-batch on a device ``window``
            (``[B, S + 1]`` int64 token ids) and returns device tensors (e.g. 0-dim losses) that the
            caller reads (enqueues its reads of) before the next call. Must launch the same work
            every call (no host sync, no shape or host-state dependence).
        device: the CUDA device.
        warmup: eager calls per kind before its capture (>= 1; the trainer's ``GRAPH_WARMUP``).

    Attributes:
        replays: graph replays so far (the capturing calls included), per kind.
    Raises:
        ConfigError (a ValueError): ``device`` is not CUDA (:func:`check_graph_device`).
        ValueError: ``warmup`` < 1.
    """

    def __init__(self, fn: Callable[[torch.Tensor], tuple[torch.Tensor, ...]], device: torch.device,
                 warmup: int = 3):
        check_graph_device(device)
        if warmup < 1:
            raise ValueError(f"MicroBatchGraphs: warmup must be >= 1 eager call per kind, got {warmup}")
        self.fn, self.device, self.warmup = fn, device, int(warmup)
        self.stream = torch.cuda.Stream(device)
        self.pool = None
        self.graphs: dict[str, torch.cuda.CUDAGraph] = {}
        self.inputs: dict[str, torch.Tensor] = {}
        self.outputs: dict[str, tuple[torch.Tensor, ...]] = {}
        self.eager_calls: dict[str, int] = {}
        self.replays: dict[str, int] = {}

    def __call__(self, kind: str, window: torch.Tensor) -> tuple[tuple[torch.Tensor, ...], bool]:
        """Run one micro-batch of ``kind`` on ``window`` (host, pinned, or device; int64 ``[B, S + 1]``).

        Returns ``(outputs, replayed)``: the function's outputs (the graph's static tensors once
        captured, valid until the next call of any kind) and whether a graph ran (then nothing of
        ``fn``'s host-side code ran, except at the capturing call).

        Raises:
            ValueError: ``window`` differs in shape or dtype from the captured one.
        """
        g = self.graphs.get(kind)
        if g is not None:
            static = self.inputs[kind]
            if window.shape != static.shape or window.dtype != static.dtype:
                raise ValueError(f"MicroBatchGraphs: the {kind!r} graph was captured for a {tuple(static.shape)} "
                                 f"{static.dtype} window, got {tuple(window.shape)} {window.dtype} (a graph "
                                 "replays fixed shapes; keep train.micro_batch_size and train.seq_len)")
            static.copy_(window, non_blocking=True)
            g.replay()
            self.replays[kind] += 1
            return self.outputs[kind], True
        n = self.eager_calls.get(kind, 0)
        if n < self.warmup:
            self.eager_calls[kind] = n + 1
            cur = torch.cuda.current_stream(self.device)
            self.stream.wait_stream(cur)
            with torch.cuda.stream(self.stream):
                out = self.fn(window.to(self.device, non_blocking=True))
            cur.wait_stream(self.stream)
            return out, False
        static = torch.empty(window.shape, dtype=window.dtype, device=self.device)
        static.copy_(window, non_blocking=True)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=self.pool, stream=self.stream):
            out = self.fn(static)
        self.pool = g.pool()
        self.graphs[kind], self.inputs[kind], self.outputs[kind] = g, static, tuple(out)
        self.replays[kind] = 1
        g.replay()
        return self.outputs[kind], True

    def reset(self) -> None:
        """Drop every graph (its pool is freed once nothing refers to its outputs); the next calls
        warm up and capture again."""
        self.graphs.clear()
        self.inputs.clear()
        self.outputs.clear()
        self.eager_calls.clear()
        self.pool = None
