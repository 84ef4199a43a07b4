"""DeepSeek-V3 checkpoints in and out: Hugging Face safetensors <-> dropless / DCP.

* :func:`load_hf` — a Hugging Face DeepSeek-V3 directory into a built model (streamed shard
  by shard, FP8 dequantised, each EP rank reading only its experts).
* :func:`export_hf` — weights to a Hugging Face directory (sharded safetensors, index,
  config.json), written to a temporary directory and renamed.
* :func:`args_from_hf_config` / :func:`hf_config_from_args` — config.json <-> ModelArgs.
* :func:`save_model_dcp`, :func:`load_model_dcp`, :class:`DCPSource` — weights-only DCP.
* :func:`init_from` — what ``dropless-train init_from=PATH`` calls.
* CLI: ``dropless-convert hf-to-dcp SRC DST`` / ``dcp-to-hf SRC DST`` (:mod:`dropless.convert.cli`).
"""

from dropless.convert.dcp_io import DCPSource, load_model_dcp, read_model_args, save_model_dcp
from dropless.convert.fp8 import dequantize_fp8_blocks
from dropless.convert.hf_config import HFFormat, args_from_hf_config, hf_config_from_args, read_hf_config
from dropless.convert.hf_export import StateDictSource, export_hf
from dropless.convert.hf_import import ImportReport, load_hf
from dropless.convert.names import HFTensor, hf_tensors
from dropless.convert.start import init_from

__all__ = [
    "DCPSource", "HFFormat", "HFTensor", "ImportReport", "StateDictSource", "args_from_hf_config",
    "dequantize_fp8_blocks", "export_hf", "hf_config_from_args", "hf_tensors", "init_from", "load_hf",
    "load_model_dcp", "read_hf_config", "read_model_args", "save_model_dcp",
]
