"""Embedding tables as data, independent of who serves them.

Table specs and layout, sparse optimizers (numba), stores that hold rows (local, replicated
over the workers; the parameter server's client implements the same protocol), and the torch
bridge the model uses. Never imports :mod:`ps`.
"""
