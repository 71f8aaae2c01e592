"""Analysis of a finished (or running) run directory: ``megatron-rl analyze RUN_DIR``.

``run_data`` reads what the trainer wrote (metrics.jsonl, the rollout dumps, the live wrong-label
list, the demo's planted labels); ``figures`` turns it into plotly figures; ``report`` writes the
static HTML report (``RUN_DIR/report/index.html``, plotly's JS bundled beside it) and the summary.
"""

from megatron_rl.analysis.report import analyze

__all__ = ["analyze"]
