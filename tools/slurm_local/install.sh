#!/usr/bin/env bash
# Install what tests/cluster/test_slurm_e2e.py needs for its one-machine SLURM cluster: Debian's
# slurm-wlm (slurmctld, slurmd, sbatch, scontrol, ...) and munge (SLURM's authentication).
# Run by `make test` (and so by CI's .ci/run); does nothing when both are already installed.
# Needs root (or sudo without a password) and apt-get; without them it says so and exits 0, and
# the SLURM tests fail in CI (CI=true) and skip elsewhere, naming this script.
set -euo pipefail
have() { command -v "$1" >/dev/null 2>&1; }
if have slurmctld && have slurmd && have sbatch && have munged; then exit 0; fi
if ! have apt-get; then
    echo "slurm_local/install.sh: no apt-get here; install slurm-wlm and munge by hand for the SLURM tests" >&2
    exit 0
fi
SUDO=()
if [[ $(id -u) != 0 ]]; then
    if have sudo && sudo -n true 2>/dev/null; then SUDO=(sudo -n)
    else
        echo "slurm_local/install.sh: not root: run 'sudo apt-get install slurm-wlm munge' for the SLURM tests" >&2
        exit 0
    fi
fi
echo "slurm_local/install.sh: apt-get install slurm-wlm munge" >&2
export DEBIAN_FRONTEND=noninteractive
"${SUDO[@]}" apt-get update -qq
"${SUDO[@]}" apt-get install -y -qq --no-install-recommends slurm-wlm munge >/dev/null
# The packages' own services are not ours: the test fixture starts private daemons with its own
# configuration and key (tools/slurm_local/cluster.py).
if have systemctl; then "${SUDO[@]}" systemctl disable --now slurmctld slurmd munge >/dev/null 2>&1 || true; fi
