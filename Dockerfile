# syntax=docker/dockerfile:1
# kvindex image: `kvindex serve` by default; the same image runs `kvindex route` and the `kvshim` bridges
# (override the command). docs/deploy.md, "Deployment files".
#
#   docker build -t kvindex:0.1.0 .
#   docker run --rm -p 50051:50051 -p 9400:9400 kvindex:0.1.0 --nats tls://nats:4222 --nats-creds /run/index.creds

ARG PYTHON_IMAGE=python:3.11-slim-bookworm
# grpc_health_probe: Kubernetes' built-in grpc probe speaks plaintext only, so with gRPC TLS on the
# pods probe readiness/liveness with this binary (deploy/k8s/index.yaml).
ARG GRPC_HEALTH_PROBE_VERSION=v0.4.42

# -- build: compile the wheel (Cython extensions included) and install it into a venv ---------------
FROM ${PYTHON_IMAGE} AS build
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY pyproject.toml setup.py MANIFEST.in README.md ./
COPY kvindex ./kvindex
COPY workers_shim ./workers_shim
COPY kvtools ./kvtools
RUN python -m venv /opt/kvindex \
    && pip wheel --no-deps --wheel-dir /wheels . \
    && /opt/kvindex/bin/pip install "$(ls /wheels/kvindex-*.whl)[capture,route]"
# The extensions are optional in setup.py (a machine without a compiler falls back to pure Python,
# several times slower): here a missing one must fail the build instead.
RUN /opt/kvindex/bin/python -c "import kvindex._keys_native, kvindex.index._native, kvindex.scoring._kernels" \
    && /opt/kvindex/bin/kvindex serve --help > /dev/null \
    && /opt/kvindex/bin/kvshim vllm --help > /dev/null

# -- probe: the health-check binary, checked against the release's own checksums -----------------------
FROM ${PYTHON_IMAGE} AS probe
ARG GRPC_HEALTH_PROBE_VERSION
ARG TARGETARCH
ADD https://github.com/grpc-ecosystem/grpc-health-probe/releases/download/${GRPC_HEALTH_PROBE_VERSION}/grpc_health_probe-linux-${TARGETARCH:-amd64} /probe/
ADD https://github.com/grpc-ecosystem/grpc-health-probe/releases/download/${GRPC_HEALTH_PROBE_VERSION}/checksums.txt /probe/
RUN cd /probe \
    && grep " grpc_health_probe-linux-${TARGETARCH:-amd64}\$" checksums.txt | sha256sum -c - \
    && install -m 0755 grpc_health_probe-linux-${TARGETARCH:-amd64} /usr/local/bin/grpc_health_probe

# -- runtime: no compiler, no build tools, not root ---------------------------------------------------
FROM ${PYTHON_IMAGE} AS runtime
RUN groupadd --system --gid 10001 kvindex \
    && useradd --system --uid 10001 --gid kvindex --no-create-home --home-dir /nonexistent \
        --shell /usr/sbin/nologin kvindex
COPY --from=build /opt/kvindex /opt/kvindex
COPY --from=probe /usr/local/bin/grpc_health_probe /usr/local/bin/grpc_health_probe
ENV PATH=/opt/kvindex/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1
WORKDIR /tmp
# Numeric, so that Kubernetes' runAsNonRoot can check it without reading /etc/passwd.
USER 10001:10001
# gRPC API (Score, Lookup, ...; health), Envoy ext_proc endpoint picker (with --ext-proc-port 9002),
# Prometheus /metrics. `kvindex route` listens on 8080 (--port).
EXPOSE 50051 9002 9400
# For `docker run` with the default plaintext gRPC (Kubernetes ignores HEALTHCHECK: deploy/k8s has
# its own probes). With --tls-cert, override it: --health-cmd 'grpc_health_probe ... -tls -tls-no-verify'.
HEALTHCHECK --interval=10s --timeout=5s --start-period=15s \
    CMD ["grpc_health_probe", "-addr=127.0.0.1:50051", "-service=liveness"]
# Exec form: kvindex is PID 1 and receives SIGTERM itself (readiness NOT_SERVING, in-flight RPCs
# finish within --shutdown-grace, exit 0). Without --nats it embeds its own nats-server (a laptop).
ENTRYPOINT ["kvindex", "serve"]
CMD ["--log-format", "json"]
