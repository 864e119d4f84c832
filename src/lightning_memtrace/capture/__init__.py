"""What a training run needs: measuring memory and writing it down (torch only; no pandas, plotly or matplotlib)."""
