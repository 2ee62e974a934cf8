"""What every stage shares: model sources and identities, tokenizer loading, progress, worker processes."""
