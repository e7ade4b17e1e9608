"""MPI runtime: the world and its communicators, rank math, logging, abort-on-error."""
