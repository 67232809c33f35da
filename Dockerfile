# One image for every role: the controller and each worker host run it with a
# different command (see docker-compose.yml, deploy/kubernetes/).
#
#   docker build -t flodl-zmq:local .                                  CPU-only torch (small)
#   docker build --build-arg TORCH_VARIANT=cu126 -t flodl-zmq:cuda .   CUDA build of torch
#
# TORCH_VARIANT names a torch wheel index (cpu, cu126, cu128, ...). A CUDA wheel
# brings its CUDA libraries with it; the driver and nvidia-smi come from the
# host through the NVIDIA container toolkit (docker run --gpus all, or the
# Kubernetes device plugin); NVIDIA_DRIVER_CAPABILITIES asks it for nvidia-smi
# too (the agent lists GPUs with it). Which GPUs a container gets is left to
# --gpus or the plugin: the image names none.
FROM python:3.12-slim

ARG TORCH_VARIANT=cpu

# hugetlb malloc: ZeroMQ allocates a fresh buffer per large message, and fresh
# 4 KiB pages fault at a fraction of memcpy speed (bench/round.py).
ENV PYTHONUNBUFFERED=1 \
    GLIBC_TUNABLES=glibc.malloc.hugetlb=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility

WORKDIR /app
RUN pip install --index-url "https://download.pytorch.org/whl/${TORCH_VARIANT}" "torch>=2.6"
COPY pyproject.toml README.md ./
COPY flodl_zmq ./flodl_zmq
RUN pip install .

# The controller's base port and the three after it (control, data, broadcast, join).
EXPOSE 7300-7303
CMD ["flodl-zmq", "--help"]
