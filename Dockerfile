# kvindex: the daemon (and deploy/traffic.py, the compose deployment's router) in one small image.
FROM python:3.11-slim
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /app
COPY pyproject.toml README.md ./
COPY kvindex ./kvindex
COPY adapters ./adapters
RUN pip install .
COPY deploy ./deploy
EXPOSE 8080 5557
USER nobody
HEALTHCHECK --interval=5s --timeout=3s --start-period=5s --retries=12 \
  CMD ["python", "-c", "import urllib.request,sys; sys.exit(0 if urllib.request.urlopen('http://127.0.0.1:8080/healthz', timeout=2).status == 200 else 1)"]
ENTRYPOINT ["kvindex"]
CMD ["serve", "--config", "/app/deploy/kvindex-sim.toml"]
