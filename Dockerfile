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

# EFA (AWS P4/P5): NCCL reaches EFA only through the aws-ofi-nccl net plugin and the EFA libfabric;
# without them it falls back to TCP sockets with no error (the EKS env sets NCCL_NET=OFI, so a
# plugin that does not load fails at communicator init instead). The layout of AWS's
# awsome-distributed-training Megatron image: the base's IB verbs packages out (the EFA installer
# brings its own rdma-core; the HPC-X copy shadowing it breaks the plugin's load), the EFA
# userspace without kernel module, aws-ofi-nccl built against it and the base's CUDA, both on the
# loader path (NCCL_NET_PLUGIN=ofi in the deployments makes NCCL load libnccl-net-ofi.so by name).
# Versions pinned together; the build fails if the plugin is missing or cannot resolve a library.
ARG EFA_INSTALLER_VERSION=1.42.0
ARG AWS_OFI_NCCL_VERSION=1.16.0
ENV LD_LIBRARY_PATH=/opt/amazon/efa/lib:/opt/amazon/ofi-nccl/lib:${LD_LIBRARY_PATH} \
    PATH=/opt/amazon/efa/bin:${PATH}
RUN apt-get update \
 && apt-get remove -y --allow-change-held-packages ibverbs-utils libibverbs-dev libibverbs1 libmlx5-1 \
 && apt-get install -y --no-install-recommends curl ca-certificates libhwloc-dev autoconf automake libtool make \
 && cd /tmp \
 && curl -fsSLO "https://efa-installer.amazonaws.com/aws-efa-installer-${EFA_INSTALLER_VERSION}.tar.gz" \
 && tar -xf "aws-efa-installer-${EFA_INSTALLER_VERSION}.tar.gz" \
 && (cd aws-efa-installer && ./efa_installer.sh -y -g -d --skip-kmod --skip-limit-conf --no-verify) \
 && curl -fsSLO "https://github.com/aws/aws-ofi-nccl/releases/download/v${AWS_OFI_NCCL_VERSION}/aws-ofi-nccl-${AWS_OFI_NCCL_VERSION}.tar.gz" \
 && tar -xf "aws-ofi-nccl-${AWS_OFI_NCCL_VERSION}.tar.gz" \
 && (cd "aws-ofi-nccl-${AWS_OFI_NCCL_VERSION}" \
     && ./configure --prefix=/opt/amazon/ofi-nccl --with-libfabric=/opt/amazon/efa --with-cuda=/usr/local/cuda --enable-platform-aws \
     && make -j"$(nproc)" && make install) \
 && rm -rf /tmp/aws-efa-installer* /tmp/aws-ofi-nccl-* /var/lib/apt/lists/* \
 && ldconfig \
 && plugin=/opt/amazon/ofi-nccl/lib/libnccl-net-ofi.so \
 && test -f "$plugin" \
 && ! ldd "$plugin" | grep "not found" \
 && fi_info --version

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
