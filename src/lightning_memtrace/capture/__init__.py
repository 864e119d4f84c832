"""Capture: what a training run needs to measure memory (torch only: no pandas, plotly or matplotlib)."""
