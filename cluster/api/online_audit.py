"""The online audit: a share of finished greedy and seed-exact requests, replayed in the background.

`AuditConfig.fraction` of the requests that finish normally (length or stop) and that a replay
can reproduce (greedy or seed-exact: `cluster.api.audit.replay_rule`) are drawn, with an
explicit `random.Random`, and handed to one background worker thread through a bounded queue
(`max_pending`; a request drawn when it is full is dropped and counted). The worker asks a
verifier for the reference (bound by the replica calls' timeout, not by the request's deadline,
which may have passed) (`cluster.api.audit.audit_served`: on a verifier the router's pool
picks, in `AuditConfig.dtype`'s weights) and compares token by token. Offering costs a request
one draw and, when drawn, one append: nothing waits for the audit.

Low priority: the worker runs one audit at a time, and the verifier replays it between its
engine's calls (`verifier.audit_replica`: before each chunk it waits while a call is queued or
running), so audit work never delays user traffic by more than the chunk in flight.

Metrics (`cluster.metrics`): every audit counts in `tandem_audit_checked_total{rule, dtype,
cause}`, a mismatch (cause `near_tie` or `divergence`) in `tandem_audit_mismatched_total` too,
and a request drawn but not checked in `tandem_audit_dropped_total{reason}` (`queue_full`,
`failed`). Every mismatch is logged at WARNING with its evidence: request id, position, served
and reference tokens, gaps, rule, drafter and dtype.

`close` stops the worker (audits still waiting are dropped); no thread runs while `fraction` is
0 or after `close`.
"""

from __future__ import annotations

import dataclasses
import logging
import random
import threading
from collections import deque
from collections.abc import Callable

from cluster.api.audit import Served, replay_rule
from cluster.api.audit_config import AuditConfig
from cluster.metrics.recorder import TandemMetrics
from cluster.runtime.audit import AuditReport, cause

logger = logging.getLogger(__name__)

QUEUE_FULL = "queue_full"
FAILED = "failed"
CLOSE_TIMEOUT_S = 30.0
"""How long `close` waits for an audit in flight to finish."""


Check = Callable[[Served], AuditReport]
"""Replays one served request and compares it (`cluster.api.audit.audit_served`)."""


class OnlineAudit:
    """Draws finished requests and audits them on one background thread (module docstring)."""

    def __init__(
        self,
        config: AuditConfig,
        check: Check,
        metrics: TandemMetrics,
        rng: random.Random | None = None,
    ) -> None:
        """`rng`: the draws' generator (default: a fresh, unseeded `random.Random`)."""
        self.config = config
        self._check = check
        self._metrics = metrics
        self._rng = rng if rng is not None else random.Random()
        self._condition = threading.Condition()
        self._pending: deque[Served] = deque()
        self._in_flight = 0
        self._closed = False
        self._thread: threading.Thread | None = None
        if config.fraction > 0:
            self._thread = threading.Thread(target=self._work, name="online-audit", daemon=True)
            self._thread.start()

    @property
    def enabled(self) -> bool:
        """Whether finished requests may be drawn (a fraction above 0, not closed)."""
        return self._thread is not None and not self._closed

    def offer(self, served: Served) -> bool:
        """Draw `served` for an audit with probability `fraction` if a replay can reproduce
        it; True when it was queued (False: not drawn, not replayable, or dropped because the
        queue is full)."""
        if not self.enabled or replay_rule(served.request.sampling) is None:
            return False
        with self._condition:
            if self._closed or self._rng.random() >= self.config.fraction:
                return False
            if len(self._pending) >= self.config.max_pending:
                full = True
            else:
                full = False
                # Audited after its request ended: not bound by its caller's deadline.
                request = dataclasses.replace(served.request, deadline=None)
                self._pending.append(dataclasses.replace(served, request=request))
                self._condition.notify()
        if full:
            self._metrics.audit_dropped(QUEUE_FULL)
            logger.info("online audit: queue full, request %s not audited", served.request_id)
        return not full

    def wait_idle(self, timeout_s: float | None = None) -> bool:
        """Wait until no audit is queued or running; False if `timeout_s` passed first."""
        with self._condition:
            return self._condition.wait_for(
                lambda: not self._pending and not self._in_flight, timeout_s
            )

    def close(self, timeout_s: float = CLOSE_TIMEOUT_S) -> None:
        """Stop the worker: audits still queued are dropped; one in flight may finish within
        `timeout_s`. Offers after this are ignored."""
        with self._condition:
            self._closed = True
            self._pending.clear()
            self._condition.notify_all()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout_s)

    def _work(self) -> None:
        while True:
            with self._condition:
                while not self._pending and not self._closed:
                    self._condition.wait()
                if self._closed:
                    return
                served = self._pending.popleft()
                self._in_flight += 1
            try:
                self._audit(served)
            finally:
                with self._condition:
                    self._in_flight -= 1
                    self._condition.notify_all()

    def _audit(self, served: Served) -> None:
        try:
            report = self._check(served)
        except Exception as error:  # an audit that fails is counted and logged, never raised
            self._metrics.audit_dropped(FAILED)
            logger.warning("online audit of request %s failed: %s", served.request_id, error)
            return
        verdict = cause(report)
        self._metrics.audit_checked(report.rule, report.dtype, verdict)
        if verdict != "match":
            log_mismatch(served, report, verdict)


def log_mismatch(served: Served, report: AuditReport, verdict: str) -> None:
    """One WARNING line with a mismatch's evidence."""
    logger.warning(
        "audit mismatch (%s): request %s, rule %s, drafter %s, dtype %s: %d of %d served tokens "
        "match the target alone; first at position %s: served %s, target %s, top-2 gap %s, "
        "served gap %s (worst %s)",
        verdict,
        served.request_id,
        report.rule,
        report.drafter,
        report.dtype,
        report.matched,
        report.total,
        report.first_divergence,
        report.served_token,
        report.reference_token,
        _number(report.gap),
        _number(report.served_gap),
        _number(report.worst_gap),
    )


def _number(value: float | None) -> str:
    return "-" if value is None else f"{value:.4f}"
