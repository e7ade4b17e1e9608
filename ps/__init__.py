"""The parameter server: server ranks own row shards of the embedding tables."""
