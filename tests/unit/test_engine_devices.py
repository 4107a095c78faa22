"""Which node and GPUs each engine replica computes on (megarl.layout.engine_devices), on simulated 8-GPU nodes: no
CUDA needed. Expected devices are written out by hand from the rule: trainer rank k of a node computes on the node's
k-th GPU; a colocated replica takes its ranks' GPUs; a separate one the GPUs the node's ranks leave; Ray picks its
own. Also the engine child's environment, `megarl validate`'s refusals (an engine replica must fit in one node) and
its listing, `megarl plan --search`'s engine candidates, and CUDA IPC handles opened on the engine's own device
numbering."""
import io
import pickle
from pathlib import Path

import pytest
import torch

from megarl.distributed import node_gpus
from megarl.layout import DeviceShortage, EngineDevices, engine_devices
from megarl.rollout.checks import ONE_NODE_RULE
from megarl.rollout.hosting.process import _DIST_VARS, _environment, child_environment, engine_gpus
from megarl.rollout.hosting.ray import ray_placement
from megarl.validate import load_config

NODE = [str(i) for i in range(8)]  # one 8-GPU node, CUDA_VISIBLE_DEVICES unset


def _colocated(tp, replicas, ranks_per_node=8, visible=None):
    return [(d.node, d.devices) for d in engine_devices(ranks_per_node=ranks_per_node, engine_tp=tp,
                                                         replicas=replicas, placement="colocated",
                                                         visible=NODE if visible is None else visible)]


def test_colocated_tp1_one_gpu_per_replica():
    assert _colocated(1, 8) == [(0, ("0",)), (0, ("1",)), (0, ("2",)), (0, ("3",)), (0, ("4",)), (0, ("5",)),
                                (0, ("6",)), (0, ("7",))]


def test_colocated_tp2_tp4_tp8():
    assert _colocated(2, 4) == [(0, ("0", "1")), (0, ("2", "3")), (0, ("4", "5")), (0, ("6", "7"))]
    assert _colocated(4, 2) == [(0, ("0", "1", "2", "3")), (0, ("4", "5", "6", "7"))]
    assert _colocated(8, 1) == [(0, ("0", "1", "2", "3", "4", "5", "6", "7"))]


def test_colocated_on_two_nodes_each_node_counts_its_gpus_from_its_first():
    # 16 ranks, TP2: replicas 4..7 are on node 1 (ranks 8..15), on its GPUs 0-1, 2-3, 4-5, 6-7
    assert _colocated(2, 8)[4:] == [(1, ("0", "1")), (1, ("2", "3")), (1, ("4", "5")), (1, ("6", "7"))]


def test_colocated_devices_name_the_nodes_visible_gpus():
    # a node whose CUDA_VISIBLE_DEVICES is 4,5,6,7 runs 4 ranks: replica 1 at TP2 is ranks 2,3 -> GPUs 6,7
    assert _colocated(2, 2, ranks_per_node=4, visible=["4", "5", "6", "7"]) == [(0, ("4", "5")), (0, ("6", "7"))]


def test_a_replica_wider_than_a_node_spans_nodes_and_says_so():
    (replica,) = engine_devices(ranks_per_node=8, engine_tp=16, replicas=1, placement="colocated")
    assert replica.parts == ((0, tuple(NODE)), (1, tuple(NODE)))
    assert replica.devices == tuple(NODE)  # what the starting rank's engine process sees: its own node's
    assert replica.describe() == "replica 0: nodes 0-1, GPUs 0-7 of each"


def test_describe_lines():
    assert EngineDevices(1, 2, ((0, ("2", "3")),)).describe() == "replica 1: node 0, GPUs 2,3"
    assert EngineDevices(0, 8, ((3, tuple(NODE)),)).describe() == "replica 0: node 3, GPUs 0-7"
    assert EngineDevices(2, 4).describe() == "replica 2: 4 GPUs of one node, placed by Ray (num_gpus=4)"
    # a CPU engine has no GPUs, and its start line still names the node of the rank that started it
    assert EngineDevices.on_cpu(3, 1).describe() == "replica 3: node 1, no GPU (CPU engine)"
    assert ray_placement(1, "10.0.0.7", "3f2a1b9c" + "0" * 48, [2, 3]) == \
        "replica 1: Ray node 10.0.0.7 (id 3f2a1b9c), GPUs 2,3"
    assert ray_placement(0, "127.0.0.1", "ab" * 28, []) == \
        "replica 0: Ray node 127.0.0.1 (id abababab), no GPU (CPU engine)"


def test_a_cpu_replica_leaves_the_childs_devices_alone():
    """EngineDevices.on_cpu only names the node: the engine child sees what the rank sees (CUDA_VISIBLE_DEVICES is not
    set to an empty list); a GPU replica's child sees its GPUs."""
    assert engine_gpus(EngineDevices.on_cpu(0, 1)) is None and engine_gpus(None) is None
    assert engine_gpus(EngineDevices(1, 2, ((0, ("2", "3")),))) == ("2", "3")


def test_separate_engines_take_the_gpus_the_trainer_ranks_leave():
    # 4 trainer ranks on an 8-GPU node; trainer ranks 0 and 1 start replicas 0 and 1, TP2, on GPUs 4-5 and 6-7
    got = engine_devices(ranks_per_node=4, engine_tp=2, replicas=2, placement="separate", visible=NODE)
    assert [(d.node, d.devices) for d in got] == [(0, ("4", "5")), (0, ("6", "7"))]


def test_separate_engines_beside_a_full_node_are_refused():
    with pytest.raises(DeviceShortage) as caught:
        engine_devices(ranks_per_node=8, engine_tp=1, replicas=1, placement="separate", visible=NODE)
    e = caught.value
    assert (e.key, e.value) == ("rollout.placement", "separate")
    assert "8 trainer ranks" in e.rule and "9 GPUs" in e.rule and "has 8 GPUs" in e.rule
    assert "rollout.mode=ray" in e.fix


def test_ray_hosted_replicas_keep_rays_assignment_of_tp_gpus_each():
    got = engine_devices(ranks_per_node=8, engine_tp=4, replicas=3, placement="ray", visible=NODE)
    assert [(d.replica, d.num_gpus, d.devices, d.node) for d in got] == [(0, 4, None, None), (1, 4, None, None),
                                                                        (2, 4, None, None)]
    got[1].check_assigned([2, 3, 6, 7])  # any four of the node: Ray's choice
    with pytest.raises(ValueError, match=r"Ray gave engine replica 1 1 GPU\(s\) \(\[0\]\); the layout gives it 4"):
        got[1].check_assigned([0])


def test_a_ray_replica_wider_than_a_node_is_refused():
    with pytest.raises(DeviceShortage) as caught:
        engine_devices(ranks_per_node=8, engine_tp=16, replicas=1, placement="ray")
    assert (caught.value.key, caught.value.value) == ("rollout.tensor_model_parallel_size", 16)
    assert caught.value.fix == "use an engine TP of at most 8"


def test_more_trainer_ranks_than_visible_gpus_are_refused():
    with pytest.raises(DeviceShortage) as caught:
        engine_devices(ranks_per_node=8, engine_tp=1, replicas=8, placement="colocated", visible=["0", "1", "2", "3"])
    assert (caught.value.key, caught.value.value) == ("trainer.n_gpus_per_node", 8)


def test_node_gpus_reads_cuda_visible_devices_else_counts():
    assert node_gpus({"CUDA_VISIBLE_DEVICES": "GPU-aa, GPU-bb"}, count=8) == ["GPU-aa", "GPU-bb"]
    assert node_gpus({}, count=3) == ["0", "1", "2"]


# ---- the engine child's environment ----------------------------------------------------------------------------

TRAINER_RANK_ENV = {"RANK": "3", "LOCAL_RANK": "3", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "8", "MASTER_ADDR": "n0",
                    "MASTER_PORT": "29500", "TORCHELASTIC_RUN_ID": "x", "PATH": "/usr/bin", "HF_HOME": "/data/hf"}


def test_the_engine_child_gets_its_replicas_gpus_and_no_torchrun_variables():
    env = child_environment(TRAINER_RANK_ENV, ("2", "3"))
    assert env == {"PATH": "/usr/bin", "HF_HOME": "/data/hf", "CUDA_VISIBLE_DEVICES": "2,3"}


def test_without_devices_the_child_keeps_what_the_rank_sees():
    env = child_environment({**TRAINER_RANK_ENV, "CUDA_VISIBLE_DEVICES": "0,1,2,3"}, None)
    assert env["CUDA_VISIBLE_DEVICES"] == "0,1,2,3" and not set(_DIST_VARS) & set(env)


def test_the_environment_is_the_childs_only_while_it_starts(monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "5")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3,4,5,6,7")
    import os

    with _environment(child_environment(os.environ, ("5",))):
        assert "LOCAL_RANK" not in os.environ and os.environ["CUDA_VISIBLE_DEVICES"] == "5"
    assert os.environ["LOCAL_RANK"] == "5" and os.environ["CUDA_VISIBLE_DEVICES"] == "0,1,2,3,4,5,6,7"


# ---- megarl validate ----------------------------------------------------------------------------------------------

TINY = {"model": {"path": "unused", "create_tiny": {"num_attention_heads": 4, "num_key_value_heads": 2}},
        "rollout": {"n": 2}, "trainer": {"device": "cuda", "n_gpus_per_node": 4}}


def test_validate_refuses_separate_engine_processes_beside_a_full_gpu_node():
    from megarl.config import ConfigError

    with pytest.raises(ConfigError) as caught:
        load_config(data=TINY, overrides=["rollout.placement=separate", "rollout.data_parallel_size=1"])
    [issue] = caught.value.issues
    assert issue.key == "rollout.placement"
    assert issue.value == "separate" and "5 GPUs" in issue.rule and "rollout.mode=ray" in issue.fix


def test_validate_refuses_a_ray_replica_wider_than_a_node():
    from megarl.config import ConfigError

    with pytest.raises(ConfigError) as caught:
        load_config(data=TINY, overrides=["rollout.mode=ray", "rollout.tensor_model_parallel_size=2",
                                          "trainer.n_gpus_per_node=1"])
    [issue] = caught.value.issues
    assert issue.key == "rollout.tensor_model_parallel_size"
    assert issue.value == 2 and issue.rule.startswith(ONE_NODE_RULE) and "placement-group bundle" in issue.rule
    assert issue.fix.startswith("set rollout.tensor_model_parallel_size=1: the largest engine TP")


def _refusal(overrides, model=None):
    from megarl.config import ConfigError

    data = {**TINY, "model": {**TINY["model"], "create_tiny": model or TINY["model"]["create_tiny"]},
            "trainer": {"device": "cuda", "nnodes": 2, "n_gpus_per_node": 8}}
    with pytest.raises(ConfigError) as caught:
        load_config(data=data, overrides=overrides)
    return caught.value


def test_validate_refuses_engine_tp16_over_two_8_gpu_nodes_with_the_largest_tp_that_starts():
    err = _refusal(["rollout.tensor_model_parallel_size=16"],
                   {"num_attention_heads": 16, "num_key_value_heads": 8})
    [issue] = err.issues  # one report: the TP rules the fix satisfies do not repeat the key
    assert (issue.key, issue.value) == ("rollout.tensor_model_parallel_size", 16)
    assert issue.rule == (f"{ONE_NODE_RULE}; engine TP 16 needs 16 GPUs and a node has 8 "
                          "(trainer.n_gpus_per_node)")
    assert issue.fix.startswith("set rollout.tensor_model_parallel_size=8: the largest engine TP within a node's 8 GPUs")
    assert issue.error_id == "config-engine-layout" and "must fit in one node" in str(err)


def test_the_suggested_tp_also_suits_the_heads_and_the_world():
    # 12 heads / 4 KV heads on 8-GPU nodes: 8 and 6 do not split them, 4 does (and divides the 16 ranks); 16 would not
    # suit the heads either, yet the report is still one line
    [issue] = _refusal(["rollout.tensor_model_parallel_size=16"],
                       {"hidden_size": 96, "num_attention_heads": 12, "num_key_value_heads": 4}).issues
    assert issue.fix.startswith("set rollout.tensor_model_parallel_size=4:")
    assert "num_attention_heads = 12 and num_key_value_heads = 4 and divides the world size 16" in issue.fix
    load_config(data={**TINY, "model": {"path": "unused", "create_tiny": {"hidden_size": 96, "num_attention_heads": 12,
                                                                          "num_key_value_heads": 4}},
                      "trainer": {"device": "cuda", "nnodes": 2, "n_gpus_per_node": 8}},
                overrides=["rollout.tensor_model_parallel_size=4"])


def test_an_expert_parallel_engine_is_told_to_move_ep_with_tp():
    [issue] = _refusal(["rollout.tensor_model_parallel_size=16", "rollout.expert_model_parallel_size=16"],
                       {"architecture": "qwen3_moe", "num_attention_heads": 16, "num_key_value_heads": 8,
                        "num_experts": 16, "num_experts_per_tok": 2}).issues
    assert issue.fix.startswith("set rollout.tensor_model_parallel_size=8 and rollout.expert_model_parallel_size=8:")


def test_engine_tp8_on_8_gpu_nodes_starts():
    cfg = load_config(data={**TINY, "model": {"path": "unused", "create_tiny": {"num_attention_heads": 16,
                                                                                "num_key_value_heads": 8}},
                            "trainer": {"device": "cuda", "nnodes": 2, "n_gpus_per_node": 8}},
                      overrides=["rollout.tensor_model_parallel_size=8"])
    assert [d.describe() for d in cfg.engine_devices()] == ["replica 0: node 0, GPUs 0-7", "replica 1: node 1, GPUs 0-7"]


def test_a_cpu_recipe_is_not_held_to_a_gpu_node():
    # engines take cores on CPU: n_gpus_per_node is the ranks of a machine, not a bound on the engine's TP
    cpu = {**TINY, "trainer": {"device": "cpu", "nnodes": 2, "n_gpus_per_node": 1}}
    load_config(data=cpu, overrides=["rollout.tensor_model_parallel_size=2"])


def test_plan_search_proposes_engine_tps_up_to_a_node_only():
    from megarl.bridge.checks import model_spec
    from megarl.plan.search import engine_options, with_settings
    from megarl.rollout.checks import check_engine_layout

    cfg = load_config(Path(__file__).resolve().parents[2] / "recipes" / "grpo_qwen3_235b_a22b.yaml")
    spec, _ = model_spec(cfg)
    options = engine_options(cfg, spec, nodes=12, gpus_per_node=8)
    tps = {settings["rollout.tensor_model_parallel_size"] for _, settings, _ in options}
    assert tps == {1, 2, 4, 8}  # 12 nodes of 8: TP 16 and 32 would span nodes
    for label, settings, _ in options:
        assert not [i for i in check_engine_layout(with_settings(cfg, settings)) if ONE_NODE_RULE in i.rule], label
    assert {s["rollout.tensor_model_parallel_size"] for _, s, _ in engine_options(cfg, spec, 2, 4)} == {1, 2, 4}


def test_validate_lists_each_replicas_node_and_gpus():
    from megarl.config.resolve import derived

    cfg = load_config(data=TINY, overrides=["rollout.tensor_model_parallel_size=2", "trainer.nnodes=2"])
    assert derived(cfg)["engine_devices"] == ["replica 0: node 0, GPUs 0,1", "replica 1: node 0, GPUs 2,3",
                                              "replica 2: node 1, GPUs 0,1", "replica 3: node 1, GPUs 2,3"]
    cpu = load_config(data={**TINY, "trainer": {"device": "cpu", "n_gpus_per_node": 4}},
                      overrides=["rollout.tensor_model_parallel_size=2"])
    assert "engine_devices" not in derived(cpu)  # engines take cores on CPU


# ---- CUDA IPC handles in an engine that numbers its GPUs from 0 --------------------------------------------------

class _SharedCudaTensor:
    """Pickles as torch.multiprocessing pickles a CUDA tensor: rebuild_cuda_tensor with the sender's device index."""

    def __reduce__(self):
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        return rebuild_cuda_tensor, (torch.Tensor, (4,), (1,), 0, torch.UntypedStorage, torch.float32, 5, b"handle",
                                     16, 0, False, b"ref", 0, b"event", True)


def test_a_cuda_handle_opens_on_the_given_device_not_the_senders(monkeypatch):
    import torch.multiprocessing.reductions as reductions

    from megarl.sync.pull import open_shared

    blob = pickle.dumps(_SharedCudaTensor())
    opened = {}

    def rebuild_cuda_tensor(tensor_cls, tensor_size, tensor_stride, tensor_offset, storage_cls, dtype, storage_device,
                            storage_handle, *rest):
        opened.update(device=storage_device, handle=storage_handle)
        return "opened"

    monkeypatch.setattr(reductions, "rebuild_cuda_tensor", rebuild_cuda_tensor)
    assert open_shared(blob, device=0) == "opened"
    assert opened == {"device": 0, "handle": b"handle"}  # the sender's index 5 does not exist in the engine


def test_a_host_tensor_opens_as_it_was_shared():
    from multiprocessing.reduction import ForkingPickler

    from megarl.sync.pull import open_shared

    t = torch.arange(6, dtype=torch.float32)
    assert torch.equal(open_shared(bytes(ForkingPickler.dumps(t))), t)
    assert torch.equal(open_shared(io.BytesIO(pickle.dumps(t)).getvalue()), t)
