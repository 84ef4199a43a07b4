"""The router's group-limited top-k (:mod:`dropless.ops.route_topk`): the Triton kernel against its torch reference.

The kernel runs on CUDA, or on the CPU under Triton's interpreter (``TRITON_INTERPRET=1`` before triton is
imported). In a plain CPU run, :func:`test_kernel_cases_under_the_interpreter` runs this file again in a
subprocess with the interpreter on, so the kernel is always checked where triton is installed.

The oracle of the tie rule is :func:`lowest_id_topk`: the same selection with ``torch.sort(stable=True)``
at every stage, so equal values go to the lowest index (expert and group), as the kernel's docstring says.
"""

from __future__ import annotations

import pytest
import torch

from dropless.ops import route_topk as rt
from dropless.ops import select
from tests.conftest import rerun_under_interpreter

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
KERNEL_HERE = select.HAS_TRITON and (CUDA or select.interpreting())  # the kernel can run in this process
needs_kernel = pytest.mark.skipif(not KERNEL_HERE, reason="no CUDA and Triton's interpreter is off "
                                  "(test_kernel_cases_under_the_interpreter runs these in a subprocess)")
NEG_INF = float("-inf")


@pytest.fixture
def kernel_path(monkeypatch):
    """Under the interpreter: take the Triton path with CPU tensors."""
    if DEV == "cpu":
        monkeypatch.setattr(select, "FORCE_TRITON", True)


def _stable_desc(v: torch.Tensor) -> torch.Tensor:
    return v.sort(dim=-1, descending=True, stable=True).indices


def lowest_id_topk(scores_TE, k, n_group, topk_group, method, bias_E=None):
    """The selection with every tie broken for the lowest index. Returns ``(idx_Tk, masked_TE, group_TG)``:
    the ids, the biased scores with the dropped groups at -inf, and the group scores (None without groups)."""
    b = scores_TE if bias_E is None else scores_TE + bias_E
    T, E = b.shape
    group_TG = None
    if n_group > 1 and method != "greedy":
        bg = b.view(T, n_group, E // n_group)
        top = bg.gather(-1, _stable_desc(bg))
        group_TG = top[..., 0] + top[..., 1] if method == "noaux_tc" else top[..., 0]
        keep_TG = torch.zeros(T, n_group, dtype=torch.bool, device=b.device)
        keep_TG.scatter_(1, _stable_desc(group_TG)[:, :topk_group], True)
        b = bg.masked_fill(~keep_TG.unsqueeze(-1), NEG_INF).view(T, E)
    return _stable_desc(b)[:, :k], b, group_TG


def no_group_tie(group_TG, topk_group, T, device):
    """bool [T]: the kept groups are the only valid choice (no tie across the topk_group boundary)."""
    if group_TG is None or topk_group == group_TG.shape[1]:
        return torch.ones(T, dtype=torch.bool, device=device)
    s = group_TG.sort(dim=-1, descending=True).values
    return s[:, topk_group - 1] > s[:, topk_group]


# (T, E, k, n_group, topk_group, method)
CASES = [
    (37, 64, 6, 8, 4, "noaux_tc"),               # h200_single's router, two programs
    (5, 256, 8, 8, 4, "noaux_tc"),               # DeepSeek-V3's
    (19, 48, 4, 6, 3, "noaux_tc"),               # E and n_group not powers of two (groups of 8, 6 groups)
    (11, 60, 5, 5, 2, "noaux_tc"),               # groups of 12: both extents padded
    (23, 64, 6, 1, 1, "noaux_tc"),               # no groups
    (23, 40, 7, 1, 1, "noaux_tc"),               # no groups, E not a power of two
    (29, 64, 6, 8, 3, "group_limited_greedy"),   # DeepSeek-V2's group score
    (13, 64, 6, 8, 4, "greedy"),                 # groups ignored
    (7, 16, 16, 4, 4, "noaux_tc"),               # k = every expert
    (9, 8, 1, 8, 4, "group_limited_greedy"),     # groups of one expert, k = 1
    (0, 64, 6, 8, 4, "noaux_tc"),                # no tokens
]


def _random(T, E, seed, device=DEV):
    g = torch.Generator().manual_seed(seed)
    scores = torch.randn(T, E, generator=g).sigmoid()
    bias = torch.randn(E, generator=g) * 0.05
    return scores.to(device), bias.to(device)


@needs_kernel
@pytest.mark.parametrize("T,E,k,G,kg,method", CASES)
def test_kernel_equals_reference(kernel_path, T, E, k, G, kg, method):
    """Random fp32 scores (no ties): the kernel's ids equal the reference's as sets and in order."""
    scores, bias = _random(T, E, seed=T * 1000 + E)
    got = rt.group_limited_topk(scores, k, G, kg, method, bias_E=bias)
    ref = rt.group_limited_topk_torch(scores, k, G, kg, method, bias_E=bias)
    assert got.dtype == torch.int64 and got.shape == (T, k)
    assert torch.equal(got.sort(dim=1).values, ref.sort(dim=1).values)  # the same set
    assert torch.equal(got, ref)  # in the same (descending) order
    assert torch.equal(got, lowest_id_topk(scores, k, G, kg, method, bias)[0])
    no_bias = rt.group_limited_topk(scores, k, G, kg, method)
    assert torch.equal(no_bias, rt.group_limited_topk_torch(scores, k, G, kg, method))


@needs_kernel
@pytest.mark.parametrize("T,E,k,G,kg,method", [c for c in CASES if c[0]])
@pytest.mark.parametrize("group_offsets", [False, True])
def test_kernel_takes_the_lowest_id_on_ties_and_inf(kernel_path, T, E, k, G, kg, method, group_offsets):
    """Scores with many equal values (four levels) and -inf biases: the kernel is the lowest-id selection
    exactly; the reference's choice is a valid top-k (its chosen values equal the oracle's) wherever no tie
    decides which groups are kept. ``group_offsets`` adds ``g · 2^-10`` to group ``g``'s scores: experts still
    tie inside a group, groups (almost) never do."""
    g = torch.Generator().manual_seed(7 + E)
    scores = torch.randint(0, 4, (T, E), generator=g).float() / 4
    if group_offsets:
        scores += (torch.arange(E) // (E // G)).float() * 2.0 ** -10
    bias = torch.zeros(E)
    bias[torch.randperm(E, generator=g)[: E // 4]] = NEG_INF  # a quarter of the experts barred
    scores, bias = scores.to(DEV), bias.to(DEV)
    got = rt.group_limited_topk(scores, k, G, kg, method, bias_E=bias)
    want, masked_TE, group_TG = lowest_id_topk(scores, k, G, kg, method, bias)
    assert torch.equal(got, want)
    assert all(len(set(r)) == k for r in got.tolist())  # distinct ids
    ref = rt.group_limited_topk_torch(scores, k, G, kg, method, bias_E=bias)
    rows = no_group_tie(group_TG, kg, T, DEV)
    assert torch.equal(masked_TE.gather(1, ref)[rows], masked_TE.gather(1, got)[rows])
    if group_offsets:
        assert rows.float().mean() > 0.5  # the comparison with the reference is not vacuous


@needs_kernel
def test_kernel_tie_rule_by_hand(kernel_path):
    """Rows whose answer is known: all scores equal; a row barred everywhere but two experts; -0.0 and 0.0;
    NaN (ranked above +inf, as torch.topk does)."""
    E, k, G, kg = 16, 4, 4, 2
    s = torch.full((4, E), 0.5)
    s[2] = 0.0
    s[2, [1, 6]] = -0.0
    s[3, 9] = float("nan")
    bias = torch.zeros(E)
    res = [rt.group_limited_topk(s.to(DEV), k, G, kg, "noaux_tc", bias_E=bias.to(DEV)).tolist()]
    bias[:] = NEG_INF
    bias[[6, 13]] = 0.0  # all group scores are -inf (top-2 sums): groups 0 and 1 kept, so 13 is not reachable
    res.append(rt.group_limited_topk(s.to(DEV), k, G, kg, "noaux_tc", bias_E=bias.to(DEV)).tolist())
    assert res[0][0] == [0, 1, 2, 3]           # equal scores: groups 0, 1, then the lowest ids
    assert res[0][1] == [0, 1, 2, 3]
    assert res[0][2] == [0, 1, 2, 3]           # -0.0 == 0.0
    assert res[0][3] == [9, 0, 1, 2]           # NaN first; its group (2) and then group 0 kept, 0.5s by id
    assert res[1][0] == [6, 0, 1, 2]           # the one finite expert of the kept groups, then -inf by id
    assert res[1][3] == [9, 0, 1, 2]           # NaN + -inf is NaN: group 2 kept first


@needs_kernel
def test_kernel_strided_scores_and_the_wide_fallback(kernel_path, monkeypatch):
    """Scores with strided columns are made contiguous for the kernel; an E whose padded extent passes
    MAX_KERNEL_EXPERTS takes the reference without launching."""
    scores, bias = _random(33, 64, seed=3)
    strided = scores.t().contiguous().t()
    ref = rt.group_limited_topk_torch(scores, 6, 8, 4, "noaux_tc", bias)
    assert torch.equal(rt.group_limited_topk(strided, 6, 8, 4, "noaux_tc", bias_E=bias), ref)

    def no_launch(*args):
        raise AssertionError("launched")

    monkeypatch.setattr(rt, "_route_topk_launch", no_launch)
    monkeypatch.setattr(rt, "MAX_KERNEL_EXPERTS", 32)
    assert torch.equal(rt.group_limited_topk(scores, 6, 8, 4, "noaux_tc", bias_E=bias), ref)


@needs_kernel
def test_router_on_the_kernel_path_equals_the_torch_path(monkeypatch):
    """Router.forward with the kernel (CUDA, or forced under the interpreter) and with the reference."""
    from dropless import ModelArgs
    from dropless.routing import Router

    args = ModelArgs(hidden_size=32, n_routed_experts=64, num_experts_per_tok=6, n_group=8, topk_group=4)
    torch.manual_seed(0)
    r = Router(args, 0).to(DEV)
    r.e_score_correction_bias.normal_(0, 0.05)
    x = torch.randn(50, 32, device=DEV)
    monkeypatch.setattr(select, "FORCE_TRITON", True)
    monkeypatch.setattr(select, "HAS_TRITON", True)
    on = r(x)
    monkeypatch.setattr(select, "HAS_TRITON", False)
    off = r(x)
    assert torch.equal(on.topk_idx_Tk, off.topk_idx_Tk) and torch.equal(on.topk_weight_Tk, off.topk_weight_Tk)


def test_lowest_id_oracle_equals_reference_without_ties():
    """The tests' oracle is the reference wherever no tie decides (random fp32 scores, every case)."""
    for T, E, k, G, kg, method in CASES:
        scores, bias = _random(T, E, seed=T * 1000 + E, device="cpu")
        assert torch.equal(lowest_id_topk(scores, k, G, kg, method, bias)[0],
                           rt.group_limited_topk_torch(scores, k, G, kg, method, bias))


def test_bad_input_raises_before_any_launch(monkeypatch):
    monkeypatch.setattr(select, "FORCE_TRITON", True)  # the checks run first, on either path
    s = torch.rand(4, 64)
    bad = [
        (dict(scores_TE=s.double()), "fp32 \\[T, E\\]"),
        (dict(scores_TE=s.half()), "fp32 \\[T, E\\]"),
        (dict(scores_TE=s.view(4, 8, 8)), "fp32 \\[T, E\\]"),
        (dict(bias_E=torch.zeros(63)), "bias must be fp32 \\[E=64\\]"),
        (dict(bias_E=torch.zeros(64, dtype=torch.float64)), "bias must be fp32"),
        (dict(method="top2"), "method='top2' must be one of"),
        (dict(n_group=6), "n_group=6 must be >= 1 and divide E=64"),
        (dict(n_group=0), "n_group=0"),
        (dict(topk_group=9), "topk_group=9 must be in \\[1, n_group=8\\]"),
        (dict(topk_group=0), "topk_group=0"),
        (dict(k=33), "k=33 must be in \\[1, 32\\]"),      # 4 kept groups of 8
        (dict(k=0), "k=0"),
        (dict(n_group=64, topk_group=8, k=2), "top-2"),   # noaux_tc with groups of one expert
        (dict(n_group=1, k=65), "k=65 must be in \\[1, 64\\]"),
        (dict(method="greedy", k=65), "k=65 must be in \\[1, 64\\]"),
    ]
    for kw, msg in bad:
        a = dict(scores_TE=s, k=6, n_group=8, topk_group=4, method="noaux_tc", bias_E=None) | kw
        with pytest.raises(ValueError, match=msg):
            rt.group_limited_topk(**a)
    # valid: group_limited_greedy with groups of one expert, greedy with a k larger than the kept groups hold
    monkeypatch.setattr(select, "FORCE_TRITON", False)
    assert rt.group_limited_topk(s, 4, 64, 8, "group_limited_greedy").shape == (4, 4)
    assert rt.group_limited_topk(s, 40, 8, 4, "greedy").shape == (4, 40)


@pytest.mark.skipif(not select.HAS_TRITON or KERNEL_HERE, reason="triton missing, or the kernel runs here")
def test_kernel_cases_under_the_interpreter():
    """This file again with ``TRITON_INTERPRET=1``: the kernel cases above run on the CPU."""
    rerun_under_interpreter(__file__)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA or not select.HAS_TRITON, reason="needs CUDA and triton")
@pytest.mark.parametrize("T,E,k,G,kg", [(32768, 64, 6, 8, 4), (4096, 256, 8, 8, 4)])
def test_kernel_matches_reference_on_cuda(T, E, k, G, kg):
    """recipe=h200_single's router and DeepSeek-V3's: the kernel is the lowest-id selection exactly, and
    equals torch.topk's (CUDA) choice on all but the rare rows where a tie between fp32 values decides."""
    scores, bias = _random(T, E, seed=E, device="cuda")
    bias[3] = NEG_INF
    got = rt.group_limited_topk(scores, k, G, kg, "noaux_tc", bias_E=bias)
    want, masked_TE, group_TG = lowest_id_topk(scores, k, G, kg, "noaux_tc", bias)
    assert torch.equal(got, want)
    ref = rt.group_limited_topk_torch(scores, k, G, kg, "noaux_tc", bias_E=bias)
    differ = (got != ref).any(dim=1)
    assert differ.float().mean().item() < 1e-3
    rows = no_group_tie(group_TG, kg, T, "cuda")
    assert torch.equal(masked_TE.gather(1, ref)[rows], masked_TE.gather(1, got)[rows])
