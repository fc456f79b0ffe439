"""Reports of runs: plots."""

from rolerl.report.plots import plot_metrics

__all__ = ["plot_metrics"]
