"""Demonstrations for imitation warm starts, built from task data: GSM8K's solutions as tool calls (`gsm8k`)
and every role of a multi-role workflow (`roles`). Above tasks, workflows and training: it uses all three."""
