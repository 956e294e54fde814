"""Metrics: perplexity, calibration, draft acceptance; and the text sources they read."""
