"""The student side: data from the stores, the fused top-K loss, training, checkpoints, several ranks, chat."""
