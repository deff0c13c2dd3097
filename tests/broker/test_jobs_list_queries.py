"""GET /api/v1/jobs/ reads a page in a fixed number of queries, whatever the page size (no N+1)."""
from __future__ import annotations

from django.db import connection
from django.test.utils import CaptureQueriesContext

from broker.jobs.services import GpuRequest, allocation_commit

from .test_api_tenancy import submit

# Authentication (the token; its last-use time is written at most once a minute), membership, count,
# the page's ids, its rows with their owners, allocations, their slices, GPUs and nodes: 9, a fixed set,
# not one per job.
MAX_QUERIES = 9


def _jobs(acme, count: int) -> None:
    placed = 0
    for i in range(count):
        job = submit(acme, name=f"train-{i}", resources={"gpus": 1} if i % 2 else {"gpu_fraction": 0.5})
        if i % 3 == 0:  # a third hold GPUs: their allocations, slices and GPUs are serialised too
            node = acme.nodes[placed % 2]
            allocation_commit(job=job, requests=[GpuRequest(node=node, gpu_indices=((placed // 2) % 8,),
                                                            milli=1000 if i % 2 else 500)])
            placed += 1


def _count(client, path: str) -> tuple[int, dict]:
    client.get("/api/v1/jobs/?page_size=1")  # the token's last-use write happens on this one, not below
    with CaptureQueriesContext(connection) as queries:
        resp = client.get(path)
    assert resp.status_code == 200, resp.content
    return len(queries), resp.json()


def test_the_jobs_list_takes_as_many_queries_for_30_jobs_as_for_3(acme, django_assert_max_num_queries):
    _jobs(acme, 30)
    small, small_body = _count(acme.client, "/api/v1/jobs/?page_size=3")
    large, large_body = _count(acme.client, "/api/v1/jobs/?page_size=30")
    assert len(small_body["results"]) == 3 and len(large_body["results"]) == 30
    assert any(job["allocations"] for job in large_body["results"])  # the prefetches were exercised
    assert small == large
    with django_assert_max_num_queries(MAX_QUERIES):
        acme.client.get("/api/v1/jobs/?page_size=30")


def test_a_deep_page_is_read_by_its_ids_in_the_lists_order(acme):
    _jobs(acme, 30)
    every = [job["id"] for job in acme.client.get("/api/v1/jobs/?page_size=30").json()["results"]]
    assert every == sorted(every, reverse=True)  # newest first
    third = acme.client.get("/api/v1/jobs/?page_size=7&page=3").json()
    assert [job["id"] for job in third["results"]] == every[14:21] and third["count"] == 30


def test_a_filtered_page_is_no_dearer(acme):
    _jobs(acme, 30)
    small, _ = _count(acme.client, "/api/v1/jobs/?state=PLACED&page_size=2")
    large, body = _count(acme.client, "/api/v1/jobs/?state=PLACED&page_size=10")
    assert len(body["results"]) == 10 and {job["state"] for job in body["results"]} == {"PLACED"}
    assert small == large <= MAX_QUERIES
