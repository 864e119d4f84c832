"""Capture: what a training run needs to measure its memory (torch only; no pandas, plotly or matplotlib)."""
