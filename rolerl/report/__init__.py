"""Reports of runs: plots, and the HTML report (`rolerl report`)."""

from rolerl.report.html import write_report
from rolerl.report.plots import plot_metrics

__all__ = ["plot_metrics", "write_report"]
