"""Why a job is still pending: a reason code, a sentence with the numbers, and the numbers as data.

Two cases. No candidate passed the filters: the code is the plugin that rejected the most nodes
and offers, and the sentence lists every plugin's count ("0/14 nodes fit: 9 have no GPU with >=
40 GB free, 5 lack a free NVLink island of 4; aws us-east-1 p4d.24xlarge: quota 0"). Some
candidates passed but the job was not placed: the tenant's quota or budget ran out this cycle,
higher-priority jobs took the capacity (OUTRANKED), or the global optimum used it better
(CAPACITY_TAKEN).
"""

from __future__ import annotations

from collections import Counter

from scheduling.book import Book
from scheduling.model import JobDemand, Reason, ReasonCode
from scheduling.plugins import FILTERS
from scheduling.problem import DemandClass, Problem


def explain_pending(problem: Problem, book: Book, job_ids: list[str]) -> dict[str, Reason]:
    placed_priorities = [problem.jobs_by_id[j].priority for j in book.placements if j in problem.jobs_by_id]
    top_placed = max(placed_priorities, default=None)
    reasons = {}
    for job_id in job_ids:
        job = problem.jobs_by_id[job_id]
        demand_class = problem.classes[problem.class_of[job_id]]
        reasons[job_id] = explain_job(problem, book, job, demand_class, top_placed)
    return reasons


def _nodes_total(problem: Problem) -> int:
    return sum(t.count for t in problem.targets if t.kind == "node")


def _offer_summary(demand_class: DemandClass) -> tuple[str, Counter]:
    by_plugin: Counter = Counter(name for _, name in demand_class.offer_rejections)
    texts = []
    seen: set[str] = set()
    for where, name in demand_class.offer_rejections:
        if name == "offer_quota" and where not in seen:
            seen.add(where)
            texts.append(f"{where}: quota 0")
    others = {name: n for name, n in by_plugin.items() if name != "offer_quota"}
    if others:
        texts.append(f"{sum(others.values())} cloud offers rejected ("
                     + ", ".join(f"{n} {FILTERS[name].code.value}" for name, n in sorted(others.items())) + ")")
    return "; ".join(texts[:6]), by_plugin


def _budget_phrase(problem: Problem, job: JobDemand) -> tuple[str, dict]:
    budget = problem.ctx.tenants.get(job.tenant)
    owner = budget.owner_budget(job.owner) if budget is not None else None
    if budget is None or (budget.remaining_budget is None and owner is None):
        return "", {}
    costs = [problem.pricing.money(job, t) for t in problem.targets
             if problem.pricing.part(job, t.gpu_model) is not None]
    if not costs:
        return "", {}
    cheapest = min(costs)
    if budget.remaining_budget is not None and cheapest > budget.remaining_budget:
        return (f"budget: {job.tenant} has ${budget.remaining_budget:,.0f} left, cheapest fit costs ${cheapest:,.0f}",
                {"budget_left": budget.remaining_budget, "cheapest_fit_cost": cheapest})
    if owner is not None and cheapest > owner.remaining_budget + 1e-9:
        words = _owner_words(job, owner.remaining_budget, owner.monthly_budget)
        return (f"{words}, cheapest fit costs ${cheapest:,.2f}",
                _owner_data(job, owner.remaining_budget, owner.monthly_budget, cheapest))
    return "", {}


def _owner_words(job: JobDemand, left: float, monthly: float) -> str:
    return f"budget: user {job.owner} of {job.tenant} has ${max(0.0, left):,.2f} left of ${monthly:,.2f} this month"


def _owner_data(job: JobDemand, left: float, monthly: float, cheapest: float) -> dict:
    return {"user": job.owner, "user_budget_left": max(0.0, left), "user_budget": monthly,
            "cheapest_fit_cost": cheapest}


def explain_job(problem: Problem, book: Book, job: JobDemand, demand_class: DemandClass,
                top_placed_priority: int | None) -> Reason:
    if demand_class.invalid:
        return Reason(ReasonCode.INVALID_DEMAND, f"INVALID_DEMAND: {demand_class.invalid}",
                      {"problem": demand_class.invalid})
    total = _nodes_total(problem)
    if not demand_class.candidates:
        return _no_candidate_reason(problem, job, demand_class, total)
    return _lost_reason(problem, book, job, demand_class, top_placed_priority)


def _no_candidate_reason(problem: Problem, job: JobDemand, demand_class: DemandClass, total: int) -> Reason:
    offers_text, offer_counts = _offer_summary(demand_class)
    combined: Counter = Counter(demand_class.rejections)
    combined.update(offer_counts)
    order = {name: i for i, name in enumerate(problem.policy.filters)}
    # Nodes of pools the team cannot use say nothing about why it waits where it may run: they give
    # the headline only when nothing else rejected anything (on a shared cluster they outnumber the
    # team's full nodes, and the planners, reclaim included, skip NO_POOL_ACCESS jobs).
    heard = {name: n for name, n in combined.items() if n and name != "pool_access"} or dict(combined)
    if heard:
        top = min(heard, key=lambda name: (-heard[name], order.get(name, 99)))
        code = FILTERS[top].code
    else:
        code = ReasonCode.INSUFFICIENT_GPUS
    node_phrases = [FILTERS[name].phrase(job, n) for name, n in
                    sorted(demand_class.rejections.items(), key=lambda kv: (-kv[1], order.get(kv[0], 99))) if n]
    sentence = f"0/{total} nodes fit" + (": " + ", ".join(node_phrases) if node_phrases else "")
    if offers_text:
        sentence += f"; {offers_text}"
    elif not problem.snapshot.offers:
        sentence += "; no cloud offers"
    budget_text, budget_data = _budget_phrase(problem, job)
    if budget_text:
        sentence += f"; {budget_text}"
    data = {"nodes_total": total, "nodes_fit": 0, "rejections": dict(demand_class.rejections),
            "offer_rejections": dict(offer_counts), **budget_data}
    return Reason(code, f"{code.value}: {sentence}", data)


def _lost_reason(problem: Problem, book: Book, job: JobDemand, demand_class: DemandClass,
                 top_placed_priority: int | None) -> Reason:
    fitting_nodes = sum(problem.targets[c.target].count for c in demand_class.candidates
                        if problem.targets[c.target].kind == "node")
    fitting_offers = [problem.targets[c.target].describe() for c in demand_class.candidates
                      if problem.targets[c.target].kind == "offer"]
    cheapest = min(c.money for c in demand_class.candidates)
    data: dict = {"nodes_fit_at_start": fitting_nodes, "offers_fit": fitting_offers, "cheapest_fit_cost": cheapest}
    allowance = book.allowances.get(job.tenant)
    if allowance is not None:
        pricing = problem.pricing
        models = [problem.targets[c.target].gpu_model for c in demand_class.candidates]
        need_gpus = min(pricing.gpu_share(job, m) for m in models)
        need_cus = min(pricing.compute_units(job, m) for m in models)
        if allowance.gpus is not None and need_gpus > allowance.gpus + 1e-9:
            data.update(quota_left_gpus=allowance.gpus, needs_gpus=need_gpus)
            return Reason(ReasonCode.QUOTA_EXCEEDED,
                          f"QUOTA_EXCEEDED: tenant {job.tenant} has {max(0.0, allowance.gpus):g} GPUs of quota left "
                          f"after this cycle's placements, the job needs {need_gpus:g}", data)
        if allowance.cus is not None and need_cus > allowance.cus + 1e-9:
            data.update(quota_left_cu=allowance.cus, needs_cu=need_cus)
            return Reason(ReasonCode.QUOTA_EXCEEDED,
                          f"QUOTA_EXCEEDED: tenant {job.tenant} has {max(0.0, allowance.cus):g} CU of quota left, "
                          f"the job needs {need_cus:g}", data)
        if allowance.dollars is not None and cheapest > allowance.dollars + 1e-9:
            data.update(budget_left=allowance.dollars)
            return Reason(ReasonCode.BUDGET_EXCEEDED,
                          f"BUDGET_EXCEEDED: budget: {job.tenant} has ${max(0.0, allowance.dollars):,.2f} left after "
                          f"this cycle's placements, cheapest fit costs ${cheapest:,.2f}", data)
    owner = book.owner_allowance(job)
    if owner is not None and owner.dollars is not None and cheapest > owner.dollars + 1e-9:
        monthly = problem.ctx.tenants[job.tenant].owner_budget(job.owner).monthly_budget
        data.update(_owner_data(job, owner.dollars, monthly, cheapest))
        return Reason(ReasonCode.BUDGET_EXCEEDED,
                      f"BUDGET_EXCEEDED: {_owner_words(job, owner.dollars, monthly)} after this cycle's "
                      f"placements, cheapest fit costs ${cheapest:,.2f}", data)
    where = f"{fitting_nodes} nodes" + (f" and {len(fitting_offers)} cloud offers" if fitting_offers else "")
    offer_left = {offer.id: book.launches_left(offer.id, offer.launch_group)
                  for offer in (problem.targets[c.target].offer for c in demand_class.candidates) if offer is not None}
    if offer_left:
        data["offer_launchable_left"] = offer_left
        left_total = sum(offer_left.values())
        where += (f" (launch quota now used up on {len(offer_left)} fitting offers)" if left_total == 0
                  else f" ({left_total} launches still allowed on fitting offers)")
    data["placed_this_cycle"] = len(book.placements)
    if top_placed_priority is not None and top_placed_priority > job.priority:
        data["outranked_by_priority"] = top_placed_priority
        return Reason(ReasonCode.OUTRANKED,
                      f"OUTRANKED: {where} fit at the start of the cycle, but jobs of priority up to "
                      f"{top_placed_priority} (this job: {job.priority}) took the capacity", data)
    if cheapest > demand_class.waiting_cost:
        data["waiting_cheaper"] = True
        return Reason(ReasonCode.CAPACITY_TAKEN,
                      f"CAPACITY_TAKEN: the cheapest fit costs ${cheapest:,.2f}, more than the policy's waiting "
                      f"cost ${demand_class.waiting_cost:,.2f}; it waits for cheaper capacity", data)
    return Reason(ReasonCode.CAPACITY_TAKEN,
                  f"CAPACITY_TAKEN: {where} fit at the start of the cycle, but the cycle's global placement used "
                  f"that capacity for other jobs of equal or higher priority", data)
