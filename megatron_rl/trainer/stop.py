"""Stopping on a signal: SIGUSR1 / SIGTERM ask the run to finish the step, checkpoint and exit with
:data:`REQUEUE_EXIT_CODE` ("requeue me"); a step still generating is given up instead, what it
generated kept in the checkpoint (``trainer.async_rollout``: a preemption loses no finished group).
The entry point installs the handlers."""

from __future__ import annotations

import logging
import signal

log = logging.getLogger("megatron_rl")

REQUEUE_EXIT_CODE = 99


class StopRequest:
    """Set by a signal handler; the trainer reads it between steps (agreed over ranks by the Context)."""

    def __init__(self) -> None:
        self.requested = False

    def install_signal_handlers(self, signals=(signal.SIGUSR1, signal.SIGTERM)) -> None:
        def request_stop(signum, _frame):
            log.warning("signal %s: will checkpoint after this step and exit %d", signum, REQUEUE_EXIT_CODE)
            self.requested = True

        for sig in signals:
            signal.signal(sig, request_stop)
