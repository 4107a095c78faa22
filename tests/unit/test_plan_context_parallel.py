"""`megarl plan` with context parallelism (parallelism.context_parallel_size): per-rank tokens with the 2*CP row
padding, the K/V transients of context-parallel attention, the distributed optimizer over DP x CP and the layout
search's CP, each against a hand calculation written here (not calls into the term's own code)."""
import collections
import functools
import json
from pathlib import Path

from megarl.bridge.hf_config import spec_from_dict
from megarl.plan import plan_recipe, plan_steps
from megarl.plan.model import Cluster, read_model_config, uses_te
from megarl.plan.search import trainer_families, with_settings
from megarl.plan.text import render
from megarl.validate import load_config

ROOT = Path(__file__).resolve().parents[2]
GIB = 1024 ** 3
# GSPO on Qwen3-30B-A3B (TP2 EP8, full recompute, fixed micro-batches of 1) made a 32k-token run: 2048 + 32768
LONG = ["rollout.prompt_length=2048", "rollout.response_length=32768", "trainer.nnodes=4"]


def _spec(name: str):
    return spec_from_dict(json.loads((ROOT / "recipes" / "models" / name / "config.json").read_text()))


@functools.lru_cache(maxsize=None)
def _long_steps(cp: int):
    """The plan's steps and text (megarl.plan.plan_recipe's) of the 32k run on 4 x 8 GPUs of 80 GiB at CP `cp`."""
    cfg = load_config(ROOT / "recipes" / "gspo_qwen3_30b_a3b.yaml",
                      LONG + [f"parallelism.context_parallel_size={cp}"])
    st = plan_steps(cfg, Cluster(4, 8, 80, 50), read_model_config(cfg))
    return cfg, st, render(cfg, st)


def test_cp_rank_tokens_pad_each_row_to_2cp_and_split_it_against_hand_calculation():
    from megarl.plan.terms import cp_rank_tokens

    assert cp_rank_tokens(34816, 1, 1) == 34816  # no CP: no padding, no split
    # one 34,816-token row at CP2: padded to a multiple of 4 costs at most 3 tokens, 34,819 over 2 ranks -> 17,410
    assert cp_rank_tokens(34816, 1, 2) == 17410
    # 4 rows of 9,000 at CP4: at most 7 more each, 36,028 over 4 ranks
    assert cp_rank_tokens(4 * 9000, 4, 4) == 9007
    # a 100-token row at CP8: at most 15 more, 115 over 8 ranks is 14.4 -> 15
    assert cp_rank_tokens(100, 1, 8) == 15


def test_cp_attention_transients_against_hand_calculation():
    from megarl.plan.terms import attention_kv_bytes, attention_out_bytes, cp_attention_bytes

    qwen = _spec("qwen3_30b_a3b")  # 32 heads, 4 KV heads of 128
    # this rank's 17,410 tokens at TP2 in bf16: K and V of 2 KV heads, 17,410 x 2 x 2 x 128 x 2 B
    k = 17410 * 2 * 2 * 128 * 2
    o = 17410 * 16 * 128 * 2  # the attention output of 16 heads
    assert (k, o) == (17_827_840, 71_311_360)
    assert attention_kv_bytes(qwen, 17410, 2, 2) == k and attention_out_bytes(qwen, 17410, 2, 2) == o
    # Transformer Engine's ring at CP2: forward keeps both ring steps' K/V and both partial outputs, 2 x (k + o)
    # = 178,278,400; backward two buffers of K/V and dK/dV, 4 k = 71,311,360; an update holds the larger
    assert cp_attention_bytes(k, o, 2, te=True, backward=False) == 178_278_400
    assert cp_attention_bytes(k, o, 2, te=True, backward=True) == 178_278_400
    # without TE: the all-gathered row, 2 k = 35,655,680; its backward also the gradient, 4 k = 71,311,360
    assert cp_attention_bytes(k, o, 2, te=False, backward=False) == 35_655_680
    assert cp_attention_bytes(k, o, 2, te=False, backward=True) == 71_311_360
    # CP8, k = 1,000, o = 100: TE forward 8 x 1,100 = 8,800 over its backward's 4,000; without TE 8,000 / 16,000
    assert cp_attention_bytes(1000, 100, 8, True, True) == 8800
    assert cp_attention_bytes(1000, 100, 8, False, False) == 8000
    assert cp_attention_bytes(1000, 100, 8, False, True) == 16000
    assert cp_attention_bytes(k, o, 1, True, True) == 0 and cp_attention_bytes(k, o, 1, False, True) == 0
    # DeepSeek-V3 (MLA, K and V expanded per head): at TP8 16 heads of K 128 + 64 and V 128, bf16 -> 10,240 B of K/V
    # and 16 x 128 x 2 = 4,096 B of output per token
    dsv3 = _spec("deepseek_v3")
    assert attention_kv_bytes(dsv3, 1, 8, 2) == 10240 and attention_out_bytes(dsv3, 1, 8, 2) == 4096


def test_long_sequence_update_at_cp2_against_hand_calculation():
    _, st, text = _long_steps(2)
    upd = st.peak.lines["update"]
    # 17,410 tokens per rank (one 34,816-token row, see above); h 2048, 48 layers at PP1 (one micro-batch in flight)
    t, h, tp = 17410, 2048, 2
    stored = 48 * t * 2 * h // tp  # full recompute: each layer's input, split over TP by sequence parallelism
    # the layer being recomputed, bytes per token in bf16: 8h/TP + (4q + 4kv)/TP + the routed experts: the allgather
    # dispatcher brings t/TP x expert TP 2 x EP 8 tokens, 1/EP of their top-8 copies (x the imbalance 1.25) stay on
    # the rank, each with its whole hidden vector (2h) and its expert's 6 x 768 / expert TP
    whole = t * (8 * h // tp + (4 * 4096 + 4 * 512) // tp + 8 * 1.25 * (2 * h + 6 * 768 // 2))
    assert whole == t * 81408
    # the logits on the vocabulary padded to a multiple of 128 (151,936 already), 75,968 per TP rank, 22 B each
    logits = t * 151936 // tp * (2 + 4 + 4 + 4 + 4 + 4)
    assert upd["activations (update, with its logits)"] == stored + whole + logits == 32_226_049_280
    assert upd["context-parallel attention K/V (one layer)"] == 178_278_400  # TE's ring (trainer.device cuda)
    # the old-logprob forward's logits: one 17,410-token micro-batch, bf16 logits and the fp32 copy CE exponentiates
    assert st.peak.lines["old/ref log-probs"]["logits (old/ref log-probs, fp32)"] == t * 75968 * (2 + 4)
    assert not st.reasons and "verdict: FITS" in text
    assert "TP2 PP1 CP2 EP8 DP8 (expert DP 2)" in text  # megatron folds CP into expert DP: 32 / (2 x 8)
    assert "34816 tokens, 17410 on each of CP2 ranks" in text


def test_long_sequence_at_cp1_does_not_fit_and_the_plan_says_cp():
    _, st, text = _long_steps(1)
    # the whole 34,816-token row on one rank: its logits alone 34,816 x 75,968 x 22 B = 54.2 GiB
    logits = 34816 * 75968 * 22
    assert round(logits / GIB, 1) == 54.2
    assert "context-parallel attention K/V (one layer)" not in st.peak.lines["update"]
    assert "verdict: DOES NOT FIT" in text and "TP2 PP1 CP1 EP8 DP16" in text
    assert "parallelism.context_parallel_size=2 splits each sequence's activations" in st.reasons[0]


def test_dense_states_over_dp_times_cp_and_token_budgets_per_gpu_against_hand_calculation():
    base = ["trainer.nnodes=4", f"model.config_path={ROOT / 'recipes' / 'models' / 'qwen2_5_32b' / 'config.json'}"]
    reports = {}
    for cp in (1, 2):
        cfg = load_config(ROOT / "recipes" / "dapo_qwen2_5_32b.yaml",
                          base + [f"parallelism.context_parallel_size={cp}"])
        reports[cp] = plan_recipe(cfg, 4, 8, 80)
    # Qwen2.5-32B at TP8 PP2 on 32 GPUs: CP2 leaves DP 32 / (8 x 2 x 2) = 1; the optimizer shards over DP x CP = 2
    assert "TP8 PP2 CP2 EP1 DP1" in reports[2].text and "TP8 PP2 CP1 EP1 DP2" in reports[1].text
    # stage 0: 32 of 64 layers (h 5120, q 40 x 128, kv 8 x 128, FFN 27648) and the 152,064-row embedding, 1/TP each
    h, q, kv, f = 5120, 5120, 1024, 27648
    params = (32 * (h * q + 2 * h * kv + q * h + 3 * h * f) + 152064 * h) / 8
    # its token budget of 22,528 per GPU (one 2,048 + 20,480 row) is CP x 22,528 = 45,056 tokens per micro-batch at
    # CP2 (verl's rule): two rows, each padded by at most 3 to a multiple of 4, 45,062 over 2 ranks = 22,531 per GPU
    assert "actor micro-batch: 45056 tokens, 22531 on each of CP2 ranks" in reports[2].text
    assert "actor micro-batch: 22528 tokens," in reports[1].text
    for cp, report in reports.items():
        # fp32 master copy 4 B and Adam moments 8 B per parameter, over DP x CP = 2 at both CP1 and CP2
        master, moments = report.terms["actor fp32 master copy (distributed)"] * GIB, \
            report.terms["actor Adam moments (distributed)"] * GIB
        assert abs(master - params * 4 / 2) / (params * 4 / 2) < 0.01, (cp, master / GIB)
        assert abs(moments - params * 8 / 2) / (params * 8 / 2) < 0.01, (cp, moments / GIB)


def test_the_planner_reads_which_attention_runs_cp():
    cfg, _, _ = _long_steps(2)  # trainer.device cuda, model.use_transformer_engine auto
    assert uses_te(cfg)
    assert not uses_te(with_settings(cfg, {"model.use_transformer_engine": False}))
    assert not uses_te(with_settings(cfg, {"trainer.device": "cpu"}))
    lora = with_settings(cfg, {"actor.lora.rank": 16})
    assert lora.actor.lora.enabled and not uses_te(lora)  # LoRA's adapters sit on megatron's local layers


def test_search_enumerates_cp_that_divides_the_world():
    cfg = load_config(ROOT / "recipes" / "gspo_qwen3_30b_a3b.yaml")
    labels = [label for label, _ in trainer_families(cfg, _spec("qwen3_30b_a3b"), 8, 16)]
    # 16 ranks: TP2 PP1 takes CP 1, 2, 4, 8 (2 x 8 = 16); TP8 PP2 only CP 1 (8 x 2 x 2 = 32 > 16)
    assert {"TP 2 PP 1 EP 8 ETP 2", "TP 2 PP 1 CP 2 EP 8 ETP 2", "TP 2 PP 1 CP 4 EP 8 ETP 2",
            "TP 2 PP 1 CP 8 EP 8 ETP 2"} <= set(labels)
    assert "TP 8 PP 2 EP 8 ETP 8" in labels and not [x for x in labels if x.startswith("TP 8 PP 2 CP")]


def test_search_plans_the_smallest_cp_that_fits(monkeypatch):
    import megarl.plan.planner
    from megarl.plan.search import search

    planned = collections.defaultdict(set)  # layout without CP -> the CPs the search planned it at
    real = megarl.plan.planner.plan_steps

    def recording(c, *args, **kwargs):
        p = c.parallelism
        planned[(p.tensor_model_parallel_size, p.pipeline_model_parallel_size, p.virtual_pipeline_model_parallel_size,
                 p.expert_model_parallel_size, p.expert_tensor_parallel_size)].add(p.context_parallel_size)
        return real(c, *args, **kwargs)

    monkeypatch.setattr(megarl.plan.planner, "plan_steps", recording)
    cfg = load_config(ROOT / "recipes" / "gspo_qwen3_30b_a3b.yaml", LONG[:2])  # 2 nodes
    res = search(cfg, 2, 8, 80, 50, 2048, top=3)
    # TP4 PP2 EP1 ETP4: a whole 34,816-token row per rank does not fit in any knob setting; CP2 does, so CP4 and
    # CP8 of that layout are never planned
    assert res.rejected["TP 4 PP 2 EP 1 ETP 4"].startswith("no micro-batch, recompute or offload setting fits")
    assert "TP 4 PP 2 CP 2 EP 1 ETP 4" not in res.rejected
    assert planned[(4, 2, None, 1, 4)] == {1, 2}
    # every layout is planned from CP1 up, one CP after the other, and stops at the first that fits
    assert all(sorted(cps) == [1, 2, 4, 8][:len(cps)] for cps in planned.values()), dict(planned)
    assert any(len(cps) == 1 for cps in planned.values())  # CP1 fits some layouts: no CP planned for them


def test_cp_costs_step_time_like_tp():
    from megarl.plan.timing import CP_COST, TP_COST, tp_efficiency

    # TP2 EP8 CP2: one TP doubling, one CP doubling; EP is priced as the allgather dispatcher's traffic instead
    assert tp_efficiency(2, 8, 2) == 1 / (1 + TP_COST + CP_COST)
    assert tp_efficiency(2, 8, 2) < tp_efficiency(2, 8, 1) == 1 / (1 + TP_COST) == tp_efficiency(2, 1, 1)


def test_without_te_each_stored_layer_keeps_the_gathered_kv_against_hand_calculation():
    from types import SimpleNamespace

    from megarl.plan.memory import cp_saved_kv

    qwen = _spec("qwen3_30b_a3b")  # 4 KV heads of 128
    pl = SimpleNamespace(cp=2, te=False, tp=2, pbytes=4)
    # 1,000 tokens on this rank at TP2, float32: its K and V are 1,000 x 2 x 2 heads x 128 x 4 B = 2,048,000; SDPA keeps
    # the whole rows' (CP2: twice that) as its inputs for the backward
    assert cp_saved_kv(qwen, pl, 1000, "none") == 4_096_000
    # recomputed core attention (selective, full) gathers them again in the backward; TE's ring keeps nothing stored
    assert cp_saved_kv(qwen, pl, 1000, "selective") == cp_saved_kv(qwen, pl, 1000, "full") == 0
    assert cp_saved_kv(qwen, SimpleNamespace(cp=2, te=True, tp=2, pbytes=4), 1000, "none") == 0
    assert cp_saved_kv(qwen, SimpleNamespace(cp=1, te=False, tp=2, pbytes=4), 1000, "none") == 0


def test_blockwise_call_scores_against_hand_calculation():
    from megarl.megatron.context_parallel import CALL_SCORES
    from megarl.plan.terms import CP_CALL_SCORES, cp_block_scores_bytes

    assert CP_CALL_SCORES == CALL_SCORES  # the planner's copy of the code's limit
    # a row of 4,016 tokens at CP2: chunks of 1,004, the last sees 3 x 1,004 keys; 14 heads: 14 x 1,004 x 3,012 =
    # 42,332,112 scores, over the limit: the call is cut to 2^24, held 3 times in float32
    assert cp_block_scores_bytes(14, 4016, 1, 2) == 3 * 4 * 2 ** 24
    # 1,008 tokens at CP2, 2 heads: 252 x 756 x 2 = 381,024 scores a row; 4 rows alike 1,524,096; x 12 bytes
    assert cp_block_scores_bytes(2, 1008, 1, 2) == 12 * 381_024
    assert cp_block_scores_bytes(2, 1008, 4, 2) == 12 * 1_524_096
    # CP4, 1,000 tokens: chunks of ceil(1000 / 8) = 125, the last sees 7 x 125; one head: 109,375 scores
    assert cp_block_scores_bytes(1, 1000, 1, 4) == 12 * 109_375
    assert cp_block_scores_bytes(14, 4016, 1, 1) == 0
