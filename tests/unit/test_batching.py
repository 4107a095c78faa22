import pytest
import torch

from megarl.batching import build_train_batch, mini_batch_rows, split_micro
from megarl.types import RolloutBatch


def _rollout():
    # sample 0: prompt [5, 6, 7], response [20, 21] ; sample 1: prompt [8], response [30, 31, 32]
    return RolloutBatch(
        prompt_ids=[[5, 6, 7], [8]], response_ids=torch.tensor([[20, 21, 0], [30, 31, 32]]),
        response_lengths=torch.tensor([2, 3]), rollout_logprobs=torch.tensor([[-1.0, -2.0, 0.0], [-3.0, -4.0, -5.0]]),
        finish_reasons=["stop", "length"], truncated=torch.tensor([False, True]), prompt_index=torch.tensor([0, 1]),
        prompt_truncated=torch.tensor([False, False]))


def test_prompt_and_response_are_concatenated_and_aligned_with_logprob_positions():
    b = build_train_batch(_rollout(), torch.tensor([1.0, 0.5]), pad_token_id=0)
    assert b["input_ids"].tolist() == [[5, 6, 7, 20, 21], [8, 30, 31, 32, 0]]
    # position t scores token t+1: sample 0's response tokens sit at 3, 4 -> logprob positions 2, 3
    assert b["response_mask"].tolist() == [[False, False, True, True], [True, True, True, False]]
    assert b["rollout_log_probs"].tolist() == [[0, 0, -1.0, -2.0], [-3.0, -4.0, -5.0, 0]]
    assert b["token_level_scores"].tolist() == [[0, 0, 0, 1.0], [0, 0, 0.5, 0]]


def test_random_ragged_rollout_with_empty_responses_matches_a_row_by_row_build():
    g = torch.Generator().manual_seed(0)
    n, width = 12, 6
    prompts = [torch.randint(1, 50, (int(k),), generator=g).tolist() for k in torch.randint(1, 9, (n,), generator=g)]
    lengths = torch.randint(0, width + 1, (n,), generator=g)
    lengths[3] = 0  # an empty response: no logprob position, no reward
    rollout = RolloutBatch(
        prompt_ids=prompts, response_ids=torch.randint(1, 50, (n, width), generator=g), response_lengths=lengths,
        rollout_logprobs=-torch.rand(n, width, generator=g), finish_reasons=["stop"] * n,
        truncated=torch.zeros(n, dtype=torch.bool), prompt_index=torch.arange(n) // 3,
        prompt_truncated=torch.zeros(n, dtype=torch.bool))
    scores = torch.rand(n, generator=g)
    b = build_train_batch(rollout, scores, pad_token_id=99)
    s = max(len(p) + int(r) for p, r in zip(prompts, lengths))
    assert b["input_ids"].shape == (n, s)
    for i, (p, r) in enumerate(zip(prompts, lengths.tolist())):
        response = rollout.response_ids[i, :r].tolist()
        assert b["input_ids"][i].tolist() == p + response + [99] * (s - len(p) - r)
        positions = list(range(len(p) - 1, len(p) - 1 + r))  # position t scores token t+1
        assert b["response_mask"][i].nonzero().flatten().tolist() == positions
        assert b["rollout_log_probs"][i, positions].tolist() == rollout.rollout_logprobs[i, :r].tolist()
        assert b["rollout_log_probs"][i].count_nonzero() == r
        expected = torch.zeros(s - 1)
        if r:
            expected[len(p) + r - 2] = scores[i]
        assert b["token_level_scores"][i].tolist() == expected.tolist()


def test_eos_that_ends_a_response_is_learned_even_when_it_is_also_the_pad_token():
    # "#### 21 </s>" (EOS = 2, also the pad id) and a sample cut at the cap without EOS: the EOS logprob position is in
    # the response mask and carries the reward, so the advantage reaches the choice to end (as verl's response_mask)
    eos = 2
    rollout = RolloutBatch(
        prompt_ids=[[5, 6], [5, 6]], response_ids=torch.tensor([[9, 21, eos, eos], [9, 21, 21, 21]]),
        response_lengths=torch.tensor([3, 4]), rollout_logprobs=-torch.ones(2, 4), finish_reasons=["stop", "length"],
        truncated=torch.tensor([False, True]), prompt_index=torch.tensor([0, 0]),
        prompt_truncated=torch.tensor([False, False]))
    b = build_train_batch(rollout, torch.tensor([1.0, 0.0]), pad_token_id=eos)
    assert b["input_ids"].tolist() == [[5, 6, 9, 21, eos, eos], [5, 6, 9, 21, 21, 21]]
    assert b["response_mask"].tolist() == [[False, True, True, True, False], [False, True, True, True, True]]
    assert b["token_level_scores"][0].tolist() == [0, 0, 0, 1.0, 0]  # on the EOS position (it scores token 4)


def test_scores_must_be_one_per_sample():
    with pytest.raises(ValueError, match="one reward per sample"):
        build_train_batch(_rollout(), torch.tensor([1.0]), pad_token_id=0)


def test_mini_batches_split_over_dp_ranks_cover_every_sample_once():
    g = lambda: torch.Generator().manual_seed(3)  # noqa: E731
    shares = [mini_batch_rows(8, 4, 2, r, g()) for r in range(2)]
    assert [len(s) for s in shares] == [2, 2]  # two mini-batches per rank
    for j in range(2):  # mini-batch j is the union of the two ranks' shares
        assert len(set(shares[0][j].tolist()) | set(shares[1][j].tolist())) == 4
    assert sorted(torch.cat([torch.cat(s) for s in shares]).tolist()) == list(range(8))
    with pytest.raises(ValueError, match="ppo_mini_batch_size"):
        mini_batch_rows(8, 3, 1, 0)


def test_split_micro():
    parts = split_micro({"x": torch.arange(6)}, 2)
    assert [p["x"].tolist() for p in parts] == [[0, 1], [2, 3], [4, 5]]


def test_token_budget_micro_batches_pack_whole_rows_and_cut_padding():
    from megarl.batching import sequence_lengths, split_by_token_budget

    # real lengths 5, 3, 2, 4 tokens (response ends at mask positions 3, 1, 0, 2)
    mask = torch.tensor([[0, 0, 1, 1], [0, 1, 0, 0], [1, 0, 0, 0], [0, 1, 1, 0]], dtype=torch.bool)
    batch = {"input_ids": torch.arange(20).view(4, 5), "response_mask": mask, "adv": torch.ones(4, 4),
             "index": torch.arange(4)}
    assert sequence_lengths(batch).tolist() == [5, 3, 2, 4]
    micro = split_by_token_budget(batch, 7)
    # first-fit decreasing: [5] + [2] -> 7; [4] + [3] -> 7
    assert sorted(m["index"].tolist() for m in micro) == [[0, 2], [1, 3]]
    for m in micro:
        s = sequence_lengths(m).max().item()
        assert m["input_ids"].shape[1] == s and m["adv"].shape[1] == s - 1  # no padding columns beyond the longest
    assert sum(len(m["index"]) for m in split_by_token_budget(batch, 1)) == 4  # over-long rows go alone


def test_token_budget_per_gpu_covers_cp_times_the_tokens_of_a_micro_batch_as_verl():
    """verl's megatron actor: `max_token_len = max_token_len * self.config.megatron.context_parallel_size` before it
    packs micro-batches, since each CP rank computes 1 / CP of them; megarl reads *_max_token_len_per_gpu the same."""
    from megarl.config.schema import MegarlConfig
    from megarl.megatron.workers import per_micro_batch

    for cp, want in ((1, 16384), (2, 32768), (4, 65536)):
        cfg = MegarlConfig.model_validate({"model": {"path": "x"}, "parallelism": {"context_parallel_size": cp}})
        assert per_micro_batch(cfg, 16384) == want


def test_balanced_groups_deal_rows_longest_first_to_the_lightest_group_heaviest_first():
    from megarl.batching import balanced_groups

    lengths = [100, 3, 50, 50, 7, 40, 9, 60]
    groups = balanced_groups(lengths, 3)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    loads = [sum(lengths[i] for i in g) for g in groups]
    # longest first onto the lightest (ties: the lower group): 100 | 60 | 50, then 50 -> 50's (100), 40 -> 60's
    # (100), 9 -> the first 100 (109), 7 -> the second (107), 3 -> the third (103)
    assert loads == [109, 107, 103]
    fixed = balanced_groups(lengths, 4, rows_each=2)
    assert all(len(g) == 2 for g in fixed)
    # 100 | 60 | 50 | 50, 40 -> the first 50 (90), 9 -> the other 50 (59), 7 -> 60 (67), 3 -> 100, the last open
    assert [sum(lengths[i] for i in g) for g in fixed] == [103, 90, 67, 59]
    assert balanced_groups([5], 3) == [[0], [], []]  # more groups than rows: empty ones last


def test_agreed_budget_groups_run_as_many_micro_batches_on_every_rank_within_the_budget():
    """Two expert-parallel ranks' lengths: the counts agree on the larger first-fit-decreasing count (agree: the
    max over both, as the group's all-reduce gives it), and no multi-row group exceeds the budget."""
    from megarl.batching import agreed_budget_groups, token_budget_groups

    ranks = [[90, 10, 10, 10, 10, 5], [60, 60, 60, 30, 20, 2]]
    budget = 100
    calls = []
    results = [None, None]

    # both ranks' calls interleaved as the collective does: each agree() returns the max of the ranks' values
    def run(r, agree):
        results[r] = agreed_budget_groups(ranks[r], budget, agree)

    import threading
    barrier = threading.Barrier(2)
    values = [0, 0]

    def agree_for(r):
        def agree(x):
            values[r] = x
            barrier.wait()
            out = max(values)
            calls.append((r, x, out))
            barrier.wait()
            return out
        return agree

    threads = [threading.Thread(target=run, args=(r, agree_for(r))) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    counts = [len(token_budget_groups(x, budget)) for x in ranks]
    assert len(results[0]) == len(results[1]) >= max(counts) == 3
    for lengths, groups in zip(ranks, results):
        assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
        loads = [sum(lengths[i] for i in g) for g in groups]
        assert all(load <= budget for g, load in zip(groups, loads) if len(g) > 1)
        assert loads == sorted(loads, reverse=True)


def test_fewest_groups_hold_a_long_tail_batch_in_fewer_packs_none_larger_than_the_largest():
    """Eight fixed micro-batches of 4 rows, one row 16x the others: every pack agreed to the largest (64 + 3 * 4 = 76
    tokens) is mostly padding (8 * 76 = 608 computed for 188 real); dealt again by tokens, the 32 rows fit 3 packs
    (4: a multiple of 2) of at most 76 tokens, here 64 + 4 = 68 at most: 3 * 76 = 228 or 4 * 68 = 272 computed."""
    from megarl.batching import fewest_groups

    lengths = [64] + [4] * 31
    fixed = [list(range(i, i + 4)) for i in range(0, 32, 4)]
    for multiple, count in ((1, 3), (2, 4)):
        groups = fewest_groups(lengths, fixed, lambda x: x, multiple)
        loads = [sum(lengths[i] for i in g) for g in groups]
        assert len(groups) == count and max(loads) <= 76 and sum(loads) == sum(lengths), (multiple, loads)


def test_mini_batch_rows_dealt_over_ranks_by_tokens_hold_equal_shares():
    from megarl.batching import mini_batch_rows

    lengths = [100, 90, 1, 1, 1, 1, 1, 1]  # contiguous shares: 192 and 4 tokens
    shares = [mini_batch_rows(8, 8, 2, r, lengths=lengths)[0].tolist() for r in range(2)]
    assert sorted(shares[0] + shares[1]) == list(range(8)) and len(shares[0]) == len(shares[1]) == 4
    # 100 | 90, then the 1s onto the lighter share until it holds 4 rows (93), the rest onto the other (103)
    assert sorted(sum(lengths[i] for i in s) for s in shares) == [93, 103]
    contiguous = [mini_batch_rows(8, 8, 2, r)[0].tolist() for r in range(2)]
    assert contiguous == [[0, 1, 2, 3], [4, 5, 6, 7]]
