"""Worker of tests/test_convert_ep.py, in a module of its own so that the spawned ranks do not
import transformers (the checkpoint is made by the parent)."""

from __future__ import annotations

import datetime
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

from dropless.convert import args_from_hf_config, load_hf, read_hf_config
from dropless.convert.start import init_from
from dropless.dispatch import build_dispatcher
from dropless.dispatch.mesh import build_mesh
from dropless.model import Transformer

WORLD = 2


def worker(rank, port, out_dir, hf_dir, dcp_dir):
    torch.set_num_threads(1)
    out = Path(out_dir) / f"rank{rank}.pt"
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD,
                                timeout=datetime.timedelta(seconds=30))
        mesh = build_mesh(WORLD, WORLD, "cpu")
        args, _ = args_from_hf_config(read_hf_config(hf_dir))
        res = {}
        for src in ("hf", "dcp"):
            model = Transformer(args, dispatcher_factory=lambda layer_id: build_dispatcher("a2a", args, ep_group=mesh))
            model.init_weights(seed=99)
            if src == "hf":
                rep = load_hf(model, hf_dir)
                res["names_read"] = rep.names_read
            else:
                init_from(model, dcp_dir, mesh=mesh)
            res[src] = {k: v.clone() for k, v in model.state_dict().items()}
        res["offsets"] = [m.experts.expert_offset for m in model.moe_layers()]
        torch.save(res, out)
    except BaseException:
        torch.save({"error": traceback.format_exc()}, out)
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
