"""Models: DLRM (dense part; embeddings come from the embeddings package)."""
