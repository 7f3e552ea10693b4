# Decoding Playground image: CPU by default, the embedded model converted at build time so the
# container starts offline. Installs with deploy/install.sh, the same script `make setup` runs.
#   docker build -t decoding-playground .            (torch from PyTorch's CPU index)
#   make image                                        (this machine: local base + local torch wheel, podman)
# GPU: --build-arg TORCH_SPEC="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128"
# (the CUDA wheels bring their own CUDA libraries; the host needs only the NVIDIA driver).
ARG BASE=python:3.11-slim
FROM ${BASE}

# pip arguments for torch; `make image` points them at deploy/wheels/ (the local CPU wheel).
ARG TORCH_SPEC="torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu"
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1 \
    PATH=/opt/venv/bin:$PATH \
    HOME=/home/app \
    GRADIO_SERVER_NAME=0.0.0.0 \
    GRADIO_SERVER_PORT=7860 \
    GRADIO_ANALYTICS_ENABLED=False \
    HF_HUB_DISABLE_TELEMETRY=1 \
    OMP_WAIT_POLICY=PASSIVE \
    DECODING_PLAYGROUND_CACHE=/app/.cache

RUN useradd --uid 1000 --create-home --home-dir /home/app app \
 && python3 -m venv /opt/venv
WORKDIR /app
COPY requirements.txt ./
COPY deploy/install.sh deploy/
# deploy/wheels/ is bind-mounted, not copied, so a local torch wheel never lands in a layer.
# TORCH_SPEC is split into pip arguments on purpose.
# hadolint ignore=SC2086
RUN --mount=type=bind,source=deploy/wheels,target=/wheels \
    deploy/install.sh /opt/venv/bin/python ${TORCH_SPEC}
COPY --chown=1000:1000 app.py ./
COPY --chown=1000:1000 engine/ engine/
COPY --chown=1000:1000 playground/ playground/
COPY --chown=1000:1000 presets/ presets/
RUN chown 1000:1000 /app
USER 1000
# Convert the embedded GGUF to safetensors now (as the runtime user, so no chown copy of the weights).
RUN python -c "from engine.backends.local import embedded_model_dir; print(embedded_model_dir())"
EXPOSE 7860
HEALTHCHECK --interval=30s --timeout=5s --start-period=60s \
  CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:7860/', timeout=4)"]
CMD ["python", "app.py"]
