"""Data preparation: documents into committed corpus parts, then packed token shards."""
