# The image the deployments run (k8s/ through kustomize's images:, slurm/ through pyxis/enroot):
# NVIDIA's PyTorch container, which Megatron users already run in (CUDA, NCCL, cuDNN, torch and
# Transformer Engine built for it), with the project and its GPU extra installed at build time.
# Nothing is downloaded when a container starts.
#
#   docker build -t REGISTRY/resilient-pretrain:v0.1.0 --build-arg GIT_COMMIT=$(git rev-parse HEAD) .
#   docker push REGISTRY/resilient-pretrain:v0.1.0        # prints the digest: sha256:...
#
# Deploy by digest and record it: kustomize's images: (digest) and IMAGE_DIGEST in the
# pretrain-env ConfigMap (k8s/components/h100), or IMAGE_DIGEST with CONTAINER_IMAGE for Slurm
# (slurm/pretrain.sbatch). Every checkpoint manifest records IMAGE_DIGEST; `tiering ls` shows it.
# The base is pinned by tag (Python 3.12); pin it by digest too once you have pulled it:
#   docker build --build-arg BASE_IMAGE=nvcr.io/nvidia/pytorch:25.09-py3@sha256:... .
ARG BASE_IMAGE=nvcr.io/nvidia/pytorch:25.09-py3
FROM ${BASE_IMAGE}

ARG GIT_COMMIT=unknown
# The versions the GPU check (scripts/gpu-check.sh) runs against; the base's torch and Transformer
# Engine are kept (constraints below), so the [gpu] extra is satisfied by what the base ships.
ARG MEGATRON_CORE_SPEC="megatron-core>=0.19,<0.20"
ARG NVRX_SPEC="nvidia-resiliency-ext>=0.7,<0.8"

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1 \
    RP_GIT_COMMIT=${GIT_COMMIT}

WORKDIR /opt/resilient-pretrain
COPY pyproject.toml README.md ./
COPY pretrain ./pretrain
COPY tiering ./tiering
COPY configs ./configs

# Install, then prove at build time that every entry point the manifests call starts:
# pretrain (launch, upload, prepare-data), tiering (restore) and NVRx's ft_launcher.
RUN pip list --format=freeze | grep -iE '^(torch|transformer[-_]engine[-_a-z0-9]*|flash[-_]attn)==' > /tmp/base.txt \
 && pip install --constraint /tmp/base.txt "${MEGATRON_CORE_SPEC}" "${NVRX_SPEC}" ".[gpu]" \
 && rm /tmp/base.txt \
 && pretrain --help > /dev/null \
 && tiering --help > /dev/null \
 && ft_launcher --help > /dev/null \
 && python -c "import megatron.core, nvidia_resiliency_ext, transformer_engine, pretrain.train"

# IMAGE_DIGEST cannot be known inside the build: the deployments set it to the pushed digest.
ENV IMAGE_DIGEST=unknown
CMD ["pretrain", "--help"]
