"""Inference engines: one loaded model each, called from the replica's worker thread."""
