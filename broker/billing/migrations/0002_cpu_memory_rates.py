# CPU and memory chargeback (issue 13): rates fixed on the allocation's meter, amounts on its usage records.
# Written by hand (only these fields): 0002_user_budgets changes the same app in parallel.
from django.db import migrations, models


def _rate() -> models.DecimalField:
    return models.DecimalField(blank=True, decimal_places=6, max_digits=12, null=True)


class Migration(migrations.Migration):
    dependencies = [("billing", "0001_initial")]

    operations = [
        migrations.AddField("allocationmeter", "cpu_rate_usd_per_core_hour", _rate()),
        migrations.AddField("allocationmeter", "memory_rate_usd_per_gib_hour", _rate()),
        migrations.AddField("usagerecord", "cpu_core_seconds", models.DecimalField(
            decimal_places=3, default=0, help_text="vCPU-seconds", max_digits=18)),
        migrations.AddField("usagerecord", "memory_gib_seconds", models.DecimalField(
            decimal_places=10, default=0, help_text="GiB-seconds (memory_mb / 1024), exact", max_digits=24)),
        migrations.AddField("usagerecord", "cpu_rate_usd_per_core_hour", _rate()),
        migrations.AddField("usagerecord", "memory_rate_usd_per_gib_hour", _rate()),
        migrations.AddField("usagerecord", "cpu_amount_usd", models.DecimalField(
            decimal_places=2, default=0, max_digits=14)),
        migrations.AddField("usagerecord", "memory_amount_usd", models.DecimalField(
            decimal_places=2, default=0, max_digits=14)),
    ]
