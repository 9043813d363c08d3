# kvindex: the daemon (and deploy/traffic.py, the compose deployment's router) in one small image.
# Stage 1 compiles the native accelerators (setup.py: C only, XXH3 is kvindex's own kvindex/kx_xxh3.h);
# stage 2 installs that wheel without a compiler. KVINDEX_REQUIRE_NATIVE makes a failed build fail here.
FROM python:3.11-slim AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY kvindex ./kvindex
COPY adapters ./adapters
RUN pip wheel --no-deps --wheel-dir /wheels .

FROM python:3.11-slim
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /app
COPY --from=build /wheels /wheels
RUN pip install /wheels/*.whl && rm -rf /wheels \
    && KVINDEX_REQUIRE_NATIVE=1 python -c "import kvindex.keys, kvindex.http.app; from kvindex import native; print(native.status())"
COPY deploy ./deploy
EXPOSE 8080 5557
USER nobody
HEALTHCHECK --interval=5s --timeout=3s --start-period=5s --retries=12 \
  CMD ["python", "-c", "import urllib.request,sys; sys.exit(0 if urllib.request.urlopen('http://127.0.0.1:8080/healthz', timeout=2).status == 200 else 1)"]
ENTRYPOINT ["kvindex"]
CMD ["serve", "--config", "/app/deploy/kvindex-sim.toml"]
