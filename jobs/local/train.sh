#!/usr/bin/env bash
# Train on this machine: NP ranks of the MPI that mpi4py was built against (the `mpich`
# wheel of `pip install -e ".[local]"`, or the site's MPI). Arguments go to `hpctrain train`.
#   NP=4 jobs/local/train.sh                                  # the embedded default job
#   NP=2 jobs/local/train.sh jobs/configs/criteo_sample.toml
#   NP=3 jobs/local/train.sh jobs/configs/dlrm_reference.toml --set train.steps=500
set -euo pipefail
mpiexec -n "${NP:-4}" hpctrain train "$@"
