"""One GPU UUID, one GPU row. Rows from before the check (a UUID copied onto a second node through a
leaked join token) keep the UUID on the oldest row only; the others forget it, so the constraint can
be built and the node that really has the GPU can register it again."""
from django.db import migrations, models


def forget_duplicate_uuids(apps, schema_editor):
    Gpu = apps.get_model("inventory", "Gpu")
    seen: set[str] = set()
    for pk, uuid in Gpu.objects.exclude(uuid="").order_by("pk").values_list("pk", "uuid").iterator():
        if uuid in seen:
            Gpu.objects.filter(pk=pk).update(uuid="")
        seen.add(uuid)


class Migration(migrations.Migration):

    dependencies = [
        ('inventory', '0002_cloudinstance_attempt_cloudinstance_join_token_hash_and_more'),
    ]

    operations = [
        migrations.RunPython(forget_duplicate_uuids, migrations.RunPython.noop),
        migrations.AddConstraint(
            model_name='gpu',
            constraint=models.UniqueConstraint(condition=models.Q(('uuid', ''), _negated=True), fields=('uuid',), name='uniq_gpu_uuid'),
        ),
    ]
