"""One slot row per (allocation, GPU) with its slots as a bit mask, instead of one row per slot.

The per-slot unique index (gpu, slot) becomes ten partial unique indexes on the GPU, one per slot bit
(broker/jobs/models.py, AllocationSlice). Existing rows are merged: an allocation's rows on one GPU
become one row holding all their slots (active rows and released ones separately)."""
from __future__ import annotations

from django.db import migrations, models
from django.db.models import F, Q
from django.db.models.lookups import GreaterThan

SLOTS = 10  # Gpu.SLOTS when this migration was written


def merge_slot_rows(apps, schema_editor) -> None:
    Slice = apps.get_model("jobs", "AllocationSlice")
    groups: dict[tuple[int, int, bool], list[tuple[int, int]]] = {}
    for pk, allocation_id, gpu_id, active, slot in Slice.objects.order_by("pk").values_list(
            "pk", "allocation_id", "gpu_id", "active", "slot").iterator(chunk_size=10_000):
        groups.setdefault((allocation_id, gpu_id, active), []).append((pk, slot))
    keep, drop = [], []
    for rows in groups.values():
        mask = 0
        for _, slot in rows:
            mask |= 1 << slot
        keep.append(Slice(pk=rows[0][0], mask=mask, slots=bin(mask).count("1")))
        drop += [pk for pk, _ in rows[1:]]
    Slice.objects.bulk_update(keep, ["mask", "slots"], batch_size=1_000)
    for start in range(0, len(drop), 10_000):
        Slice.objects.filter(pk__in=drop[start:start + 10_000]).delete()


def split_slot_rows(apps, schema_editor) -> None:
    Slice = apps.get_model("jobs", "AllocationSlice")
    for row in list(Slice.objects.all()):
        slots = [slot for slot in range(SLOTS) if row.mask >> slot & 1]
        row.slot = slots[0] if slots else 0
        row.save(update_fields=["slot"])
        Slice.objects.bulk_create([Slice(allocation_id=row.allocation_id, gpu_id=row.gpu_id, slot=slot,
                                         mask=0, slots=0, active=row.active) for slot in slots[1:]])


class Migration(migrations.Migration):

    dependencies = [
        ("jobs", "0009_single_column_indexes_dropped"),
    ]

    operations = [
        migrations.RemoveConstraint(model_name="allocationslice", name="one_active_holder_per_gpu_slot"),
        migrations.AddField(model_name="allocationslice", name="mask",
                            field=models.PositiveSmallIntegerField(default=0), preserve_default=False),
        migrations.AddField(model_name="allocationslice", name="slots",
                            field=models.PositiveSmallIntegerField(default=0), preserve_default=False),
        migrations.AlterField(model_name="allocationslice", name="slot",
                              field=models.PositiveSmallIntegerField(default=0)),
        migrations.RunPython(merge_slot_rows, split_slot_rows),
        migrations.RemoveField(model_name="allocationslice", name="slot"),
        *[migrations.AddConstraint(
            model_name="allocationslice",
            constraint=models.UniqueConstraint(fields=["gpu"], name=f"one_active_holder_gpu_slot_{slot}",
                                               condition=Q(GreaterThan(F("mask").bitand(1 << slot), 0),
                                                           active=True)))
          for slot in range(SLOTS)],
        migrations.AddConstraint(
            model_name="allocationslice",
            constraint=models.CheckConstraint(condition=Q(mask__gte=1, mask__lt=1 << SLOTS), name="slice_mask_in_range")),
        migrations.AddIndex(model_name="allocationslice",
                            index=models.Index(fields=["gpu"], condition=Q(active=True), name="slice_active_gpu")),
    ]
