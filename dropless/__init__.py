"""dropless: dropless Mixture-of-Experts training for PyTorch.

The pipeline (DESIGN.md): router -> dispatcher -> grouped-GEMM experts -> combine,
with a live-row :class:`~dropless.layout.ExpertLayout` carried from dispatch to combine.
"""

from dropless.config import ConfigError, ModelArgs

__all__ = ["ConfigError", "ModelArgs"]
__version__ = "0.1.0"
