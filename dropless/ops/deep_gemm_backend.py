"""The ``deep_gemm`` grouped GEMM backend: DeepSeek's DeepGEMM FP8 kernel over the live-row layout.

DeepGEMM's M-grouped contiguous GEMM (``m_grouped_fp8_gemm_nt_contiguous`` with
``use_psum_layout=True``) takes the layout the dispatcher writes as it is: group ``i``'s rows
are ``[align(end[i-1], A), end[i])`` with ``A`` DeepGEMM's M alignment
(``get_mk_alignment_for_contiguous_layout()``, 128), and its ``grouped_layout`` argument is
the int32 ``end[]`` on the device. So ``model.expert_alignment`` must equal that alignment
(:meth:`DeepGemmBackend.check_alignment`, a configuration error otherwise); rows in the gaps
and the tail are neither read as live rows nor promised in the output (docs/design.md#the-live-row-contract, rule 2-3).

Operands (sm90 "1D2D" recipe): the left operand e4m3 with one fp32 scale per row per 128
columns (:func:`~dropless.ops.fp8_quant.quant_rows` ``group=128``, live rows only; the FC2
input fused with SwiGLU, :func:`~dropless.ops.fp8_quant.swiglu_quant_rows`), the weight
e4m3 in 128×128 blocks, K-major ``[e, N, K]`` (:func:`~dropless.ops.fp8_quant.quant_weight_blocks`),
made once per optimizer step and cached as in :class:`~dropless.ops.fp8_backend.Fp8Backend`
(two copies per weight: forward and data gradient). Output bf16. The weight gradient runs in
bf16 through the ``torch`` backend (DeepGEMM's K-grouped FP8 weight-gradient GEMM is sm100-only).

Needs the ``deep_gemm`` package (github.com/deepseek-ai/DeepGEMM, built for this CUDA and
torch; it compiles its kernels at run time with NVCC) and a GPU with FP8 tensor cores of
compute capability 9.0 or newer; without the package, :func:`dropless.ops.get_backend`
raises a configuration error naming it. ``H`` and ``I`` must be multiples of 128.

Tested on CPU against a stand-in module with DeepGEMM's calling convention
(``tests/fake_deep_gemm.py``) and, where the package imports, on the GPU against the stand-in
(``tests/test_fp8_gpu.py::test_deep_gemm_backend_vs_its_cpu_stand_in``); docs/performance.md (FP8 experts)
names the DeepGEMM version this ran with.
"""

from __future__ import annotations

from types import ModuleType

import torch

from dropless.config import ConfigError
from dropless.layout import ExpertLayout
from dropless.ops.fp8_backend import Fp8Backend
from dropless.ops.fp8_quant import BLOCK, quant_weight_blocks

GEMM_FN = "m_grouped_fp8_gemm_nt_contiguous"
ALIGN_FN = "get_mk_alignment_for_contiguous_layout"


def import_deep_gemm() -> ModuleType:
    """The ``deep_gemm`` module, checked for the functions this backend calls.

    Raises:
        ConfigError: the package does not import, or is too old (no psum-layout grouped GEMM).
    """
    try:
        import deep_gemm
    except ImportError as e:
        raise ConfigError(
            "gemm=deep_gemm needs the deep_gemm package (DeepSeek's DeepGEMM, github.com/deepseek-ai/DeepGEMM, "
            f"built from source for this CUDA and torch: docs/performance.md, FP8 experts) and a CUDA GPU of compute "
            f"capability >= 9.0; the package does not import here ({e}); install it, or use gemm=fp8 (torch's "
            "FP8 grouped GEMM, on a GPU of compute capability >= 8.9) or gemm=torch (any device)") from e
    missing = [f for f in (GEMM_FN, ALIGN_FN) if not hasattr(deep_gemm, f)]
    if missing:
        raise ConfigError(f"gemm=deep_gemm: the installed deep_gemm has no {', '.join(missing)} (dropless calls "
                          "the M-grouped contiguous FP8 GEMM with use_psum_layout, DeepGEMM 2026 and later); "
                          "upgrade deep_gemm, or use gemm=fp8")
    return deep_gemm


class DeepGemmBackend(Fp8Backend):
    """FP8 forward / data-gradient GEMMs through DeepGEMM, bf16 weight gradient (see the module docstring).

    Args:
        module: the ``deep_gemm`` module (default: imported, :func:`import_deep_gemm`); tests
            pass a CPU stand-in with the same functions.
        emulate: with a stand-in module: no CUDA device check, fp32 operands accepted.
        ue8m0: power-of-two scales (DeepGEMM then skips its own UE8M0 cast).
        fused_quant: as :class:`~dropless.ops.fp8_backend.Fp8Backend`'s, but off by default: the 1x128
            kernels are measured for this backend only one by one (docs/performance.md#fp8-experts).
        plan_gemms: as :class:`~dropless.ops.fp8_backend.Fp8Backend`'s, but off by default: the crossover
            table (:mod:`dropless.ops.fp8_policy`) is measured for ``gemm=fp8``'s GEMM, not DeepGEMM's.
        wgrad: the weight gradient, as :class:`~dropless.ops.fp8_backend.Fp8Backend`'s.
    Raises:
        ConfigError: the package is missing or too old.
    """

    name = "deep_gemm"
    act_group = BLOCK  # live rows in e4m3, scale [M, K/128] (quant_act, swiglu_quant_act)

    def __init__(self, module: ModuleType | None = None, emulate: bool = False, ue8m0: bool = False,
                 wgrad: str = "bf16", fused_quant: bool = False, plan_gemms: bool = False):
        super().__init__(emulate=emulate, ue8m0=ue8m0, wgrad=wgrad, fused_quant=fused_quant, plan_gemms=plan_gemms)
        self.dg = module if module is not None else import_deep_gemm()
        self.alignment = int(getattr(self.dg, ALIGN_FN)())

    # ------------------------------------------------------------------ checks
    def check_device(self, device: torch.device | str | None) -> None:
        if self.emulate:
            return
        device = torch.device(device) if device is not None else None
        if device is None or device.type != "cuda" or not torch.cuda.is_available():
            raise ConfigError(f"gemm=deep_gemm needs a CUDA GPU with FP8 tensor cores (compute capability >= 9.0: "
                              f"Hopper or newer); this run is on {device.type if device is not None else 'no device'}. "
                              "Use gemm=torch")
        cap = torch.cuda.get_device_capability(device)
        if cap < (9, 0):
            raise ConfigError(f"gemm=deep_gemm needs compute capability >= 9.0 (Hopper or newer); "
                              f"{torch.cuda.get_device_name(device)} has {cap[0]}.{cap[1]}. Use gemm=fp8 or gemm=torch")

    def check(self, x_MK: torch.Tensor, w_eKN: torch.Tensor) -> None:
        super().check(x_MK, w_eKN)
        for name, n in (("K (input width)", x_MK.shape[1]), ("N (output width)", w_eKN.shape[2])):
            if n % BLOCK:
                raise ValueError(f"gemm=deep_gemm: {name}={n}: DeepGEMM's 1x128 / 128x128 FP8 scales need a multiple "
                                 f"of {BLOCK}; hidden_size and moe_intermediate_size must be multiples of {BLOCK}, "
                                 "or use gemm=fp8")

    def check_alignment(self, expert_alignment: int) -> None:
        """Raise ConfigError unless the layout's segment starts are DeepGEMM's M alignment."""
        super().check_alignment(expert_alignment)
        if int(expert_alignment) != self.alignment:
            raise ConfigError(f"gemm=deep_gemm needs model.expert_alignment={self.alignment} (DeepGEMM's M alignment "
                              f"of the contiguous layout: each expert's rows start on a multiple of it), got "
                              f"{expert_alignment}; set model.expert_alignment={self.alignment}")

    def check_layout(self, layout: ExpertLayout) -> None:
        """Raise ValueError unless the layout's segments start on DeepGEMM's M alignment (before any work)."""
        if layout.alignment != self.alignment:
            raise ValueError(f"gemm=deep_gemm: the layout's alignment is {layout.alignment}, DeepGEMM's "
                             f"{self.alignment}; set model.expert_alignment={self.alignment}")

    # ------------------------------------------------------------------ operands
    def quant_weight(self, w_eKN: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``[e, N, K]`` e4m3 in 128×128 blocks, ``scale [e, N/128, K/128]``."""
        return quant_weight_blocks(w_eKN, contract_dim=1, ue8m0=self.ue8m0)

    # ------------------------------------------------------------------ GEMM
    def scaled_gmm(self, xq_MK: torch.Tensor, xs_MG: torch.Tensor, b_eNK: torch.Tensor, bs: torch.Tensor,
                   layout: ExpertLayout, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """``out[live_i] = (xq · xs)[live_i] @ (b · bs)[i]ᵀ``: ``[M, N]`` bf16 (DeepGEMM writes bf16 only)."""
        self.check_layout(layout)
        out = torch.empty(xq_MK.shape[0], b_eNK.shape[1], dtype=torch.bfloat16, device=xq_MK.device)
        getattr(self.dg, GEMM_FN)((xq_MK, xs_MG), (b_eNK, bs), out, layout.end.contiguous(),
                                  disable_ue8m0_cast=not self.ue8m0, use_psum_layout=True)
        return out if out_dtype == torch.bfloat16 else out.to(out_dtype)
