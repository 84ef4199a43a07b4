"""The planner's training state per rank (:mod:`dropless.plan.state`) and ``train.shard_experts`` in it.

DeepSeek-V3 (``recipe=deepseek_v3_671b``, bf16 with fp32 masters): 654,114,668,544 routed-expert
parameters (58 MoE layers × 256 experts × 3 · 7168 · 2048), 10.22 B per rank at EP 64; 18 bytes a
replicated parameter, 16 / dp a sharded one.
"""

from __future__ import annotations

import json

import pytest

from dropless import plan as P
from dropless.config import ModelArgs
from dropless.model.params import param_counts
from dropless.plan.state import expert_shard_comm_bytes, expert_shard_transient_bytes, param_state_bytes, rank_state

MiB, GiB = 2**20, 2**30
ROUTED = 58 * 256 * 3 * 7168 * 2048


def test_bytes_per_parameter():
    assert param_state_bytes(10, 2).total == 180              # bf16 + fp32 master + grad + 2 moments
    assert param_state_bytes(10, 4).total == 160              # fp32: the parameter is its own master
    s = param_state_bytes(10, 2, sharded_over=2)
    assert (s.params, s.weights, s.grads, s.optimizer) == (5, 20, 20, 40)
    assert param_state_bytes(10, 2, sharded_over=4).params == 3   # ceil: FSDP2 pads
    with pytest.raises(ValueError, match="compute_bytes"):
        param_state_bytes(10, 3)


def test_expert_state_per_rank_divides_by_dp():
    args = ModelArgs.deepseek_v3_671b()
    pc = param_counts(args)
    assert pc.routed_experts == ROUTED
    for dp in (1, 2, 4):
        st = rank_state(pc.routed_experts, pc.total - pc.routed_experts, 64 * dp, 64, 4, 7168, 2048,
                        shard_experts=True, shard_dense=True)
        assert st.dp_size == dp
        assert st.experts_replicated.total == ROUTED // 64 * 18
        if dp > 1:
            assert st.experts_sharded.total == ROUTED // 64 // dp * 16
            assert st.total.total == st.experts_sharded.total + st.dense_sharded.total
    st = rank_state(ROUTED, 0, 64, 64, 4, 7168, 2048, shard_experts=True)
    assert st.transient == 0 and st.comm.total == 0            # dp 1: nothing to shard over


def test_collective_and_buffer_bytes_per_layer():
    c = expert_shard_comm_bytes(4, 7168, 2048, 2)
    assert c.all_gather_forward == c.all_gather_backward == 168 * MiB
    assert c.reduce_scatter == 336 * MiB
    c4 = expert_shard_comm_bytes(4, 7168, 2048, 4)
    assert c4.all_gather_forward == 252 * MiB                  # 3/4 of 336 MiB
    assert expert_shard_transient_bytes(4, 7168, 2048) == 1680 * MiB


def _state(capsys, argv):
    assert P.main(argv + ["--json"]) == 0
    return json.loads(capsys.readouterr().out)["state"]


def test_recipe_fits_an_h200_at_ep64_with_sharded_experts(capsys):
    st = _state(capsys, ["recipe=deepseek_v3_671b", "--world", "128", "--device-gib", "139"])
    assert st["shard_experts"] and st["shard_dense"] and st["dp_size"] == 2 and st["ep_size"] == 64
    assert st["layout"]["total"] == st["experts"]["sharded"]["total"] + st["dense"]["sharded"]["total"]
    assert st["fits"] and st["layout_with_transient"] < 80 * GiB
    assert st["comm_per_layer"]["reduce_scatter"] == 336 * MiB
    off = _state(capsys, ["recipe=deepseek_v3_671b", "train.shard_experts=false", "--world", "128",
                          "--device-gib", "139"])
    assert not off["fits"] and off["layout"]["total"] > 170 * GiB
    assert off["comm_per_layer"]["all_gather_forward"] == 0
    whole = _state(capsys, ["recipe=deepseek_v3_671b", "--world", "64", "--device-gib", "139"])
    assert whole["dp_size"] == 1 and not whole["fits"]           # 64 GPUs: dp 1, the experts stay whole


def test_no_world_no_state_table_and_a_world_that_does_not_fit_ep(capsys, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert P.main(["recipe=deepseek_v3_671b", "--json"]) == 0
    assert "state" not in json.loads(capsys.readouterr().out)
    with pytest.raises(SystemExit) as err:
        P.main(["recipe=deepseek_v3_671b", "--world", "96"])
    assert err.value.code == 2
    assert "--world" in capsys.readouterr().err


def test_text_shows_both_layouts(capsys):
    assert P.main(["recipe=deepseek_v3_671b", "--world", "128", "--device-gib", "139"]) == 0
    text = capsys.readouterr().out
    assert "routed experts, sharded over dp 2 (train.shard_experts) <- this layout" in text
    assert "routed experts, replicated over dp 2" in text and "fits in 139.000 GiB" in text
