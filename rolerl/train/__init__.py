"""Training: the RL loop (`rl.train`), imitation warm-start (`sft.sft`), the update, runs and checkpoints."""
