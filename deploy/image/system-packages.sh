#!/usr/bin/env bash
# The Debian packages an image stage needs (run as root in the image build):
#   build    g++ for the native CPU kernels (`kvmesh warm`; ninja comes from pip)
#   runtime  libgomp1 (the kernels' OpenMP runtime), wget (KubeRay's probes) and the
#            non-root user `ray` (uid/gid 1000) the pods run as
set -euo pipefail
case "${1:?usage: system-packages.sh build|runtime}" in
    build) packages=(g++) ;;
    runtime) packages=(libgomp1 wget) ;;
    *) echo "system-packages.sh: unknown stage $1 (build|runtime)" >&2; exit 2 ;;
esac
apt-get update -q
apt-get install -y -q --no-install-recommends "${packages[@]}"
rm -rf /var/lib/apt/lists/*
if [ "$1" = runtime ]; then
    groupadd --gid 1000 ray
    useradd --uid 1000 --gid 1000 --create-home --shell /bin/bash ray
fi
