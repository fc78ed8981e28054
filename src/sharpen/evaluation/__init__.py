"""Evaluation (pass@k, maj@k over the training environments and rewards) arrives with the monitoring issue.
The loop already logs greedy-free reward statistics per step; nothing here is imported yet."""
