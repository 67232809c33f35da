# One image for every role: the controller and each worker host run it with a
# different command (see docker-compose.yml). CPU-only torch keeps it small;
# for GPU hosts, base it on an image with CUDA and a CUDA build of torch.
FROM python:3.12-slim

# hugetlb malloc: ZeroMQ allocates a fresh buffer per large message, and fresh
# 4 KiB pages fault at a fraction of memcpy speed (bench/round.py).
ENV PYTHONUNBUFFERED=1 \
    GLIBC_TUNABLES=glibc.malloc.hugetlb=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /app
RUN pip install --index-url https://download.pytorch.org/whl/cpu "torch>=2.2"
COPY pyproject.toml README.md ./
COPY flodl_zmq ./flodl_zmq
RUN pip install .

# The controller's base port and the three after it (control, data, broadcast, join).
EXPOSE 7300-7303
CMD ["flodl-zmq", "--help"]
