from django.core.paginator import Page, Paginator
from django.db.models import QuerySet
from rest_framework.pagination import PageNumberPagination


class DeferredJoinPaginator(Paginator):
    """Pages of a model queryset read in two steps: the page's primary keys first (OFFSET over an index:
    no row is read just to be skipped), then those rows with their select_related and prefetches, in
    the same order. Deep pages cost what the first does (bench/service.py --parts reads: page 1,000 of
    100,000 jobs read 50,000 whole rows, spec JSON and all, to throw them away)."""

    def page(self, number) -> Page:
        number = self.validate_number(number)
        bottom = (number - 1) * self.per_page
        top = min(bottom + self.per_page, self.count)
        items = self.object_list
        if not isinstance(items, QuerySet) or items._fields is not None or items.query.distinct:
            return self._get_page(items[bottom:top], number, self)  # values(), DISTINCT: as Django does
        ids = list(items.values_list("pk", flat=True)[bottom:top])
        fetched = items.filter(pk__in=ids).order_by()
        by_pk = {row.pk: row for row in fetched}
        return self._get_page([by_pk[pk] for pk in ids if pk in by_pk], number, self)


class StandardPagination(PageNumberPagination):
    """Page-number pagination; clients may ask for up to 500 rows with `page_size`."""

    page_size_query_param = "page_size"
    max_page_size = 500
    django_paginator_class = DeferredJoinPaginator
