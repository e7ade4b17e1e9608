"""hpctrain: MPI-launched training of DLRM-style recommenders.

Every process is an MPI rank; see README.md for the launch lines and DESIGN in the docs for
the layers (runtime/comm/sync < embeddings < ps < models/data/parallel < train < cli).
"""

__version__ = "0.1.0"
