"""RewardManager: score a batch of responses by style; a bad sample is a counted zero, never a crash.

In-process styles (``exact_boxed``) run inline; pooled styles (``math``, ``code``) run in a
:class:`HardTimeoutPool` started lazily on first use; the judge (styles registered ``judged``, or
``judge.mode`` main/fallback for ``judge.styles``) runs as concurrent HTTP requests. Every choice
is a lookup of the style's registered properties (``pooled``, ``judged``), never its name.
"""

from __future__ import annotations

import logging
import time
from collections import Counter, defaultdict

from megatron_rl.common.errors import InputError
from megatron_rl.rewards.base import (CORRECT, ERROR, TIMEOUT, UNPARSABLE, WRONG, Outcome, RewardItem,
                                      get_style, registered_styles)
from megatron_rl.rewards.config import RewardConfig
from megatron_rl.rewards.judge import judge_batch
from megatron_rl.rewards.pool import HardTimeoutPool
from megatron_rl.rewards.user import check_functions, pooled_targets, register_functions

log = logging.getLogger(__name__)


class RewardManager:
    def __init__(self, cfg: RewardConfig):
        cfg.validate()
        self.cfg = cfg
        self._pool: HardTimeoutPool | None = None
        register_functions(cfg)
        for target in cfg.style_map.values():
            get_style(target)  # raises, listing the registered styles, for a bad map
        if cfg.default_style:
            get_style(cfg.default_style)

    # -- style resolution -------------------------------------------------------------------------
    def resolve_style(self, style: str, data_source: str = "") -> str:
        """The registered style for an item; raises KeyError when none fits.

        Order: the style itself, the data source itself, ``style_map[data_source]``,
        ``style_map[style]`` (a specific source beats verl's generic style "rule"), the default.
        """
        known = set(registered_styles())
        for key in (style, data_source):
            if key in known:
                return key
        for key in (data_source, style):
            if key in self.cfg.style_map:
                return self.cfg.style_map[key]
        if self.cfg.default_style:
            return self.cfg.default_style
        raise KeyError(f"no reward style for style={style!r} data_source={data_source!r}; "
                       f"registered: {sorted(known)}; map more with reward.style_map")

    # -- scoring ----------------------------------------------------------------------------------
    def _pool_for_use(self) -> HardTimeoutPool:
        if self._pool is None:
            modules = sorted({get_style(s).fn.__module__ for s in registered_styles()
                              if get_style(s).pooled})
            targets = pooled_targets(self.cfg)
            setup = {"setup": (("megatron_rl.rewards.user", "load_targets", (targets,)),)} if targets else {}
            self._pool = HardTimeoutPool(self.cfg.num_workers, preload=tuple(modules),
                                         memory_mb=self.cfg.worker_memory_mb,
                                         start_timeout_s=self.cfg.worker_start_timeout_s, **setup)
        return self._pool

    def score(self, items: list[RewardItem], return_details: bool = False):
        """``(scores, metrics)`` or, with ``return_details``, ``(scores, metrics, details)``."""
        t0 = time.perf_counter()
        styles = [self.resolve_style(it.style, it.extra.get("data_source", "")) for it in items]
        jcfg = self.cfg.judge
        judged = {i for i, s in enumerate(styles)
                  if get_style(s).judged or (jcfg.mode == "main" and s in jcfg.styles)}
        restarts_before = self._pool.restarts if self._pool else 0
        outcomes = self._score_by_rules(items, styles, skip=judged)
        judge_metrics = self._apply_judge(items, styles, outcomes, judged)
        metrics = self._metrics(styles, outcomes, time.perf_counter() - t0)
        metrics.update(judge_metrics)
        metrics["reward/worker_restarts"] = float(
            (self._pool.restarts if self._pool else 0) - restarts_before)
        scores = [float(o.score) for o in outcomes]
        if not return_details:
            return scores, metrics
        details = [dict(o.as_dict(), style=s) for o, s in zip(outcomes, styles)]
        return scores, metrics, details

    def _score_by_rules(self, items, styles, skip: set[int]) -> list[Outcome | None]:
        """In-process styles inline, pooled ones through the hard-timeout pool; ``skip`` stays None."""
        outcomes: list[Outcome | None] = [None] * len(items)
        pooled, tasks = [], []
        for i, (item, s) in enumerate(zip(items, styles)):
            if i in skip:
                continue
            style = get_style(s)
            if style.pooled:
                pooled.append(i)
                tasks.append((style.fn, (item, self.cfg, *style.bound),
                              getattr(self.cfg, style.timeout_section).timeout_s))
                continue
            try:
                outcomes[i] = style.fn(item, self.cfg, *style.bound)
            except Exception as exc:  # a per-sample fault is a counted zero
                outcomes[i] = Outcome(0.0, ERROR, detail=f"{type(exc).__name__}: {exc}")
        if tasks:
            for i, res in zip(pooled, self._pool_for_use().run(tasks)):
                if res.status == "ok":
                    outcomes[i] = res.value
                else:
                    outcomes[i] = Outcome(0.0, TIMEOUT if res.status == "timeout" else ERROR,
                                          detail=f"{styles[i]}: {res.error}")
        return outcomes

    def _apply_judge(self, items, styles, outcomes, judged: set[int]) -> dict:
        """The judge decides ``judged`` items; in fallback mode it re-checks rule failures."""
        jcfg = self.cfg.judge
        calls, flips, errors = 0, 0, 0
        main = sorted(judged)
        for i, out in zip(main, judge_batch([items[i] for i in main], jcfg)):
            outcomes[i] = out
            errors += out.status == ERROR
        calls += len(main)
        if jcfg.mode == "fallback":
            retry = [i for i, s in enumerate(styles)
                     if s in jcfg.styles and i not in judged and outcomes[i].status != CORRECT]
            for i, out in zip(retry, judge_batch([items[i] for i in retry], jcfg)):
                outcomes[i].detail = (outcomes[i].detail + f" judge:{out.status}").strip()
                errors += out.status == ERROR
                if out.status == CORRECT:
                    outcomes[i] = Outcome(1.0, CORRECT, outcomes[i].extracted, "judge_fallback")
                    flips += 1
            calls += len(retry)
        return {"reward/judge_calls": float(calls), "reward/judge_flips": float(flips),
                "reward/judge_errors": float(errors)}

    @staticmethod
    def _metrics(styles, outcomes, seconds: float) -> dict:
        scores = [float(o.score) for o in outcomes]
        counts = Counter(o.status for o in outcomes)
        metrics = {
            "reward/mean": sum(scores) / max(len(scores), 1),
            "reward/count": float(len(scores)),
            "reward/time_s": seconds,
            "reward/correct": float(counts[CORRECT]),
            "reward/wrong": float(counts[WRONG]),
            "reward/timeouts": float(counts[TIMEOUT]),
            "reward/errors": float(counts[ERROR]),
            "reward/unparsable": float(counts[UNPARSABLE]),
        }
        per_style = defaultdict(list)
        for s, sc in zip(styles, scores):
            per_style[s].append(sc)
        for s, vals in per_style.items():
            metrics[f"reward/{s}/mean"] = sum(vals) / len(vals)
        _log_failures(styles, outcomes)
        return metrics

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()
            self._pool = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


def _log_failures(styles: list[str], outcomes: list[Outcome]) -> None:
    """One line per style with counted zeros (crashes, timeouts, bad values) in this scoring call:
    how many, and the first one's reason."""
    failed: dict[str, list[Outcome]] = defaultdict(list)
    for s, o in zip(styles, outcomes):
        if o.status in (TIMEOUT, ERROR):
            failed[s].append(o)
    for s, outs in sorted(failed.items()):
        timeouts = sum(o.status == TIMEOUT for o in outs)
        log.warning("rewards: style %s: %d errors, %d timeouts of %d scored, each a counted zero (first: %s)",
                    s, len(outs) - timeouts, timeouts, styles.count(s), outs[0].detail[:300])


class RewardDataError(InputError, ValueError):
    """A prompt's reward style resolves to no registered style, or needs what cannot run here."""


def check_reward_styles(cfg: RewardConfig, records, path: str) -> dict[str, int]:
    """Resolve the reward style of every prompt of ``path`` (records with ``style``,
    ``data_source`` and ``row``) as scoring will, before anything is built: a RewardDataError naming
    the file and row of the first that resolves to nothing (scoring would fail mid-run), and, when
    some are scored by a style that runs programs, one when the code sandbox cannot start here (every
    such sample would be a counted zero: the run would train on nothing). Returns prompts per style."""
    manager = RewardManager(cfg)
    check_functions(cfg)
    counts: dict[str, int] = {}
    for r in records:
        try:
            style = manager.resolve_style(r.style, r.data_source)
        except KeyError as exc:
            raise RewardDataError(f"{path}: row {r.row}: {exc.args[0]}, or set reward.default_style") from None
        counts[style] = counts.get(style, 0) + 1
    sandboxed = sorted(s for s in counts if get_style(s).sandboxed)
    if sandboxed:
        from megatron_rl.rewards.sandbox import Sandbox, SandboxUnavailable

        try:
            Sandbox(cfg.code.sandbox)
        except SandboxUnavailable as exc:
            raise RewardDataError(f"{path}: {sum(counts[s] for s in sandboxed)} prompts are scored by reward "
                                  f"style {', '.join(sandboxed)}, which runs the responses' programs in the "
                                  f"sandbox: {exc}") from None
    return counts
