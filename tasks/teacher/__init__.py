"""The teacher side: loading the teacher, the chunked top-K, the precompute pass and its worker process."""
