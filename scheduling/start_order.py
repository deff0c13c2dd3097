"""Within one team, the oldest of its interchangeable jobs start first.

The engine prices a placement by the job's expected duration, so when a cycle has one free owned
GPU and two like jobs of a team, it gives the GPU to the one expected to run longer (more rented
hours saved) and launches an instance for the other, whichever waited longer. A job that had
already waited most of a cycle then also waited for the instance's boot: in the shared-capacity
benchmark those jobs were the tail of the queueing delay (bench/README.md section 7). So after
placing, among the jobs of one team that are interchangeable (every demand field equal but
identity, submission time and expected duration), those that start at once (an owned node, or a
running instance's free GPUs) are the oldest, and the younger ones take the new instances' boots.
As Kueue and Slurm order a queue by age at equal priority.

Swapping two like jobs' placements leaves every node, instance, quota charge and launch as it was;
only the dollars follow the durations. A team (or job owner) with a budget keeps the cheaper
assignment, against which its budget was checked.
"""

from __future__ import annotations

from dataclasses import replace

from scheduling.book import Book
from scheduling.model import JobDemand, Placement
from scheduling.problem import class_fields


def start_oldest_first(jobs: dict[str, JobDemand], book: Book, earlier: dict[str, Placement]) -> int:
    """Swap placements so that, per team and demand, no job starts after a newer one; return the
    number of swaps. `earlier` holds placements of a previous phase (the nominal-quota phase),
    `book` the cycle's final book; each swapped placement stays in the dict it came from, so the
    book's launches keep listing the jobs that wait for them."""
    def home(job_id: str) -> dict[str, Placement]:
        return earlier if job_id in earlier else book.placements

    placed = [jobs[job_id] for job_id in [*earlier, *book.placements] if job_id in jobs]
    booting = {job.job_id for job in placed if _waits_for_boot(home(job.job_id)[job.job_id])}
    # Only jobs like one that waits for a boot can swap; a cheap key first (5,000 jobs, 66 launches:
    # the full key of every job cost 2-3% of bench.scale's cycle).
    booting_keys = {_quick_key(jobs[job_id]) for job_id in booting}
    groups: dict[tuple, list[JobDemand]] = {}
    for job in placed:
        if _quick_key(job) in booting_keys and not _has_budget(book, job):
            groups.setdefault((job.tenant, class_fields(job)), []).append(job)
    swaps = 0
    for members in groups.values():
        if len(members) < 2:
            continue
        waiting = sorted((j for j in members if j.job_id in booting), key=lambda j: (j.submitted_at, j.job_id))
        at_once = sorted((j for j in members if j.job_id not in booting),
                         key=lambda j: (j.submitted_at, j.job_id), reverse=True)
        for older, newer in zip(waiting, at_once):
            if (older.submitted_at, older.job_id) >= (newer.submitted_at, newer.job_id):
                break
            older_home, newer_home = home(older.job_id), home(newer.job_id)
            boot, now = older_home.pop(older.job_id), newer_home.pop(newer.job_id)
            newer_home[older.job_id] = replace(now, job_id=older.job_id)
            older_home[newer.job_id] = replace(boot, job_id=newer.job_id)
            swaps += 1
    return swaps


def _quick_key(job: JobDemand) -> tuple:
    return job.tenant, job.gpus, job.gpu_milli, job.cpu_milli, job.memory_mb


def _waits_for_boot(placement: Placement) -> bool:
    return any(part.launch_id is not None for part in placement.parts)


def _has_budget(book: Book, job: JobDemand) -> bool:
    allowance = book.allowances.get(job.tenant)
    return (allowance is not None and allowance.dollars is not None) or book.owner_allowance(job) is not None
