"""Time per GRPO step: megarl on the tiny recipe against a minimal single-process PyTorch GRPO loop, in one run.

The minimal loop is the floor a hand-written trainer sets on this machine: HF `generate` samples rollout.n responses
per prompt, the recipe's rule reward scores them, GRPO advantages, then ONE forward/backward over all samples with the
same PPO-clip token-mean loss (old logprobs = the detached logprobs of that forward, so no separate pass) and AdamW;
no engine, no weight sync, no distributed anything. Both start from the same SFT warm-started model and draw the same
prompts in the same order with the recipe's batch and lengths (the samples themselves differ: two samplers).

megarl runs as a user runs it (`megarl train` in a child process, its vLLM engine beside it); its time per step is the
wall time between consecutive rows of metrics.jsonl (everything a step costs, logging included), and its phase split
comes from the timing/* metrics. The minimal loop runs before and after megarl (half of its steps each) so that a
change of load on a shared machine affects both sides alike. Also printed: megarl's time from launch to its first
step.

    .venv/bin/python bench/bench_step.py                   # tiny recipe: 150 SFT steps once, then 30 timed steps each
    .venv/bin/python bench/bench_step.py --steps 10 --work-dir /tmp/bench_step   # reuse the SFT model of a previous run
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from statistics import median

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

RECIPE = ROOT / "recipes" / "grpo_tiny_cpu.yaml"
PHASES = ("rollout", "reward", "old_log_prob", "ref", "values", "train", "sync")


def shared_overrides(work: Path) -> list[str]:
    """Where both sides find the same data, initial model and SFT model."""
    return [f"model.path={work / 'init_model'}", f"data.synthetic.output_dir={work / 'data'}",
            f"sft.output_dir={work / 'sft_model'}"]


def megarl_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "megarl.cli", *args]


def child_env() -> dict:
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))


def prepare_sft_model(work: Path) -> None:
    """The recipe's data, random model and SFT warm-start, once (a reused --work-dir keeps them)."""
    if (work / "sft_model" / "config.json").exists():
        return
    print("bench: preparing the data and the SFT model (once per --work-dir) ...", flush=True)
    subprocess.run(megarl_cmd("sft", str(RECIPE), f"trainer.run_dir={work / 'sft_run'}", *shared_overrides(work)),
                   check=True, env=child_env(), stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)


def train_watching_steps(cmd: list[str], metrics_path: Path, log_path: Path, what: str) -> tuple[list, list]:
    """Run `megarl train` (cmd) with its output in log_path; (its metrics rows, the time each row first appeared),
    so the wall time between two rows is one step as a user sees it."""
    seen: list[float] = []
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, env=child_env(), stdout=log, stderr=subprocess.STDOUT)
        while proc.poll() is None:
            if metrics_path.exists():
                rows = metrics_path.read_bytes().count(b"\n")
                seen.extend([time.monotonic()] * (rows - len(seen)))
            time.sleep(0.005)
    if proc.returncode != 0:
        raise RuntimeError(f"megarl train{what} failed (exit {proc.returncode}); see {log_path}")
    return [json.loads(line) for line in metrics_path.read_text().splitlines()], seen


def run_megarl(work: Path, steps: int, warmup: int, overrides: list) -> dict:
    """Launch `megarl train` for warmup + steps RL steps; time each step by when its metrics row appears."""
    warmup = max(warmup, 1)  # a step's wall time is the gap since the previous row
    run_dir = work / f"megarl_run_{int(time.time())}"
    log_path = work / "megarl_train.log"
    cmd = megarl_cmd("train", str(RECIPE), f"trainer.run_dir={run_dir}", *shared_overrides(work),
                     f"trainer.total_steps={warmup + steps}", "trainer.test_freq=0", "trainer.val_before_train=false",
                     "logging.tensorboard=false", *overrides)
    start = time.monotonic()
    rows, seen = train_watching_steps(cmd, run_dir / "metrics.jsonl", log_path, "")
    first_step_after_s = seen[0] - start - rows[0]["timing/step_s"]
    walls = [b - a for a, b in zip(seen[warmup - 1:], seen[warmup:])]
    steps = []
    for wall, row in zip(walls, rows[warmup:]):
        phases = {p: row.get(f"timing/{p}_s", 0.0) for p in PHASES}
        steps.append({"step": wall, **phases, "other": wall - sum(phases.values()),
                      "response_length": row["train/response_length_mean"]})
    return {"steps": steps, "first_step_after_s": first_step_after_s}


class MinimalGRPO:
    """A plain PyTorch GRPO trainer on the HF model (see the module docstring)."""

    def __init__(self, work: Path, seed: int):
        import transformers
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from megarl.data import PromptLoader
        from megarl.prepare import prepare
        from megarl.reward.registry import reward_fn_from_config
        from megarl.trainer import load_data
        from megarl.validate import load_config

        # the recipe's config with the prepared data files filled in (prepare_sft_model created them)
        cfg = prepare(load_config(RECIPE, shared_overrides(work) + [f"trainer.run_dir={work / 'minimal_run'}"]), True)
        self.cfg = cfg
        path = str(work / "sft_model")
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        transformers.logging.disable_progress_bar()
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        self.model.generation_config.top_k = None  # sample from the whole distribution, as the recipe does
        self.loader = PromptLoader(load_data(cfg, self.tokenizer, "train"), seed=cfg.trainer.seed,
                                   shuffle=cfg.data.shuffle, drop_last=cfg.data.drop_last)
        self.reward_fn = reward_fn_from_config(cfg.reward)
        o = cfg.actor.optim
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=o.lr, betas=o.betas, eps=o.eps,
                                           weight_decay=o.weight_decay)
        torch.manual_seed(seed)

    def rollout(self, records) -> tuple[torch.Tensor, torch.Tensor, int]:
        """(sequences [B*n, P+R] left-padded prompts then responses, attention mask, P) from HF generate."""
        r, pad = self.cfg.rollout, self.tokenizer.pad_token_id
        p = max(len(rec.prompt_ids) for rec in records)
        ids = torch.full((len(records), p), pad, dtype=torch.long)
        mask = torch.zeros(len(records), p, dtype=torch.long)
        for i, rec in enumerate(records):
            ids[i, p - len(rec.prompt_ids):] = torch.tensor(rec.prompt_ids)
            mask[i, p - len(rec.prompt_ids):] = 1
        with torch.no_grad():
            seqs = self.model.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=r.temperature,
                                       top_p=1.0, max_new_tokens=r.response_length, num_return_sequences=r.n,
                                       pad_token_id=pad, eos_token_id=self.tokenizer.eos_token_id)
        response = seqs[:, p:]
        # real response tokens: up to and including the first EOS
        is_eos = response == self.tokenizer.eos_token_id
        after_eos = (is_eos.cumsum(dim=1) - is_eos.long()) > 0
        attention = torch.cat([mask.repeat_interleave(r.n, dim=0), (~after_eos).long()], dim=1)
        return seqs, attention, p

    def score(self, records, seqs: torch.Tensor, attention: torch.Tensor, p: int) -> torch.Tensor:
        from megarl.reward.compute import RewardInput, compute_rewards

        n = self.cfg.rollout.n
        samples = []
        for i in range(seqs.shape[0]):
            rec = records[i // n]
            tokens = seqs[i, p:][attention[i, p:].bool()].tolist()
            samples.append(RewardInput(rec.data_source, self.tokenizer.decode(tokens, skip_special_tokens=True),
                                       rec.ground_truth, rec.extra_info, rec.uid))
        scores, _, _ = compute_rewards(self.reward_fn, samples, num_workers=0)
        return torch.tensor(scores)

    def train(self, seqs: torch.Tensor, attention: torch.Tensor, p: int, scores: torch.Tensor) -> float:
        a, n = self.cfg.actor, self.cfg.rollout.n
        groups = scores.view(-1, n)
        adv = ((groups - groups.mean(dim=1, keepdim=True)) / (groups.std(dim=1, keepdim=True) + 1e-6)).flatten()
        positions = (attention.cumsum(dim=1) - 1).clamp(min=0)
        logits = self.model(input_ids=seqs, attention_mask=attention, position_ids=positions).logits[:, :-1]
        log_prob = torch.log_softmax(logits.float(), dim=-1).gather(-1, seqs[:, 1:, None]).squeeze(-1)
        response = attention[:, 1:].bool().clone()
        response[:, : p - 1] = False  # logprob position t scores token t+1: responses start at p-1
        ratio = torch.exp(log_prob - log_prob.detach())
        clipped = ratio.clamp(1 - a.clip_low, 1 + a.clip_high)
        token_loss = torch.maximum(-adv[:, None] * ratio, -adv[:, None] * clipped)
        loss = token_loss[response].sum() / response.sum().clamp(min=1)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), a.optim.clip_grad)
        self.optimizer.step()
        return loss.item()

    def step(self) -> dict:
        times = {}
        t0 = time.perf_counter()
        records = self.loader.next_batch(self.cfg.data.train_batch_size)
        seqs, attention, p = self.rollout(records)
        t1 = time.perf_counter()
        scores = self.score(records, seqs, attention, p)
        t2 = time.perf_counter()
        self.train(seqs, attention, p, scores)
        t3 = time.perf_counter()
        times.update(rollout=t1 - t0, reward=t2 - t1, train=t3 - t2, step=t3 - t0,
                     response_length=float(attention[:, p:].sum(dim=1).float().mean()))
        return times


def run_minimal(loop: MinimalGRPO, steps: int, warmup: int) -> list[dict]:
    for _ in range(warmup):
        loop.step()
    return [loop.step() for _ in range(steps)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=30, help="timed steps per side (after warm-up)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps first on each side")
    ap.add_argument("--threads", type=int, help="torch intra-op threads of both sides (default: torch's own choice)")
    ap.add_argument("--work-dir", help="keeps the data and SFT model between runs (default: a temporary folder)")
    ap.add_argument("overrides", nargs="*", help="recipe overrides for the megarl side (section.key=value), e.g. "
                    "rollout.cpu_prepack_weights=false")
    args = ap.parse_args()
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="megarl-bench-step-"))
    work.mkdir(parents=True, exist_ok=True)
    prepare_sft_model(work)
    if args.threads:  # the same intra-op threads on both sides (the megarl child reads OMP_NUM_THREADS)
        os.environ["OMP_NUM_THREADS"] = str(args.threads)
        torch.set_num_threads(args.threads)

    loop = MinimalGRPO(work, seed=1)
    half = args.steps // 2
    print(f"bench: minimal loop, {half} steps ...", flush=True)
    minimal = run_minimal(loop, half, args.warmup)
    print(f"bench: megarl train, {args.steps} steps ...", flush=True)
    mega = run_megarl(work, args.steps, args.warmup, args.overrides)
    print(f"bench: minimal loop, {args.steps - half} steps ...", flush=True)
    minimal += run_minimal(loop, args.steps - half, 0)

    mega_med = {k: median(s[k] for s in mega["steps"]) for k in mega["steps"][0]}
    mini_med = {k: median(s[k] for s in minimal) for k in minimal[0]}
    print(f"\nseconds per GRPO step on the tiny recipe, medians of {args.steps} steps per side "
          f"(torch threads {torch.get_num_threads()}):")
    print(f"{'phase':<14}{'megarl':>9}{'minimal':>9}")
    for phase in (*PHASES, "other"):
        if mega_med[phase] or phase in mini_med:
            minimal_s = f"{mini_med[phase]:>9.4f}" if phase in mini_med else f"{'-':>9}"
            print(f"{phase:<14}{mega_med[phase]:>9.4f}{minimal_s}")
    print(f"{'step (wall)':<14}{mega_med['step']:>9.4f}{mini_med['step']:>9.4f}")
    print("(megarl's other: metrics, logging and the loop between phases)")
    print(f"mean response length: megarl {mega_med['response_length']:.2f}, minimal {mini_med['response_length']:.2f}")
    print(f"megarl time from launch to its first step: {mega['first_step_after_s']:.1f} s (engine start included)")
    print(f"ratio megarl / minimal, time per step: {mega_med['step'] / mini_med['step']:.2f}  (target <= 1)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
