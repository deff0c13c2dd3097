"""The broker's metrics for Prometheus, read from the database at scrape time.

Read at scrape time, not counted in memory: the web server, the worker and beat are separate
processes (and production runs several of each), so only the database has the whole picture. Every
figure is one aggregate query. Names follow Kueue's and Volcano's patterns (`<system>_<what>`,
`_total` for counters, `_seconds` for durations).

- `whalezen_jobs{tenant,state}` and `whalezen_pending_jobs{tenant,reason}` (the pending reason code);
- `whalezen_gpus{tenant,pool,model,state}`: state `free`, `allocated` (any slot held), `unhealthy`
  (health FAILED) or `offline` (its node is not ONLINE);
- `whalezen_cloud_instances{provider,state}`;
- `whalezen_admitted_jobs_total{tenant}` (allocations made), `whalezen_preempted_jobs_total{tenant}`,
  `whalezen_migrations_total{cause,result}` (finished moves by outcome);
- `whalezen_scheduling_cycle_duration_seconds{phase}`, a histogram over the recorded cycles
  (CycleRecord): `solve` (the engine), `snapshot`, `commit` and `reasons` (cycles that recorded phases);
- `whalezen_spend_dollars{tenant,provider}`: month-to-date spend by pool kind, the figure budgets
  are checked against (broker/scheduler/spend.py).

`whalezen_api_request_duration_seconds{method,route,status}` is counted in the serving processes
instead (broker/ops/request_metrics.py).
"""
from __future__ import annotations

from typing import Iterator

from django.utils import timezone
from django.db.models import Count, Exists, FloatField, OuterRef, Q, Sum
from django.db.models.fields.json import KeyTextTransform
from django.db.models.functions import Cast
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from broker.inventory.models import CloudInstance, Gpu, GpuHealth, NodeState
from broker.jobs.models import Allocation, AllocationSlice, Job, JobEvent, Migration, MigrationState
from broker.jobs.states import JobState
from broker.scheduler.models import CycleRecord
from broker.scheduler.spend import month_to_date_spend_by_provider

CYCLE_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
FINISHED_MOVES = (MigrationState.COMPLETED, MigrationState.ROLLED_BACK, MigrationState.ABANDONED)


class BrokerCollector(Collector):
    def collect(self) -> Iterator[Metric]:
        yield from (self._jobs(), self._pending(), self._gpus(), self._instances(), self._admitted(),
                    self._preempted(), self._migrations(), self._cycles(), self._spend())

    @staticmethod
    def _jobs() -> Metric:
        family = GaugeMetricFamily("whalezen_jobs", "Jobs by tenant and state.", labels=["tenant", "state"])
        for row in Job.objects.values("tenant__slug", "state").annotate(n=Count("id")).order_by():
            family.add_metric([row["tenant__slug"], row["state"]], row["n"])
        return family

    @staticmethod
    def _pending() -> Metric:
        family = GaugeMetricFamily("whalezen_pending_jobs", "Pending jobs by tenant and the reason code they wait for.",
                                   labels=["tenant", "reason"])
        for row in (Job.objects.filter(state=JobState.PENDING).values("tenant__slug", "pending_reason_code")
                    .annotate(n=Count("id")).order_by()):
            family.add_metric([row["tenant__slug"], row["pending_reason_code"] or "NONE"], row["n"])
        return family

    @staticmethod
    def _gpus() -> Metric:
        family = GaugeMetricFamily("whalezen_gpus", "GPUs by tenant, pool, model and state (free, allocated, "
                                   "unhealthy, offline).", labels=["tenant", "pool", "model", "state"])
        held = AllocationSlice.objects.filter(gpu=OuterRef("pk"), active=True)
        counts: dict[tuple[str, str, str, str], int] = {}
        for row in (Gpu.objects.annotate(held=Exists(held))
                    .values("node__tenant__slug", "node__pool__name", "model__name", "model_name", "node__state",
                            "health", "held").annotate(n=Count("id")).order_by()):
            if row["node__state"] != NodeState.ONLINE:
                state = "offline"
            elif row["health"] == GpuHealth.FAILED:
                state = "unhealthy"
            else:
                state = "allocated" if row["held"] else "free"
            key = (row["node__tenant__slug"], row["node__pool__name"], row["model__name"] or row["model_name"], state)
            counts[key] = counts.get(key, 0) + row["n"]
        for key, n in sorted(counts.items()):
            family.add_metric(list(key), n)
        return family

    @staticmethod
    def _instances() -> Metric:
        family = GaugeMetricFamily("whalezen_cloud_instances", "Cloud instances by provider and state.",
                                   labels=["provider", "state"])
        for row in CloudInstance.objects.values("pool__kind", "state").annotate(n=Count("id")).order_by():
            family.add_metric([row["pool__kind"], row["state"]], row["n"])
        return family

    @staticmethod
    def _admitted() -> Metric:
        family = CounterMetricFamily("whalezen_admitted_jobs", "Placements made (a job placed again after a "
                                     "move or requeue counts again).", labels=["tenant"])
        for row in Allocation.objects.values("job__tenant__slug").annotate(n=Count("id")).order_by():
            family.add_metric([row["job__tenant__slug"]], row["n"])
        return family

    @staticmethod
    def _preempted() -> Metric:
        family = CounterMetricFamily("whalezen_preempted_jobs", "Jobs preempted for higher-priority ones.",
                                     labels=["tenant"])
        for row in (JobEvent.objects.filter(kind="state", reason_code="PREEMPTED").values("job__tenant__slug")
                    .annotate(n=Count("id")).order_by()):
            family.add_metric([row["job__tenant__slug"]], row["n"])
        return family

    @staticmethod
    def _migrations() -> Metric:
        family = CounterMetricFamily("whalezen_migrations", "Finished moves of running jobs by cause and result.",
                                     labels=["cause", "result"])
        for row in (Migration.objects.filter(state__in=FINISHED_MOVES).values("cause", "state")
                    .annotate(n=Count("id")).order_by()):
            family.add_metric([row["cause"], row["state"]], row["n"])
        return family

    @staticmethod
    def _cycles() -> Metric:
        family = HistogramMetricFamily("whalezen_scheduling_cycle_duration_seconds",
                                       "Scheduling cycle time by phase (the engine's solve, per recorded cycle).",
                                       labels=["phase"])
        buckets = {f"le_{i}": Count("id", filter=Q(solve_seconds__lte=b)) for i, b in enumerate(CYCLE_BUCKETS_S)}
        row = CycleRecord.objects.aggregate(total=Count("id"), seconds=Sum("solve_seconds"), **buckets)
        family.add_metric(["solve"], [(repr(b), row[f"le_{i}"]) for i, b in enumerate(CYCLE_BUCKETS_S)]
                          + [("+Inf", row["total"])], sum_value=row["seconds"] or 0.0)
        # The whole cycle's other phases, from the records that have them (CycleRecord.phases).
        for phase in ("snapshot", "commit", "reasons"):
            recorded = CycleRecord.objects.filter(**{f"phases__{phase}__isnull": False})
            counts = recorded.aggregate(
                total=Count("id"), seconds=Sum(Cast(KeyTextTransform(phase, "phases"), FloatField())),
                **{f"le_{i}": Count("id", filter=Q(**{f"phases__{phase}__lte": b}))
                   for i, b in enumerate(CYCLE_BUCKETS_S)})
            family.add_metric([phase], [(repr(b), counts[f"le_{i}"]) for i, b in enumerate(CYCLE_BUCKETS_S)]
                              + [("+Inf", counts["total"])], sum_value=counts["seconds"] or 0.0)
        return family


    @staticmethod
    def _spend() -> Metric:
        family = GaugeMetricFamily("whalezen_spend_dollars", "Month-to-date spend in dollars by tenant and "
                                   "provider (pool kind), as budgets count it.", labels=["tenant", "provider"])
        for (tenant, provider), dollars in sorted(month_to_date_spend_by_provider(now=timezone.now()).items()):
            family.add_metric([tenant, provider], round(dollars, 6))
        return family
