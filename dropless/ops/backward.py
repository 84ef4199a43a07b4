"""Functions shared by the custom autograd backward passes of the routed-expert path.

* :func:`first_order_only` — the backward passes of the MoE path's custom Functions are not
  differentiable (Triton kernels, inputs rebuilt by recompute, in-place accumulators), so a
  second-order gradient through them (``create_graph=True``) would silently treat them as
  constants. The decorator raises instead.
* :func:`grad_wanted` — which input gradients the running backward pass will use, so that
  ``torch.autograd.grad`` w.r.t. some inputs computes (and accumulates) nothing else.

A rule for the ``forward`` of every custom Function in the package (on the path that
``torch.compile`` traces): return no tensor that an op inside the forward handed back as
the very object it was given: the result of an in-place tensor method (``acc += r``,
``out.mul_(w)``, ``buf.masked_fill_(...)``) or of a no-op conversion (``.to()`` /
``.float()`` to the dtype it has, ``.contiguous()`` of a contiguous tensor). Build the
returned value out of place; an opaque ``torch.library`` op that writes into a buffer, and
a view of a buffer, are fine. torch 2.11's dynamo lists a forward's intermediate tensors
as extra outputs of the traced forward; such an intermediate is the same tensor as the
returned one, autograd hands that tensor's gradient to the extra output, and the
Function's backward gets zeros: every gradient through it is silently 0 under
``torch.compile``. tests/test_compile.py checks the rule in eager on any torch.
"""

from __future__ import annotations

import functools

import torch


def first_order_only(backward):
    """Decorate a custom Function's ``backward``: raise when autograd records its graph.

    Inside backward, grad mode is on exactly when the pass was started with
    ``create_graph=True`` (double backward, gradient penalties).

    Raises:
        RuntimeError: on ``create_graph=True``, naming the node and what to do instead.
    """

    @functools.wraps(backward)
    def wrapper(ctx, *grads):
        if torch.is_grad_enabled():
            raise RuntimeError(
                f"{type(ctx).__name__}: second-order gradients (create_graph=True) through the routed "
                "MoE experts are not supported: their backward passes (Triton kernels, recomputed "
                "inputs, in-place gradient accumulation) are not differentiable, and treating them as "
                "constants would give a wrong result. Take the penalty's gradient without "
                "create_graph, or keep the MoE layers out of the double-backward path.")
        with torch.no_grad():
            return backward(ctx, *grads)

    return wrapper


def grad_wanted(ctx, i: int) -> bool:
    """True when this backward pass uses input ``i``'s gradient of the node ``ctx``.

    ``torch.autograd.grad`` (or ``backward(inputs=...)``) may ask for a subset; a gradient
    nobody takes is not computed (and a weight gradient is not added into a chunk
    accumulator that would then outlive the pass). Where autograd cannot tell (a leaf under
    ``autograd.grad``, or a backward traced by ``torch.compile``), it is computed.
    """
    if not ctx.needs_input_grad[i]:
        return False
    if torch.compiler.is_compiling():  # a traced backward has no engine nodes to ask
        return True
    node = ctx.next_functions[i][0]
    if node is None:
        return False
    try:
        return bool(torch._C._will_engine_execute_node(node))
    except (RuntimeError, AttributeError):
        return True
