# megarl for GPU clusters: CUDA, torch, megatron-core, Transformer Engine, vLLM and Ray, pinned together.
#
#   docker build -t megarl:gpu .
#   docker run --gpus all --ipc=host --network=host -v "$PWD/runs:/workspace/megarl/runs" megarl:gpu \
#       megarl plan recipes/ppo_llama3_70b.yaml --nodes 16 --gpus-per-node 8
#
# Version table (docs/gpu.md "GPU image and compatibility"): vLLM 0.32.0 pins torch 2.13.0; megatron-core 0.16.1 is the release whose
# CPU shims megarl tests (megarl/megatron/cpu_compat.py) and declares Transformer Engine >=2.9,<2.12, so TE is 2.11.0,
# compiled here against the image's torch (its torch extension is a source build).
ARG CUDA_IMAGE=nvidia/cuda:12.9.1-cudnn-devel-ubuntu22.04
FROM ${CUDA_IMAGE}

ARG PYTHON_VERSION=3.11
ARG TORCH_VERSION=2.13.0
ARG VLLM_VERSION=0.32.0
ARG MEGATRON_CORE_VERSION=0.16.1
ARG TRANSFORMER_ENGINE_VERSION=2.11.0
ARG RAY_VERSION=2.60.0
ARG MAX_JOBS=16

ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:${PATH} \
    CUDA_DEVICE_MAX_CONNECTIONS=1 \
    TORCH_NCCL_AVOID_RECORD_STREAMS=1 \
    NVTE_FRAMEWORK=pytorch

SHELL ["/bin/bash", "-o", "pipefail", "-c"]

# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends software-properties-common \
    && add-apt-repository -y ppa:deadsnakes/ppa \
    && apt-get update \
    && apt-get install -y --no-install-recommends \
        "python${PYTHON_VERSION}" "python${PYTHON_VERSION}-dev" "python${PYTHON_VERSION}-venv" \
        git build-essential ninja-build cmake libibverbs1 ibverbs-providers rdma-core numactl \
    && rm -rf /var/lib/apt/lists/* \
    && "python${PYTHON_VERSION}" -m venv "${VIRTUAL_ENV}"

# torch first and pinned by a constraints file, so no later requirement can swap it for another build.
RUN printf 'torch==%s\nvllm==%s\nmegatron-core==%s\nray==%s\n' \
        "${TORCH_VERSION}" "${VLLM_VERSION}" "${MEGATRON_CORE_VERSION}" "${RAY_VERSION}" > /opt/constraints-gpu.txt \
    && pip install --upgrade "pip==25.3" "setuptools==80.9.0" "wheel==0.45.1" \
    && pip install -c /opt/constraints-gpu.txt "torch==${TORCH_VERSION}" \
    && pip install -c /opt/constraints-gpu.txt "vllm==${VLLM_VERSION}" "ray[default]==${RAY_VERSION}" \
        "megatron-core==${MEGATRON_CORE_VERSION}" "pybind11==3.0.1" "nvidia-mathdx==25.6.0"

# Transformer Engine: the core library as a wheel, the torch extension built against the torch installed above.
RUN MAX_JOBS="${MAX_JOBS}" pip install -c /opt/constraints-gpu.txt --no-build-isolation \
        "transformer-engine[pytorch]==${TRANSFORMER_ENGINE_VERSION}" \
    && python -c "import torch, transformer_engine.pytorch, megatron.core, vllm, ray; print('torch', torch.__version__, 'cuda', torch.version.cuda)"

WORKDIR /workspace/megarl
COPY setup.py README.md ./
COPY megarl ./megarl
RUN pip install -c /opt/constraints-gpu.txt -e '.[test]'
COPY recipes ./recipes
COPY launch ./launch
COPY tests ./tests
# `make test-gpu` and `make gpu-check` in the image use its /opt/venv Python (first on PATH), which has CUDA torch:
#   docker run --gpus all --ipc=host megarl:gpu make test-gpu
COPY Makefile pytest.ini ./
COPY scripts ./scripts
COPY bench ./bench

CMD ["megarl", "--help"]
