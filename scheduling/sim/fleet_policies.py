"""Fleet baselines for the cost week: on-prem-only FIFO and greedy cheapest offer per job.

* ``onprem-fifo``: Slurm-like strict FIFO on the on-prem nodes only; the oldest pending job
  starts when one node has enough free GPUs, and nothing behind it may jump the queue
  (head-of-line blocking, no backfill).
* ``greedy-cheapest``: what SkyPilot and dstack do for each job in arrival order: take the option
  with the lowest hourly price that can start now, on-prem (at its internal rate, for the GPUs it
  uses) or a fresh cloud instance with enough GPUs of an allowed model.  One instance per job;
  it is released when the job ends.  The price compared is per hour, not per unit of work.
"""

from __future__ import annotations

from scheduling.sim.events import Action, Launch, NodeRun, Simulator, SimOffer, Start


def _allowed(model: str, allowed: tuple[str, ...]) -> bool:
    return not allowed or model in allowed


def _best_fit_onprem(sim: Simulator, gpus: int, allowed: tuple[str, ...],
                     taken: dict[str, set[int]]) -> tuple[NodeRun, tuple[int, ...]] | None:
    """On-prem node with the fewest free GPUs that still fits (ties: node id), and its GPUs."""
    best: tuple[int, str, NodeRun, list[int]] | None = None
    for nid, run in sim.nodes.items():
        if run.offer is not None or not _allowed(run.node.model, allowed):
            continue
        free = [g for g in run.free_gpus if g not in taken.get(nid, set())]
        if len(free) >= gpus and (best is None or (len(free), nid) < best[:2]):
            best = (len(free), nid, run, free)
    if best is None:
        return None
    return best[2], tuple(best[3][:gpus])


class OnPremFifo:
    name = "onprem-fifo"

    def decide(self, sim: Simulator) -> list[Action]:
        actions: list[Action] = []
        taken: dict[str, set[int]] = {}
        for r in sorted(sim.pending, key=lambda r: (r.job.submit_s, r.job.id)):
            fit = _best_fit_onprem(sim, r.job.gpus, r.job.allowed_models, taken)
            if fit is None:
                break  # strict FIFO: the head blocks everyone behind it
            run, gpus = fit
            taken.setdefault(run.node.id, set()).update(gpus)
            actions.append(Start(r.job.id, run.node.id, gpus))
        return actions


class GreedyCheapest:
    name = "greedy-cheapest"

    def cheapest_offer(self, offers: list[SimOffer], gpus: int, allowed: tuple[str, ...],
                       spot_ok: bool = False) -> tuple[SimOffer, bool, float] | None:
        """Cheapest (offer, spot, hourly price) with enough GPUs; spot only if the job allows it."""
        best: tuple[float, str, bool, SimOffer] | None = None
        for o in offers:
            if o.gpus < gpus or not _allowed(o.model, allowed):
                continue
            options = [(o.price_per_hour, False)]
            if spot_ok and o.spot_price_per_hour is not None:
                options.append((o.spot_price_per_hour, True))
            for price, spot in options:
                if best is None or (price, o.id, spot) < best[:3]:
                    best = (price, o.id, spot, o)
        return None if best is None else (best[3], best[2], best[0])

    def decide(self, sim: Simulator) -> list[Action]:
        actions: list[Action] = []
        taken: dict[str, set[int]] = {}
        for r in sorted(sim.pending, key=lambda r: (r.job.submit_s, r.job.id)):
            job = r.job
            onprem = _best_fit_onprem(sim, job.gpus, job.allowed_models, taken)
            offer = self.cheapest_offer(sim.offers, job.gpus, job.allowed_models, job.spot_ok)
            onprem_rate = (job.gpus * onprem[0].node.price_per_gpu_hour) if onprem else float("inf")
            offer_rate = offer[2] if offer else float("inf")
            if onprem is not None and onprem_rate <= offer_rate:
                run, gpus = onprem
                taken.setdefault(run.node.id, set()).update(gpus)
                actions.append(Start(job.id, run.node.id, gpus))
            elif offer is not None:
                actions.append(Launch(offer[0].id, (job.id,), spot=offer[1]))
        return actions
