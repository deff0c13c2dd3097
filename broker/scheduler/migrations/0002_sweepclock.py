from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ("scheduler", "0001_initial"),
    ]

    operations = [
        migrations.CreateModel(
            name="SweepClock",
            fields=[
                ("id", models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name="ID")),
                ("name", models.CharField(max_length=64, unique=True)),
                ("last_run_at", models.DateTimeField()),
                ("resumed_at", models.DateTimeField(blank=True, null=True)),
                ("outage_seconds", models.FloatField(default=0, help_text="Length of the latest outage seen")),
            ],
        ),
    ]
