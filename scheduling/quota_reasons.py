"""Pending reasons under quotas: every pending job's reason names its quota step, with the numbers.

The step is where the job stands against its team's quota of owned capacity on the best GPU model
it could use (scheduling/quota.py `QuotaLedger.step`): "nominal" (it fits in the team's unused
nominal quota), "borrowing" (only by borrowing idle capacity), "limit" (past the team's borrowing
limit or the cohort's idle), or "none" (no managed flavor fits it). A job the quota filter held
back gets the quota's own code and sentence, e.g. `NOMINAL_QUOTA_USED: acme uses 16/16 nominal
A100-80GB and may borrow 8 more; the cohort has 0 idle, this job needs 4`.
"""

from __future__ import annotations

from scheduling.book import Book
from scheduling.model import JobDemand, Reason, ReasonCode
from scheduling.problem import Problem
from scheduling.quota import QuotaLedger, borrowing_barred, quota_governed, quota_message

STEP_ORDER = {"nominal": 0, "borrowing": 1, "limit": 2, "none": 3}
# Codes the quota replaces as the headline when it also blocks the job on its best owned model: it
# would wait for the quota even if that capacity were free (the capacity reason stays, as "before").
QUOTA_MAY_EXPLAIN = frozenset({
    ReasonCode.NOMINAL_QUOTA_USED, ReasonCode.INSUFFICIENT_GPUS, ReasonCode.CAPACITY_TAKEN, ReasonCode.OUTRANKED,
    ReasonCode.NO_NVLINK_ISLAND, ReasonCode.INSUFFICIENT_CPU_MEMORY, ReasonCode.INSUFFICIENT_GPU_MEMORY,
})


def owned_models(problem: Problem) -> list[str]:
    models = {gpu.model for node in problem.snapshot.nodes if quota_governed(node) for gpu in node.gpus if gpu.healthy}
    return sorted(models)


def best_step(ledger: QuotaLedger, problem: Problem, job: JobDemand, models: list[str]) -> tuple[str, str]:
    """(step, GPU model) at the job's best owned model; ("none", "") when no managed flavor fits it."""
    best = ("none", "")
    for model in models:
        if job.allowed_models and model not in job.allowed_models:
            continue
        step = ledger.step(job, model, problem.pricing.gpu_share(job, model))
        if STEP_ORDER[step] < STEP_ORDER[best[0]]:
            best = (step, model)
    return best


def annotate_quota_steps(problem: Problem, book: Book, reasons: dict[str, Reason],
                         jobs: dict[str, JobDemand] | None = None) -> None:
    """`jobs`: every pending job of the cycle by id (default the problem's; reclaimed-for jobs of the
    quota phases are not in the last phase's problem)."""
    ledger = book.quota
    if ledger is None:
        return
    jobs = jobs if jobs is not None else problem.jobs_by_id
    models = owned_models(problem)
    for job_id, reason in list(reasons.items()):
        job = jobs[job_id]
        step, model = best_step(ledger, problem, job, models)
        data = dict(reason.data)
        if step == "none":
            data["quota"] = {"step": step}
            reasons[job_id] = Reason(reason.code, reason.message, data)
            continue
        share = problem.pricing.gpu_share(job, model)
        blocking = ledger.blocking_flavor(job, model, share, borrowing=problem.ctx.borrowing)
        flavor, amount = blocking if blocking is not None else ledger.amounts(model, share)[0]
        info = ledger.describe(job.tenant, flavor, borrowing_barred(job, problem.ctx.borrowing))
        data["quota"] = {"step": step, **info}
        code, message = reason.code, reason.message
        if blocking is not None and code in QUOTA_MAY_EXPLAIN:
            limits = ledger.limits_of(job.tenant, flavor)
            by_limit = (limits.borrowing_limit is not None
                        and ledger.usage[job.tenant, flavor] + amount > limits.nominal + limits.borrowing_limit + 1e-9)
            code = ReasonCode.BORROWING_LIMIT if by_limit else ReasonCode.NOMINAL_QUOTA_USED
            message = f"{quota_message(code.value, info, amount)}; before: {reason.message}"
        else:
            message = (f"{message} [quota step {step}: {job.tenant} uses {info['used']:g}/{info['nominal']:g} "
                       f"nominal {flavor}]")
        reasons[job_id] = Reason(code, message, data)
