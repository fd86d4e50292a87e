# GPU deployment on NVIDIA's Triton image (it brings tritonserver, the Python backend and CUDA).
# The base is NVIDIA's NGC image (24.10 = Triton 2.51, the release the nvidia-pytriton wheel carries),
# named in full so that a plain build works wherever nvcr.io is reachable (set BASE_IMAGE for a mirror):
#   docker build -t freetoken .
#   docker run --gpus all --shm-size 1g -p 8000:8000 -p 8001:8001 -p 8002:8002 freetoken
# Engine settings come from FREETOKEN_<NAME> variables (FREETOKEN_MODEL_PATH, FREETOKEN_DTYPE, ...).
ARG BASE_IMAGE=nvcr.io/nvidia/tritonserver:24.10-py3
FROM ${BASE_IMAGE}

ENV PIP_NO_CACHE_DIR=1 \
    FREETOKEN_HOME=/opt/freetoken/cache \
    FREETOKEN_MODEL_REPOSITORY=/opt/freetoken/model_repository

WORKDIR /opt/freetoken
# The image's Python runs the models (its own Python-backend stub matches it), so the package goes
# into that Python; torch comes from the image's CUDA-matched index (override TORCH_SPEC to pin).
ARG TORCH_SPEC=torch
COPY pyproject.toml README.md ./
COPY freetoken_core ./freetoken_core
COPY model_repository ./model_repository
RUN pip install "$TORCH_SPEC" "numpy<2" && pip install -e ".[gpu]" "tritonclient[all]" python-rapidjson requests fastapi uvicorn uvloop httptools

# Fetch and convert the default model at build time so the container starts offline.
RUN freetoken-core fetch-model

EXPOSE 8000 8001 8002 9000
# `serve` finds /opt/tritonserver in this image and uses it instead of the pytriton wheel's copy.
CMD ["freetoken-core", "serve", "--http-port", "8000", "--grpc-port", "8001", "--metrics-port", "8002", "--param", "device=cuda"]
